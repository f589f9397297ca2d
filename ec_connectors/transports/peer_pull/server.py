"""A producer's side channel: pulls queued, answered, refused; large items to the data path.

`PullServer` is the ZMQ ROUTER a producer worker serves pulls on, whatever moves the bytes:
a pull is queued (at most `max_queued_pulls`, else answered `busy`) for the serve threads,
which answer it at once when it cannot be served (its deadline passed: `expired`; another
model's: `namespace`; not held: `unknown`, `pending`, `evicted` or `failed`, the store's
word) or when the item is small (inline, in the reply frame), and hand a large pinned item to
the data path (`DataPath.serve_held`: write it, or tell where to read it). The data path's
own messages (a connection's opening claim, a data connection's ticket) go to it first."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch
import zmq

from ec_connectors.channel import Channel
from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.protocol.curve import CurveKeys
from ec_connectors.transports.peer_pull.data_path import DataPath, PullCounters
from ec_connectors.transports.peer_pull.messages import Pull, Pulled, PullFailed
from ec_connectors.transports.peer_pull.producer_store import PinnedItem, ProducerStore
from epd_common.net import parse_endpoint

logger = get_logger(__name__)


class PullServer:
    """A producer worker's side channel (ZMQ ROUTER); see the module docstring.

    `counters`: the transport's pull counters; `decode`: the side channel's decoder (the
    core's messages and the data path's)."""

    def __init__(self, address: str, endpoint: str, store: ProducerStore, path: DataPath,
                 config: EPDConfig, namespace: str, counters: PullCounters,
                 context: zmq.Context, decode: Callable[[bytes], Any],
                 curve: CurveKeys | None = None) -> None:
        self.endpoint, self.store, self.path = endpoint, store, path
        self.config, self.namespace, self.counters = config, namespace, counters
        self._queued = 0  # pulls accepted and not yet served
        self._lock = threading.Lock()
        self._serve = ThreadPoolExecutor(config.serve_threads, thread_name_prefix="epd-serve")
        # A connection's opening work (a range's proof) runs apart: pulls on the serve
        # threads may be waiting for it.
        self.handshakes = ThreadPoolExecutor(2, thread_name_prefix="epd-register")
        self.channel: Channel | None = None
        path.start_serving(self)
        self.channel = Channel(address, bind=True, on_message=self._on_message,
                               name="epd-peer-server", decode=decode,
                               context=context, curve=curve)

    def _on_message(self, msg: Any, peer: bytes | None, _payload: list[bytes]) -> None:
        if not isinstance(msg, Pull):
            if peer is not None:
                self.path.on_message(self, msg, peer)
            return
        if peer is None:
            return
        try:  # none from a consumer that names no session
            if msg.session:
                parse_endpoint(msg.session)
        except ValueError as exc:
            self.reply(peer, PullFailed(pull_id=msg.pull_id, code="bad_request", error=str(exc)))
            return
        with self._lock:
            busy = self._queued >= self.config.max_queued_pulls
            if not busy:
                self._queued += 1
        if busy:
            self.reply(peer, PullFailed(pull_id=msg.pull_id, code="busy",
                                        error=f"{self.endpoint} has "
                                              f"{self.config.max_queued_pulls} pulls queued"))
            return
        self._serve.submit(self._serve_queued, msg, peer, expires_at(msg))

    def _serve_queued(self, msg: Pull, peer: bytes, expires: float) -> None:
        try:
            self._serve_pull(msg, peer, expires)
        finally:
            with self._lock:
                self._queued -= 1

    def reply(self, peer: bytes, msg: msgspec.Struct, payload: bytes | None = None) -> None:
        """Answer `peer` on the side channel (dropped once the server is closed)."""
        if self.channel is not None:
            self.channel.send(msg, to=peer, payload=payload)

    def expired(self, msg: Pull, peer: bytes, expires: float) -> bool:
        """Past the pull's deadline: say so (the consumer frees its buffer) and stop."""
        refusal = self._expiry(msg, expires)
        if refusal is not None:
            self.reply(peer, refusal)
        return refusal is not None

    def _expiry(self, msg: Pull, expires: float) -> PullFailed | None:
        if time.monotonic() <= expires:
            return None
        self.counters.expired += 1
        return PullFailed(pull_id=msg.pull_id, code="expired",
                          error=f"the pull's {msg.timeout_s:.3g} s passed at "
                                f"{self.endpoint}; nothing more is written")

    def claim(self, msg: Pull, expires: float) -> tuple[PinnedItem | None, PullFailed | None]:
        """Pin the item a pull asks for, or say why not.

        (the item pinned, None), or (None, the refusal): expired, namespace, or why the
        store does not hold it. The caller unpins what it got."""
        refusal = self._expiry(msg, expires)
        if refusal is None and msg.namespace and msg.namespace != self.namespace:
            refusal = PullFailed(pull_id=msg.pull_id, code="namespace",
                                 error=f"{self.endpoint} serves model namespace "
                                       f"{self.namespace!r}, not {msg.namespace!r}")
        if refusal is not None:
            return None, refusal
        held = self.store.pin(msg.key)
        if held is not None:
            return held, None
        code = self.store.absent(msg.key)
        return None, PullFailed(pull_id=msg.pull_id, code=code,
                                error=f"item {msg.key} is {code} at {self.endpoint}")

    def _serve_pull(self, msg: Pull, peer: bytes, expires: float = float("inf")) -> None:
        held, refusal = self.claim(msg, expires)
        if held is None:
            self.reply(peer, refusal)
            return
        try:
            info = held.info
            if info.nbytes <= self.config.inline_max_bytes:
                data = bytes(held.buf.as_tensor(torch.uint8, (info.nbytes,)).cpu().numpy())
                self.reply(peer, Pulled(pull_id=msg.pull_id, info=info, inline=True), data)
                return
            refusal = too_small(msg, held)
            if refusal is not None:
                self.reply(peer, refusal)
                return
            if self.path.serve_held(self, msg, peer, held, expires):
                held = None  # the data path keeps the pin until the consumer is done
        finally:
            if held is not None:
                self.store.unpin(held)

    def close(self) -> None:
        """Stop answering, then let the serve threads finish (queued pulls are dropped)."""
        if self.channel is not None:
            self.channel.close()
        self.path.stop_serving()  # a data connection's send in flight fails at once
        self._serve.shutdown(wait=True, cancel_futures=True)
        self.handshakes.shutdown(wait=True, cancel_futures=True)


def too_small(msg: Pull, held: PinnedItem) -> PullFailed | None:
    """The answer to a pull whose buffer cannot take the item (it says the item's size)."""
    if msg.capacity >= held.info.nbytes:
        return None
    return PullFailed(pull_id=msg.pull_id, code="too_small", info=held.info,
                      error=f"needs {held.info.nbytes} bytes")


def expires_at(msg: Pull) -> float:
    """When a pull's deadline passes on this host's clock (none for older consumers)."""
    return time.monotonic() + msg.timeout_s if msg.timeout_s > 0 else float("inf")
