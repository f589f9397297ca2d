"""Consumer side of the Mooncake TE transport: the side channel to one producer with its pulls
in flight and quarantined buffers (and, on the socket data path, the warm data connections
pulls run on instead: stream.py), the checksum computed while chunks land, and the Puller that
asks producers for an item (retries across them) and verifies what landed."""

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

from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.protocol.channel import Channel
from ec_connectors.protocol.keys import item_key
from ec_connectors.protocol.net import parse_endpoint
from ec_connectors.protocol.ports import stream_port
from ec_connectors.protocol.secret import CurveKeys
from ec_connectors.transports.base import TransportEvents, checksum, describe
from ec_connectors.transports.memory import MemoryPool, PoolBuffer, PoolExhausted
from ec_connectors.transports.mooncake_te import messages, stream, stream_client
from ec_connectors.transports.mooncake_te.messages import (
    PeerMessage,
    Progress,
    Pull,
    Pulled,
    PullFailed,
    Register,
    StreamOpen,
)
from ec_connectors.transports.mooncake_te.stream_client import Connections

logger = get_logger(__name__)

_UNKNOWN_RETRY_S = (0.005, 0.2)  # backoff while a producer's save is queued ("pending")


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
    """A consumer's side channel to one producer (ZMQ DEALER, reconnecting), with the pulls in
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
        """Ask for `key` into `buf`; wait up to `timeout_s`, calling `on_progress(bytes)` (on
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
        """The pull on a data connection: the request, the reply and the item's bytes into
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


class Puller:
    """A consumer's pulls: one PeerLink per producer (rebuilt after a failure), each pull into
    a block of the consumer's own pool with a size-scaled deadline, retries across producers
    until the caller's deadline, and verification of what landed. `events` and `stats` are
    the transport's counters."""

    def __init__(self, config: EPDConfig, pool: MemoryPool, session: str, namespace: str,
                 hello: Register | None, context: zmq.Context, curve: CurveKeys | None,
                 events: TransportEvents, stats: dict[str, int]) -> None:
        self.config, self.pool, self.session, self.namespace = config, pool, session, namespace
        self._hello, self._zmq, self._curve = hello, context, curve
        self.events, self.stats = events, stats
        self._links: dict[str, PeerLink] = {}
        self._lock = threading.Lock()

    def _link(self, endpoint: str) -> PeerLink:
        with self._lock:
            link = self._links.get(endpoint)
            if link is not None and link.broken:  # dropped after a failure: rebuild it
                link.close()
                link = None
            if link is None:
                link = self._links[endpoint] = PeerLink(endpoint, self._zmq, self._curve,
                                                        hello=self._hello,
                                                        stream=self.config.te_socket)
            return link

    def _sources(self, location: str) -> list[str]:
        if location:
            return [location]
        return list(self.config.producers)

    def get(self, item_id: str, deadline: float, location: str = "", nbytes: int = 0,
            *, wait: bool = True) -> torch.Tensor | None:
        """The item from `location` (else from each configured producer in turn) by
        `deadline`, or None (counted as missing)."""
        key = item_key(item_id)
        sources = self._sources(location)
        if not sources:
            self.events.missing += 1
            self.events.errors.append(f"{item_id!r}: no producer known (no location, no "
                                      "producers configured)")
            return None
        backoff = _UNKNOWN_RETRY_S[0]
        i = 0
        while time.monotonic() < deadline:
            endpoint = sources[i % len(sources)]
            outcome, tensor, nbytes = self._pull_once(endpoint, key, deadline, nbytes)
            if tensor is not None:
                return tensor
            if outcome == "too_small":
                continue  # now we know the size: pull again from the same producer
            if outcome == "too_big":
                break
            if outcome in ("evicted", "corrupt", "timeout", "namespace", "failed",
                           "unreachable", "unregistered") and len(sources) == 1:
                break  # a frozen producer would only cost more quarantined buffers
            i += 1
            if outcome == "unknown" and location:
                # the producer named as holding it neither holds it nor has its save queued
                # (a stale hint, a restarted producer): a miss now, not at the deadline.
                # Asked without a location, it may not be made yet: that waits, as below.
                break
            if not wait and outcome == "unknown" and i >= len(sources):
                break  # asked every producer once: not stored anywhere right now
            if outcome in ("unknown", "pending", "disconnected", "transfer", "busy") \
                    and i % len(sources) == 0:
                # Maybe still in the producer's save queue, or it restarts: retry until the
                # deadline, backing off.
                time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
                backoff = min(backoff * 2, _UNKNOWN_RETRY_S[1])
        self.events.missing += 1
        return None

    def _buffer(self, key: str, deadline: float, nbytes: int) -> tuple[str, PoolBuffer | None]:
        """A pool block for an item of `nbytes` ("ok", None when it comes inline or its size
        is unknown), or why not ("too_big", "pool")."""
        if nbytes > self.pool.capacity:
            self.events.errors.append(f"{key}: {nbytes} bytes exceed the consumer pool")
            logger.error("EPD: item %s (%d bytes) is larger than the whole consumer pool "
                         "(%d bytes): raise memory_pool_bytes", key, nbytes, self.pool.capacity)
            return "too_big", None
        if nbytes <= self.config.inline_max_bytes:
            return "ok", None
        try:
            return "ok", self.pool.allocate(nbytes, deadline)
        except PoolExhausted as exc:
            self.events.errors.append(f"consumer pool: {exc}")
            logger.warning("EPD: consumer pool exhausted, cannot pull %s: %s", key, exc)
            time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
            return "pool", None

    def _pull_once(self, endpoint: str, key: str, deadline: float, nbytes: int
                   ) -> tuple[str, torch.Tensor | None, int]:
        """One pull: (outcome, tensor or None, item size if learnt)."""
        outcome, buf = self._buffer(key, deadline, nbytes)
        if outcome != "ok":
            return outcome, None, nbytes
        link = self._link(endpoint)
        scaled = self.config.transfer_timeout_base_s + nbytes / self.config.min_transfer_bytes_per_s
        timeout = min(deadline - time.monotonic(), scaled)
        self.stats["pulls"] += 1
        verifier = StreamVerifier(buf) if self.config.verify_checksum and buf is not None \
            else None
        p = link.pull(key, self.session, buf, timeout,
                      on_progress=verifier.advance if verifier else None,
                      namespace=self.namespace)
        self.stats["stream_connections"] += p.opened
        try:
            reply = p.reply
            if isinstance(reply, PullFailed) and reply.code == "too_small" \
                    and reply.info is not None:
                return "too_small", None, reply.info.nbytes  # now we know its size
            outcome, tensor = self._outcome(endpoint, key, p, verifier)
            return outcome, tensor, nbytes
        finally:
            if p.buf is not None:  # not quarantined: ours to free
                p.buf.release()

    def _outcome(self, endpoint: str, key: str, p: PendingPull,
                 verifier: StreamVerifier | None) -> tuple[str, torch.Tensor | None]:
        """What a finished pull (other than a size answer) came to."""
        reply = p.reply
        if p.stream_error and not p.error and not isinstance(reply, PullFailed):
            # the producer's bytes did not all arrive (its word, PullFailed, says why if any)
            logger.warning("EPD: pull of %s: %s", key, p.stream_error)
            if "timed out" in p.stream_error:
                self.events.pull_timeouts += 1
                return "timeout", None
            self.events.corrupt += 1
            return "corrupt", None
        if isinstance(reply, Pulled):
            if reply.info.key != key:  # a peer's word: the item asked for, nothing else
                self.events.corrupt += 1
                logger.warning("EPD: %s answered a pull of %s with item %s; ignored",
                               endpoint, key, reply.info.key)
                return "corrupt", None
            tensor = self._receive(reply, p, verifier)
            if tensor is not None and p.streamed:
                self.stats["streamed"] += 1
            # bytes that fail verification (damaged, or written by an outsider into a
            # registered pool: docs/trust.md) are this producer's corrupt copy: the next
            # producer is asked, never this one again in a hot loop
            return ("ok" if tensor is not None else "corrupt"), tensor
        if isinstance(reply, PullFailed):
            self.stats[{"unknown": "unknown", "pending": "unknown", "evicted": "evicted"}.get(
                reply.code, "transfer_errors")] += 1
            if reply.code not in ("unknown", "pending"):
                logger.warning("EPD: pull of %s from %s failed: %s %s", key, endpoint,
                               reply.code, reply.error)
            return reply.code, None
        if "disconnected" in p.error:
            self.events.peer_disconnects += 1
            return "disconnected", None
        if "unreachable" in p.error:
            self.events.peer_disconnects += 1
            return "unreachable", None
        self.events.pull_timeouts += 1
        logger.warning("EPD: pull of %s: %s", key, p.error)
        return "timeout", None

    def _receive(self, reply: Pulled, p: PendingPull, verifier: StreamVerifier | None = None
                 ) -> torch.Tensor | None:
        """A verified tensor from the reply: inline bytes, or our pool block itself (CPU
        pool: handed over without a copy, back to the pool when vLLM drops the tensor;
        device pool: one device-local copy)."""
        info = reply.info
        try:
            dtype, shape = describe(info)
        except ValueError as exc:
            self.events.corrupt += 1
            logger.warning("EPD: producer sent bad metadata for %s: %s", info.key, exc)
            return None
        if reply.inline:
            if p.payload is None or len(p.payload) != info.nbytes:
                self.events.corrupt += 1
                return None
            self.stats["inline"] += 1
            raw = torch.frombuffer(bytearray(p.payload), dtype=torch.uint8)
            data = memoryview(raw.numpy())
        else:
            if p.buf is None or p.buf.nbytes < info.nbytes:
                self.events.corrupt += 1
                return None
            raw = p.buf.as_tensor(torch.uint8, (info.nbytes,))
            data = p.buf.as_bytes()[:info.nbytes] if raw.device.type == "cpu" else None
        if self.config.verify_checksum:
            if verifier is not None and not reply.inline:
                verifier.advance(info.nbytes)  # the chunks that landed are hashed already
                digest = verifier.hexdigest()
            else:
                digest = checksum(data if data is not None else memoryview(raw.cpu().numpy()))
            if digest != info.checksum:
                self.events.corrupt += 1
                logger.warning("EPD: checksum mismatch for %s from %s", info.key, info.location)
                return None
        if reply.inline:
            return raw.view(dtype).view(shape)
        if raw.device.type != "cpu":
            return raw.clone().view(dtype).view(shape)
        buf, p.buf = p.buf, None  # ours no more: the tensor owns it
        return buf.hand_over(dtype, shape)

    def reap(self, ttl_s: float) -> None:
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.reap(ttl_s)

    def quarantined(self) -> int:
        with self._lock:
            return sum(link.quarantined for link in self._links.values())

    def close(self) -> None:
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
