"""Consumer side of the Mooncake TE transport: the side channel to one producer with its pulls
in flight and quarantined buffers, and the checksum computed while chunks land."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import xxhash
import zmq

from ec_connectors.control import ControlEndpoint
from ec_connectors.log import get_logger
from ec_connectors.protocol.net import parse_endpoint
from ec_connectors.protocol.secret import CurveKeys
from ec_connectors.transports.memory import PoolBuffer
from ec_connectors.transports.mooncake_te import messages
from ec_connectors.transports.mooncake_te.messages import (
    PeerMessage,
    Progress,
    Pull,
    Register,
)

logger = get_logger(__name__)


@dataclass
class PendingPull:
    buf: PoolBuffer | None
    cond: threading.Condition = field(default_factory=threading.Condition)
    finished: bool = False
    progress: int = 0  # bytes known to have landed (Progress messages)
    reply: PeerMessage | None = None
    payload: bytes | None = None
    error: str = ""

    def finish(self, reply: PeerMessage | None = None, payload: bytes | None = None,
               error: str = "") -> None:
        with self.cond:
            self.reply, self.payload, self.error = reply, payload, error or self.error
            self.finished = True
            self.cond.notify_all()


class PeerLink:
    """A consumer's side channel to one producer (ZMQ DEALER, reconnecting), with the pulls in
    flight to it and the buffers it may still write into. `hello` (messages.Register) opens
    every connection: the producer writes only into the range it names and proves."""

    def __init__(self, endpoint: str, context: zmq.Context,
                 curve: CurveKeys | None = None, hello: Register | None = None) -> None:
        host, port = parse_endpoint(endpoint)
        self.endpoint = endpoint
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, PendingPull] = {}
        self._quarantine: dict[int, tuple[PoolBuffer, float]] = {}
        self.broken = False
        self.channel = ControlEndpoint(f"tcp://{host}:{port}", bind=False,
                                       on_message=self._on_message, name=f"epd-peer-{port}",
                                       decode=messages.decode_peer,
                                       on_disconnect=self._on_disconnect, context=context,
                                       curve=curve, on_unreachable=self._on_unreachable,
                                       greeting=hello)

    def pull(self, key: str, session: str, buf: PoolBuffer | None, timeout_s: float,
             on_progress: Callable[[int], None] | None = None, namespace: str = ""
             ) -> PendingPull:
        """Ask for `key` into `buf`; wait up to `timeout_s`, calling `on_progress(bytes)` (on
        this thread) as chunks land. The returned pull is finished either way."""
        pull_id = next(self._ids)
        pending = PendingPull(buf)
        with self._lock:
            self._pending[pull_id] = pending
        self.channel.send(Pull(pull_id=pull_id, key=key, session=session,
                               dst_addr=buf.addr if buf else 0,
                               capacity=buf.nbytes if buf else 0, namespace=namespace,
                               timeout_s=max(0.001, timeout_s)))
        deadline = time.monotonic() + max(0.0, timeout_s)
        seen = 0
        while True:
            with pending.cond:
                pending.cond.wait_for(lambda s=seen: pending.finished or pending.progress > s,
                                      max(0.0, deadline - time.monotonic()))
                finished, progress = pending.finished, pending.progress
            if progress > seen and on_progress is not None and not finished:
                on_progress(progress)
            seen = progress
            if finished:
                return pending
            if time.monotonic() >= deadline:
                break
        with self._lock:
            if self._pending.pop(pull_id, None) is not None:
                if buf is not None and self.channel.connected:
                    # It may still write into buf: hold it until it answers or dies.
                    self._quarantine[pull_id] = (buf, time.monotonic())
                    pending.buf = None
                pending.finish(error=f"no answer from producer {self.endpoint} in "
                                     f"{timeout_s:.2f} s")
        return pending

    def _on_message(self, msg: PeerMessage, _peer: bytes | None, payload: list[bytes]) -> None:
        pull_id = getattr(msg, "pull_id", None)
        if pull_id is None:
            return
        if isinstance(msg, Progress):
            with self._lock:
                pending = self._pending.get(pull_id)
            if pending is not None:
                with pending.cond:
                    pending.progress = max(pending.progress, msg.done)
                    pending.cond.notify_all()
            return
        with self._lock:
            pending = self._pending.pop(pull_id, None)
            late = self._quarantine.pop(pull_id, None) if pending is None else None
        if late is not None:
            logger.info("EPD: late answer from %s for pull %d; its buffer is free again",
                        self.endpoint, pull_id)
            late[0].release()
        elif pending is not None:
            pending.finish(msg, payload[0] if payload else None)

    def _on_disconnect(self) -> None:
        """The producer's process is gone: nothing can write into our buffers any more."""
        with self._lock:
            pending, self._pending = self._pending, {}
            quarantined, self._quarantine = self._quarantine, {}
            self.broken = True
        for p in pending.values():
            p.finish(error=f"producer {self.endpoint} disconnected")
        for buf, _ in quarantined.values():
            buf.release()
        logger.warning("EPD: lost the connection to producer %s (%d pulls in flight)",
                       self.endpoint, len(pending))

    def _on_unreachable(self) -> None:
        """Nobody listens at the producer's address (a connection attempt was refused before
        any succeeded): its pulls fail now, not at their deadline; nothing was written."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self.broken = True
        for p in pending.values():
            p.finish(error=f"producer {self.endpoint} unreachable (connection refused)")
        if pending:
            logger.warning("EPD: producer %s is unreachable (%d pulls failed at once)",
                           self.endpoint, len(pending))

    def reap(self, ttl_s: float) -> None:
        cutoff = time.monotonic() - ttl_s
        with self._lock:
            stale = [k for k, (_, ts) in self._quarantine.items() if ts < cutoff]
            bufs = [self._quarantine.pop(k)[0] for k in stale]
        for buf in bufs:
            logger.warning("EPD: releasing a buffer producer %s never answered for", self.endpoint)
            buf.release()

    @property
    def quarantined(self) -> int:
        return len(self._quarantine)

    def close(self) -> None:
        self.channel.close()
        with self._lock:
            quarantined, self._quarantine = self._quarantine, {}
            pending, self._pending = self._pending, {}
        for p in pending.values():
            p.finish(error="closed")
        for buf, _ in quarantined.values():
            with contextlib.suppress(Exception):
                buf.release()


class StreamVerifier:
    """xxh3 over a pool block's bytes in order, as chunks land (same digest as one-shot).
    Device pools hash a host copy of each chunk."""

    def __init__(self, buf: PoolBuffer) -> None:
        self._raw = buf.as_tensor(torch.uint8, (buf.nbytes,))
        self._host = buf.as_bytes() if self._raw.device.type == "cpu" else None
        self._hasher = xxhash.xxh3_64()
        self.hashed = 0

    def advance(self, upto: int) -> None:
        upto = min(upto, self._raw.numel())
        if upto > self.hashed:
            if self._host is not None:
                self._hasher.update(self._host[self.hashed:upto])
            else:
                self._hasher.update(memoryview(self._raw[self.hashed:upto].cpu().numpy()))
            self.hashed = upto

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()
