"""A consumer's link to one producer: the side channel, pulls in flight and their replies.

`PeerLink` sends a pull over the side channel and waits for its answer, with the progress
the producer reports as chunks land; a buffer a producer may still write into after the
pull's deadline is quarantined until that producer answers or disconnects. Every data path's
consumer side speaks to its producer through one (peer_pull/data_path.py `PeerReader`); where
the producer writes the bytes itself, the link is the whole reader."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from ec_connectors.channel import Channel
from ec_connectors.log import get_logger
from ec_connectors.protocol.curve import CurveKeys
from ec_connectors.transports.memory import PoolBuffer
from ec_connectors.transports.peer_pull.messages import Progress, Pull
from epd_common.net import parse_endpoint

logger = get_logger(__name__)


@dataclass
class PendingPull:
    """One pull from its request to its end: the buffer, the reply, how it failed."""

    buf: PoolBuffer | None
    cond: threading.Condition = field(default_factory=threading.Condition)
    finished: bool = False
    progress: int = 0  # bytes known to have landed (Progress messages)
    reply: Any = None
    payload: bytes | None = None
    error: str = ""
    stream_error: str = ""  # why the data connection failed ("" if it did not)
    streamed: bool = False  # asked on a data connection (socket path)
    opened: int = 0  # data connections opened for this pull (0: a warm one served it)

    def finish(self, reply: Any = None, payload: bytes | None = None, error: str = "") -> None:
        """End the pull with `reply` (and its inline `payload`) or `error`; wakes its waiter."""
        with self.cond:
            self.reply, self.payload, self.error = reply, payload, error or self.error
            self.finished = True
            self.cond.notify_all()


class PeerLink:
    """A consumer's side channel to one producer, with its pulls in flight.

    A consumer's side channel to one producer (ZMQ DEALER, reconnecting), with the pulls in
    flight to it and the buffers it may still write into. `hello` opens every connection
    (the data path's claim or handshake); `on_other` gets the messages that answer no pull
    (the data path's own); `decode` is the side channel's decoder."""

    def __init__(self, endpoint: str, context: zmq.Context, decode: Callable[[bytes], Any],
                 curve: CurveKeys | None = None, hello: msgspec.Struct | None = None,
                 on_other: Callable[[Any], None] | None = None) -> None:
        host, port = parse_endpoint(endpoint)
        self.endpoint = endpoint
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, PendingPull] = {}
        self._quarantine: dict[int, tuple[PoolBuffer, float]] = {}
        self._on_other = on_other
        self.broken = False
        self.channel = Channel(f"tcp://{host}:{port}", bind=False,
                               on_message=self._on_message, name=f"epd-peer-{port}",
                               decode=decode, on_disconnect=self._on_disconnect,
                               context=context, curve=curve,
                               on_unreachable=self._on_unreachable, greeting=hello)

    def next_id(self) -> int:
        """A fresh pull id on this link (a data connection's requests take theirs here too)."""
        return next(self._ids)

    def send(self, msg: msgspec.Struct) -> None:
        """Send one of the data path's own messages to the producer."""
        self.channel.send(msg)

    def pull(self, key: str, session: str, buf: PoolBuffer | None, timeout_s: float,
             on_progress: Callable[[int], None] | None = None, namespace: str = ""
             ) -> PendingPull:
        """Ask for one item over the side channel and wait for its answer.

        Ask for `key` into `buf` (of data path session `session`); wait up to `timeout_s`,
        calling `on_progress(bytes)` (on this thread) as chunks land. The returned pull is
        finished either way; a buffer the producer may still write into is quarantined."""
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

    def _on_message(self, msg: Any, _peer: bytes | None, payload: list[bytes]) -> None:
        pull_id = getattr(msg, "pull_id", None)
        if pull_id is None:
            if self._on_other is not None:
                self._on_other(msg)
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
        """Fail the pulls to a producer that nobody listens for.

        Nobody listens at the producer's address (a connection attempt was refused before
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
        """Free quarantined buffers older than `ttl_s` (their producer never answered)."""
        cutoff = time.monotonic() - ttl_s
        with self._lock:
            stale = [k for k, (_, ts) in self._quarantine.items() if ts < cutoff]
            bufs = [self._quarantine.pop(k)[0] for k in stale]
        for buf in bufs:
            logger.warning("EPD: releasing a buffer producer %s never answered for", self.endpoint)
            buf.release()

    @property
    def quarantined(self) -> int:
        """Buffers a producer may still write into."""
        return len(self._quarantine)

    def close(self) -> None:
        """Close the side channel; pulls in flight end, quarantined buffers are freed."""
        self.channel.close()
        with self._lock:
            quarantined, self._quarantine = self._quarantine, {}
            pending, self._pending = self._pending, {}
        for p in pending.values():
            p.finish(error="closed")
        for buf, _ in quarantined.values():
            with contextlib.suppress(Exception):
                buf.release()
