"""A consumer's pulls: pool blocks, deadlines, retries across producers, verification.

The `Puller` asks producers for an item through one reader per producer (the data path's,
peer_pull/data_path.py `PeerReader`), each pull into a block of the consumer's own pool with
a size-scaled deadline, retries until the caller's deadline, and verifies what landed: the
checksum is computed while chunks land (`StreamVerifier`), the pool block itself handed over
as the tensor."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.protocol.keys import item_key
from ec_connectors.transports.base import TransportEvents, describe
from ec_connectors.transports.hashed_copy import (
    PEER_CHUNK,
    PeerChecksum,
    helper_threads,
    peer_checksum,
)
from ec_connectors.transports.memory import MemoryPool, PoolBuffer, PoolExhausted
from ec_connectors.transports.peer_pull.data_path import PeerReader, PullCounters
from ec_connectors.transports.peer_pull.link import PendingPull
from ec_connectors.transports.peer_pull.messages import Pulled, PullFailed

logger = get_logger(__name__)

_UNKNOWN_RETRY_S = (0.005, 0.2)  # backoff while a producer's save is queued ("pending")


class StreamVerifier:
    """The peer checksum of a pool block's bytes, hashed as chunks land (hashed_copy.py).

    Device pools hash a host copy of each chunk."""

    def __init__(self, buf: PoolBuffer, pool: Executor | None = None, threads: int = 1) -> None:
        self._raw = buf.as_tensor(torch.uint8, (buf.nbytes,))
        self._host = buf.as_bytes() if self._raw.device.type == "cpu" else None
        self._sum = PeerChecksum()
        self._len = self._raw.numel()
        self._pool, self._threads = pool, threads  # a large piece is hashed on both

    def advance(self, upto: int, total: int | None = None) -> None:
        """Hash what landed: the first `upto` bytes of the item.

        `total`: the item's size, once known (until then only whole chunks are hashed)."""
        end = min(upto, self._len)
        if total is None or end < total:
            end -= end % PEER_CHUNK
        start = self._sum.hashed
        if end <= start:
            return
        if self._host is not None:
            self._sum.add(self._host[start:end], self._pool, self._threads)
        else:
            self._sum.add(memoryview(self._raw[start:end].cpu().numpy()).cast("B"))

    def hexdigest(self) -> str:
        """The checksum of everything hashed so far."""
        return self._sum.hexdigest()


class Puller:
    """A consumer's pulls from producers, with retries and verification.

    A consumer's pulls: one reader per producer (`make_link(endpoint)`, the data path's;
    rebuilt after a failure), each pull into a block of the consumer's own pool with a
    size-scaled deadline, retries across producers until the caller's deadline, and
    verification of what landed. `session` names this consumer's data path session in its
    pulls; `events` and `counters` are the transport's counters."""

    def __init__(self, config: EPDConfig, pool: MemoryPool, session: str, namespace: str,
                 make_link: Callable[[str], PeerReader], events: TransportEvents,
                 counters: PullCounters) -> None:
        self.config, self.pool, self.session, self.namespace = config, pool, session, namespace
        self.events, self.counters = events, counters
        self._make_link = make_link
        self._links: dict[str, PeerReader] = {}
        self._lock = threading.Lock()
        # what lands in one piece (one NIXL read) is verified on two threads, as a put hashes
        self._verify_pool, self._verify_threads = helper_threads(2, "epd-verify")

    def link(self, endpoint: str) -> PeerReader:
        """The reader to the producer at `endpoint`, made (or rebuilt after a failure) here."""
        with self._lock:
            link = self._links.get(endpoint)
            if link is not None and link.broken:  # dropped after a failure: rebuild it
                link.close()
                link = None
            if link is None:
                link = self._links[endpoint] = self._make_link(endpoint)
            return link

    def _sources(self, location: str) -> list[str]:
        if location:
            return [location]
        return list(self.config.producers)

    def get(self, item_id: str, deadline: float, location: str = "", nbytes: int = 0,
            *, wait: bool = True) -> torch.Tensor | None:
        """Pull one item into a pool buffer, trying its producers in turn.

        The item from `location` (else from each configured producer in turn) by
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
        """Get a pool block for an item of `nbytes`, or say why not.

        A pool block for an item of `nbytes` ("ok", None when it comes inline or its size
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
        link = self.link(endpoint)
        scaled = self.config.transfer_timeout_base_s + nbytes / self.config.min_transfer_bytes_per_s
        timeout = min(deadline - time.monotonic(), scaled)
        self.counters.pulls += 1
        verifier = StreamVerifier(buf, self._verify_pool, self._verify_threads) \
            if self.config.verify_checksum and buf is not None else None
        p = link.pull(key, self.session, buf, timeout,
                      on_progress=verifier.advance if verifier else None,
                      namespace=self.namespace)
        self.counters.stream_connections += p.opened
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
                self.counters.streamed += 1
            # bytes that fail verification (damaged, or written by an outsider into a
            # registered pool: docs/trust.md) are this producer's corrupt copy: the next
            # producer is asked, never this one again in a hot loop
            return ("ok" if tensor is not None else "corrupt"), tensor
        if isinstance(reply, PullFailed):
            self.counters.failed(reply.code)
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
        """Turn a pull's reply into a verified tensor.

        A verified tensor from the reply: inline bytes, or our pool block itself (CPU
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
            self.counters.inline += 1
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
                verifier.advance(info.nbytes, info.nbytes)  # the rest of what landed
                digest = verifier.hexdigest()
            else:
                digest = peer_checksum(data if data is not None
                                       else memoryview(raw.cpu().numpy()).cast("B"))
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
        """Free buffers producers never answered for, past `ttl_s`."""
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.reap(ttl_s)

    def quarantined(self) -> int:
        """Buffers held because a producer or a read may still write into them."""
        with self._lock:
            return sum(link.quarantined for link in self._links.values())

    def close(self) -> None:
        """Close every reader, then the verifier's threads."""
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        if self._verify_pool is not None:
            self._verify_pool.shutdown(wait=True)
