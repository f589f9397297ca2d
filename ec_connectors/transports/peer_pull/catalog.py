"""The scheduler-side view of a peer-pull transport: which items producers hold, and where.

Fed by producers' announcements (ZMQ SUB: Announce / Evicted at once, a Snapshot every
`announce_interval_s` that heals anything missed); a producer whose snapshots stop is forgotten
after three intervals. Lookups are dict reads: no network on the scheduler's hot path.
Torch-free, so a gateway can use it without loading torch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec
import zmq

from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.protocol.curve import data_plane_host
from ec_connectors.protocol.keys import item_key
from ec_connectors.protocol.ports import PURPOSE_SERVE, announce_endpoint, port_for
from ec_connectors.protocol.stored import ItemInfo
from ec_connectors.transports.base import Placement, Transport
from ec_connectors.transports.peer_pull.messages import (
    Announce,
    Evicted,
    PeerMessage,
    Snapshot,
    decode_announcement,
)
from epd_common.net import parse_endpoint

if TYPE_CHECKING:
    import torch

logger = get_logger(__name__)


class PeerCatalog(Transport):
    """Scheduler-role view of a peer-pull transport: which items producers hold, and where.

    Fed by producers' announcements (ZMQ SUB); producers whose snapshots stop are forgotten.
    Each transport names its own (mooncake_te/catalog.py, nixl_pull/catalog.py)."""

    name = "peer_pull"
    announces = True

    def __init__(self, config: EPDConfig, placement: Placement) -> None:
        super().__init__()
        self.config = config
        self._where: dict[str, tuple[str, int]] = {}  # key -> (endpoint, nbytes)
        self._by_producer: dict[str, set[str]] = {}
        self._last_seen: dict[str, tuple[float, float]] = {}  # endpoint -> (time, interval)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        targets = list(config.producers)
        if placement.is_producer:  # our own workers, so has_cache_item knows what we hold
            host = data_plane_host(config.host, config.curve is not None)
            for r in range(placement.world_size):
                port = port_for(config.base_port, PURPOSE_SERVE, config.stage_offset,
                                placement.dp_rank, placement.world_size, r)
                targets.append(f"{host}:{port}")
        self._zmq = zmq.Context()
        self._sock = self._zmq.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        curve = config.curve
        if curve is not None:
            curve.client(self._sock)
        for endpoint in dict.fromkeys(targets):
            self._sock.connect(f"tcp://{announce_endpoint(endpoint)}")
        self.bad_frames = 0
        self._thread = threading.Thread(target=self._run, name="epd-catalog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(250):
                    while True:
                        try:
                            data = self._sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            self._apply(decode_announcement(data))
                        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                            self.bad_frames += 1
                            logger.warning("EPD catalog: dropped a malformed announcement: %s",
                                           exc)
                self._expire()
        finally:
            self._sock.close()

    def _apply(self, msg: PeerMessage) -> None:
        if not isinstance(msg, Announce | Evicted | Snapshot):
            return
        if self.config.namespace and msg.namespace and msg.namespace != self.config.scope:
            return  # another model's producer: its items are not ours to use
        endpoint = msg.endpoint
        parse_endpoint(endpoint)
        with self._lock:
            mine = self._by_producer.setdefault(endpoint, set())
            if isinstance(msg, Announce):
                for info in msg.items:
                    self._where[info.key] = (endpoint, info.nbytes)
                    mine.add(info.key)
                interval = self._last_seen.get(endpoint, (0.0, self.config.announce_interval_s))[1]
            elif isinstance(msg, Evicted):
                for key in msg.keys:
                    mine.discard(key)
                    if self._where.get(key, ("",))[0] == endpoint:
                        del self._where[key]
                interval = self._last_seen.get(endpoint, (0.0, self.config.announce_interval_s))[1]
            else:
                fresh = set(msg.keys)
                for key in mine - fresh:
                    if self._where.get(key, ("",))[0] == endpoint:
                        del self._where[key]
                for key, n in zip(msg.keys, msg.nbytes, strict=False):
                    self._where[key] = (endpoint, n)
                self._by_producer[endpoint] = fresh
                interval = msg.interval_s
            self._last_seen[endpoint] = (time.monotonic(), interval)
        if not isinstance(msg, Evicted) and self.on_news is not None:
            self.on_news()

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            dead = [e for e, (ts, iv) in self._last_seen.items() if now - ts > 3 * iv + 1.0]
            for endpoint in dead:
                for key in self._by_producer.pop(endpoint, ()):
                    if self._where.get(key, ("",))[0] == endpoint:
                        del self._where[key]
                del self._last_seen[endpoint]
                logger.warning("EPD catalog: producer %s went silent; forgetting its items",
                               endpoint)

    def locate(self, key: str) -> tuple[str, int] | None:
        """Where a producer holds the item: (endpoint, nbytes), or None (a dict read)."""
        return self._where.get(key)

    def list_keys(self) -> Iterable[str]:
        """Every key a live producer announced."""
        with self._lock:
            return list(self._where)

    def put(self, item_id: str, tensor: torch.Tensor) -> ItemInfo:
        """Never: the scheduler process does not store items."""
        raise RuntimeError("the scheduler process does not store items")

    def get(self, item_id: str, deadline: float, location: str = "",
            nbytes: int = 0, *, wait: bool = True) -> torch.Tensor | None:
        """Never: the scheduler process does not load items."""
        raise RuntimeError("the scheduler process does not load items")

    def exists(self, item_id: str) -> bool:
        """Whether a live producer announced the item."""
        return item_key(item_id) in self._where

    def delete(self, item_id: str) -> bool:
        """Never deletes (producers' leases decide)."""
        return False

    def health(self) -> dict[str, object]:
        """The producers heard from and the items they hold."""
        return {"transport": self.name, "ok": True, "producers": sorted(self._last_seen),
                "items": len(self._where)}

    def close(self) -> None:
        """Stop following announcements."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._zmq.destroy(linger=0)
