"""A producer's announcements: which items it holds, published to consumers and gateways.

Each stored or evicted item at once, a snapshot of everything held every
`announce_interval_s` (it heals what a subscriber missed); catalogs (catalog.py) follow them.
"""

from __future__ import annotations

import queue
import threading
import time

import msgspec
import zmq

from ec_connectors.channel import encode
from ec_connectors.log import get_logger
from ec_connectors.protocol.curve import CurveKeys
from ec_connectors.protocol.stored import ItemInfo
from ec_connectors.transports.peer_pull.messages import Announce, Evicted, Snapshot
from ec_connectors.transports.peer_pull.producer_store import ProducerStore

logger = get_logger(__name__)


class Announcer:
    """ZMQ PUB of a producer: each stored/evicted item at once, a full snapshot periodically."""

    def __init__(self, bind: str, endpoint: str, store: ProducerStore, interval_s: float,
                 context: zmq.Context, namespace: str, curve: CurveKeys | None = None):
        self.endpoint = endpoint
        self.namespace = namespace
        self._store = store
        self._interval_s = interval_s
        self._queue: queue.SimpleQueue[msgspec.Struct | None] = queue.SimpleQueue()
        self._sock = context.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        if curve is not None:  # only holders of the deployment secret may subscribe
            curve.server(self._sock)
        self._sock.bind(bind)
        self._thread = threading.Thread(target=self._run, name="epd-announce", daemon=True)
        self._thread.start()

    def stored(self, info: ItemInfo) -> None:
        """Announce an item just stored."""
        self._queue.put(Announce(endpoint=self.endpoint, items=[info], namespace=self.namespace))

    def evicted(self, keys: list[str]) -> None:
        """Announce keys no longer held."""
        if keys:
            self._queue.put(Evicted(endpoint=self.endpoint, keys=keys, namespace=self.namespace))

    def _run(self) -> None:
        next_snapshot = 0.0
        try:
            while True:
                try:
                    msg = self._queue.get(timeout=max(0.0, next_snapshot - time.monotonic()))
                except queue.Empty:
                    keys, sizes = self._store.catalog()
                    msg = Snapshot(endpoint=self.endpoint, keys=keys, nbytes=sizes,
                                   interval_s=self._interval_s, namespace=self.namespace)
                    next_snapshot = time.monotonic() + self._interval_s
                if msg is None:
                    return
                self._sock.send(encode(msg))
        finally:
            self._sock.close()

    def close(self) -> None:
        """Stop publishing once what is queued went out."""
        self._queue.put(None)
        self._thread.join(timeout=5)
