"""A consumer's link to one producer: the side channel, pulls and their replies.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from ec_connectors.channel import Channel
from ec_connectors.log import get_logger
from ec_connectors.protocol.curve import CurveKeys
from ec_connectors.protocol.ports import stream_port
from ec_connectors.transports.memory import PoolBuffer
from ec_connectors.transports.mooncake_te import messages, stream, stream_client
from ec_connectors.transports.mooncake_te.messages import (
    PeerMessage,
    Progress,
    Pull,
    PullFailed,
    Register,
    StreamOpen,
)
from ec_connectors.transports.mooncake_te.stream_client import Connections
from epd_common.net import parse_endpoint

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
    stream_error: str = ""  # why the data connection failed ("" if it did not)
    streamed: bool = False  # asked on a data connection (socket path)
    opened: int = 0  # data connections opened for this pull (0: a warm one served it)

    def finish(self, reply: PeerMessage | None = None, payload: bytes | None = None,
               error: str = "") -> None:
        with self.cond:
            self.reply, self.payload, self.error = reply, payload, error or self.error
            self.finished = True
            self.cond.notify_all()


class PeerLink:
    """A consumer's side channel to one producer, with its pulls in flight.

    A consumer's side channel to one producer (ZMQ DEALER, reconnecting), with the pulls in
    flight to it and the buffers it may still write into. `hello` (messages.Register) opens
    every connection: the producer writes only into the range it names and proves. `stream`
    (te_data_path socket): each pull into a buffer runs on one of a few warm data connections
    to the producer's stream port (stream_client.Connections; their tickets go over this channel),
    request and reply on that socket; a producer without a stream listener writes the bytes
    with the engine, as without `stream`."""

    def __init__(self, endpoint: str, context: zmq.Context,
                 curve: CurveKeys | None = None, hello: Register | None = None,
                 stream: bool = False) -> None:
        host, port = parse_endpoint(endpoint)
        self.endpoint = endpoint
        self.streams = Connections(host, stream_port(port), self._open_stream) \
            if stream else None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, PendingPull] = {}
        self._quarantine: dict[int, tuple[PoolBuffer, float]] = {}
        self.broken = False
        self.channel = Channel(f"tcp://{host}:{port}", bind=False,
                               on_message=self._on_message, name=f"epd-peer-{port}",
                               decode=messages.decode_peer, on_disconnect=self._on_disconnect,
                               context=context, curve=curve,
                               on_unreachable=self._on_unreachable, greeting=hello)

    def pull(self, key: str, session: str, buf: PoolBuffer | None, timeout_s: float,
             on_progress: Callable[[int], None] | None = None, namespace: str = ""
             ) -> PendingPull:
        """Pull one item into a buffer, reporting progress as chunks land.

        Ask for `key` into `buf`; wait up to `timeout_s`, calling `on_progress(bytes)` (on
        this thread) as chunks land. The returned pull is finished either way."""
        if self.streams is not None and buf is not None:
            pending = self._pull_streamed(key, buf, timeout_s, on_progress, namespace)
            if pending is not None:
                return pending
            # the producer takes no data connection (engine path): it writes with the engine
            if not session:  # ... which this process does not run (needs_engine)
                return PendingPull(buf, finished=True, reply=PullFailed(
                    pull_id=0, code="unregistered", error=f"{self.endpoint} writes with the "
                    "engine only; this process has none (set te_data_path alike everywhere)"))
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

    def _pull_streamed(self, key: str, buf: PoolBuffer, timeout_s: float,
                       on_chunk: Callable[[int], None] | None, namespace: str
                       ) -> PendingPull | None:
        """Run one pull on a data connection (te_data_path socket).

        The pull on a data connection: the request, the reply and the item's bytes into
        `buf` on one socket, by the deadline; a failure on it fails the pull (`stream_error`)
        and closes that connection. A warm connection the producer had closed before reading
        the request is replaced once. None when the producer takes no data connection.
        Nothing but this thread writes into `buf`: never quarantined."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        request = Pull(pull_id=next(self._ids), key=key, session="", dst_addr=0,
                       capacity=buf.nbytes, namespace=namespace,
                       timeout_s=max(0.001, timeout_s))
        pending = PendingPull(buf, streamed=True)
        fresh = False
        while True:
            try:
                conn, reused = self.streams.acquire(deadline, fresh=fresh)
            except stream.StreamError as exc:
                pending.stream_error = f"stream from {self.endpoint}: {exc}"
                break
            if conn is None:
                return None
            pending.opened += not reused
            try:
                reply, _ = stream_client.pull(conn, request, buf, deadline, on_chunk)
            except stream.StreamClosed as exc:
                self.streams.release(conn, good=False)
                if reused and not fresh:
                    fresh = True
                    continue
                pending.stream_error = f"stream from {self.endpoint}: {exc}"
                break
            except (OSError, stream.StreamError) as exc:
                self.streams.release(conn, good=False)
                pending.stream_error = f"stream from {self.endpoint}: {exc}"
                break
            self.streams.release(conn, good=True)
            pending.finish(reply)
            return pending
        pending.finish()
        return pending

    def _open_stream(self, ticket: bytes) -> None:
        self.channel.send(StreamOpen(ticket=ticket))

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
        if self.streams is not None:
            self.streams.reap()
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
        if self.streams is not None:
            self.streams.close()
        with self._lock:
            quarantined, self._quarantine = self._quarantine, {}
            pending, self._pending = self._pending, {}
        for p in pending.values():
            p.finish(error="closed")
        for buf, _ in quarantined.values():
            with contextlib.suppress(Exception):
                buf.release()
