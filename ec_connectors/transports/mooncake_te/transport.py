"""Mooncake Transfer Engine transport: consumers pull items from producers' registered pools.

Producer worker: `put` copies the encoder output once into its registered pool and announces
it (ZMQ PUB). A ZMQ ROUTER side channel answers `Pull`: the producer writes the item straight
into the consumer's registered buffer with the transfer engine (RDMA or TCP), then replies
`Pulled`. Small items ride inline in the reply (one round trip, no engine call). Every connection of
the side channel opens with the consumer's `Register`: its pool's range, proven by a nonce the
producer reads back from the consumer's memory; writes go only into that range, so a peer
cannot aim a producer at another consumer's buffers.
Items are held under a byte budget (the pool): leased for `lease_ttl_s` after their save,
never deleted on pull (any number of consumers), LRU-evicted only once unleased and unpinned;
when everything is leased a save waits (backpressure) and then fails loudly.

Consumer worker: `get` allocates from its own pool, asks the producer to write, waits with a
size-scaled deadline, verifies the checksum, and hands the pool block itself over as the
tensor (no copy; the block returns to the pool when the tensor is dropped, so size the
consumer pool for vLLM's encoder cache plus pulls in flight; a full pool only delays pulls
until their deadline, then the item is encoded locally).
A buffer whose pull timed out may still be written by a frozen producer: it is quarantined
until that producer answers or disconnects (or `quarantine_ttl_s`), never reused early.

Scheduler process: `catalog.MooncakeCatalog` subscribes to producers'
announcements and answers `list_keys` / `locate` from memory (the availability index).

Routing, retries across tiers and request lifecycle live above (worker.py, scheduler_hooks/).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch
import zmq

from ec_connectors.config import EPDConfig
from ec_connectors.control import ControlEndpoint
from ec_connectors.log import get_logger
from ec_connectors.protocol.items import ItemInfo
from ec_connectors.protocol.keys import item_key
from ec_connectors.protocol.net import parse_endpoint, resolve_host
from ec_connectors.protocol.ports import PURPOSE_ANNOUNCE, PURPOSE_SERVE, port_for
from ec_connectors.protocol.secret import SECRET_ENV, data_plane_host
from ec_connectors.transports.base import (
    Placement,
    Transport,
    checksum,
    describe,
    dtype_name,
    tensor_bytes,
)
from ec_connectors.transports.memory import MemoryPool, PoolExhausted
from ec_connectors.transports.mooncake_te import messages
from ec_connectors.transports.mooncake_te.consumer import PeerLink, PendingPull, StreamVerifier
from ec_connectors.transports.mooncake_te.engine import TransferEngineUnavailable, start_engine
from ec_connectors.transports.mooncake_te.messages import (
    PeerMessage,
    Progress,
    Pull,
    Pulled,
    PullFailed,
    Register,
)
from ec_connectors.transports.mooncake_te.producer import (
    Announcer,
    ConsumerRanges,
    ProducerStore,
)

logger = get_logger(__name__)

_UNKNOWN_RETRY_S = (0.005, 0.2)  # backoff while a producer's save may still be queued
_OWN_PAGE = 4096  # registered page: our proof nonce, then a producer's scratch slots
_REGISTER_WAIT_S = 5.0  # a pull waits this long at most for its connection's Register


class MooncakeTransport(Transport):
    """Worker-role transport (see module docstring). One per worker process."""

    name = "mooncake"

    def __init__(self, config: EPDConfig, placement: Placement) -> None:
        super().__init__()
        self.config = config
        self.placement = placement
        self.curve = config.curve
        self.host = data_plane_host(config.host, self.curve is not None)
        if self.host != resolve_host(config.host):
            logger.warning("EPD mooncake: no deployment secret (secret_file or $%s): the side "
                           "channel, announcements and transfer engine serve loopback only, "
                           "not %s; give every EPD process the same secret to serve other "
                           "hosts", SECRET_ENV, resolve_host(config.host))
        self.namespace = config.scope  # one model (name and fingerprint) per producer process
        self.engine = start_engine(config, self.host)
        self._zmq = zmq.Context()  # ours alone, so close() can terminate it
        self.session = f"{self.host}:{self.engine.get_rpc_port()}"
        self.pool = MemoryPool(config.memory_pool_bytes, config.memory_pool_device,
                               register=self._register)
        # Our own registered page: the nonce a consumer proves its session with (first
        # bytes), and a producer's scratch for reading other consumers' proofs (the rest).
        self._own = torch.zeros(_OWN_PAGE, dtype=torch.uint8)
        self._register(self._own.data_ptr(), _OWN_PAGE, "cpu:0")
        nonce = os.urandom(ConsumerRanges.NONCE_BYTES)
        self._own[:len(nonce)] = torch.frombuffer(bytearray(nonce), dtype=torch.uint8)
        self._hello = Register(session=self.session, base=self.pool.base_addr,
                               length=self.pool.capacity, proof_addr=self._own.data_ptr(),
                               nonce=nonce)
        self.ranges: ConsumerRanges | None = None
        self.store: ProducerStore | None = None
        self.server: ControlEndpoint | None = None
        self.announcer: Announcer | None = None
        self._endpoint = ""
        self._links: dict[str, PeerLink] = {}
        self._links_lock = threading.Lock()
        self._serve = ThreadPoolExecutor(config.serve_threads, thread_name_prefix="epd-serve")
        # Proofs of registrations run apart: pulls on the serve threads may be waiting for them.
        self._prove = ThreadPoolExecutor(2, thread_name_prefix="epd-register")
        self.pull_stats = {"pulls": 0, "inline": 0, "unknown": 0, "evicted": 0,
                           "transfer_errors": 0, "expired": 0, "unregistered": 0}
        self._queued_pulls = 0  # producer: pulls accepted and not yet served
        if placement.is_producer:
            self._start_producer()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def _register(self, addr: int, size: int, location: str = "") -> None:
        location = location or ("cpu:0" if self.config.memory_pool_device == "cpu" else
                                f"cuda:{torch.cuda.current_device()}")
        try:
            rc = self.engine.register_memory(addr, size, location)
        except TypeError:  # wheels before 0.3.13 take no location (they detect it)
            rc = self.engine.register_memory(addr, size)
        if rc != 0:
            raise TransferEngineUnavailable(f"register_memory of the {size}-byte pool failed "
                                            f"with {rc}")

    def _start_producer(self) -> None:
        p, c = self.placement, self.config
        ports = [port_for(c.base_port, purpose, c.stage_offset, p.dp_rank, p.world_size, p.rank)
                 for purpose in (PURPOSE_SERVE, PURPOSE_ANNOUNCE)]
        self._endpoint = f"{self.host}:{ports[0]}"
        self.store = ProducerStore(self.pool, c.lease_ttl_s)
        self.ranges = ConsumerRanges(self.engine.transfer_sync_read,
                                     memoryview(self._own.numpy()), self._own.data_ptr())
        try:
            self.server = ControlEndpoint(f"tcp://{self.host}:{ports[0]}", bind=True,
                                          on_message=self._on_pull, name="epd-peer-server",
                                          decode=messages.decode_peer,
                                          context=self._zmq, curve=self.curve)
            self.announcer = Announcer(f"tcp://{self.host}:{ports[1]}", self.endpoint,
                                       self.store, c.announce_interval_s, self._zmq,
                                       self.namespace, curve=self.curve)
        except (RuntimeError, zmq.ZMQError) as exc:
            raise TransferEngineUnavailable(
                f"cannot listen on {self.host}:{ports[0]}/{ports[1]} ({exc}); another process "
                f"uses the port: set base_port or stage_offset") from exc
        logger.info("EPD mooncake producer: side channel %s, announcements :%d, engine %s, "
                    "pool %d MiB on %s", self.endpoint, ports[1], self.session,
                    self.pool.capacity >> 20, c.memory_pool_device)

    # -- producer ------------------------------------------------------------------------------
    def put(self, item_id: str, tensor: torch.Tensor) -> ItemInfo:
        if self.store is None:
            raise RuntimeError("put() on a consumer-only mooncake transport")
        key = item_key(item_id)
        held = self.store.get(key)
        if held is not None:  # same content id, same bytes: renew the promise, store nothing
            self.store.renew(key)
            return held.info
        host_view = tensor if tensor.device.type == "cpu" else tensor.cpu()
        data = tensor_bytes(host_view)
        deadline = time.monotonic() + self.config.save_queue_timeout_s
        buf, evicted = self.store.reserve(len(data), deadline)
        try:  # from the host copy made for the checksum when the pool is on the host too
            buf.write(host_view if self.pool.device == "cpu" else tensor)
        except BaseException:
            buf.release()
            raise
        info = ItemInfo(item_id=item_id, key=key, shape=tuple(tensor.shape),
                        dtype=dtype_name(tensor.dtype), nbytes=len(data),
                        checksum=checksum(data), location=self.endpoint)
        self.store.add(info, buf)
        if evicted:
            self.events.evictions += len(evicted)
            self.events.evicted_bytes += sum(h.info.nbytes for h in evicted)
        if self.announcer is not None:
            self.announcer.evicted([h.info.key for h in evicted])
            self.announcer.stored(info)
        return info

    def _on_pull(self, msg: PeerMessage, peer: bytes | None, _payload: list[bytes]) -> None:
        if isinstance(msg, Register) and peer is not None and self.ranges is not None:
            claim = self.ranges.register(peer, msg.session, msg.base, msg.length)
            if not claim.done.is_set():
                self._prove.submit(self.ranges.prove, claim, msg.proof_addr, msg.nonce,
                                   self.config.transfer_timeout_base_s)
            return
        if not isinstance(msg, Pull) or peer is None:
            return
        try:
            parse_endpoint(msg.session)
        except ValueError as exc:
            self._reply(peer, PullFailed(pull_id=msg.pull_id, code="bad_request", error=str(exc)))
            return
        with self._links_lock:
            if self._queued_pulls >= self.config.max_queued_pulls:
                busy = True
            else:
                busy = False
                self._queued_pulls += 1
        if busy:
            self._reply(peer, PullFailed(pull_id=msg.pull_id, code="busy",
                                         error=f"{self.endpoint} has "
                                               f"{self.config.max_queued_pulls} pulls queued"))
            return
        expires = time.monotonic() + msg.timeout_s if msg.timeout_s > 0 else float("inf")
        self._serve.submit(self._serve_queued, msg, peer, expires)

    def _serve_queued(self, msg: Pull, peer: bytes, expires: float) -> None:
        try:
            self._serve_pull(msg, peer, expires)
        finally:
            with self._links_lock:
                self._queued_pulls -= 1

    def _expired(self, msg: Pull, peer: bytes, expires: float) -> bool:
        """Past the pull's deadline: say so (the consumer frees its buffer) and stop."""
        if time.monotonic() <= expires:
            return False
        self.pull_stats["expired"] += 1
        self._reply(peer, PullFailed(pull_id=msg.pull_id, code="expired",
                                     error=f"the pull's {msg.timeout_s:.3g} s passed at "
                                           f"{self.endpoint}; nothing more is written"))
        return True

    def _reply(self, peer: bytes, msg: msgspec.Struct, payload: bytes | None = None) -> None:
        if self.server is not None:
            self.server.send(msg, to=peer, payload=payload)

    def _serve_pull(self, msg: Pull, peer: bytes, expires: float = float("inf")) -> None:
        assert self.store is not None
        if self._expired(msg, peer, expires):
            return
        if msg.namespace and msg.namespace != self.namespace:
            self._reply(peer, PullFailed(pull_id=msg.pull_id, code="namespace",
                                         error=f"{self.endpoint} serves model namespace "
                                               f"{self.namespace!r}, not {msg.namespace!r}"))
            return
        held = self.store.pin(msg.key)
        if held is None:
            code = ("failed" if msg.key in self.store.recently_failed else
                    "evicted" if msg.key in self.store.recently_evicted else "unknown")
            self._reply(peer, PullFailed(pull_id=msg.pull_id, code=code,
                                         error=f"item {msg.key} is {code} at {self.endpoint}"))
            return
        try:
            info = held.info
            if info.nbytes <= self.config.inline_max_bytes:
                data = bytes(held.buf.as_tensor(torch.uint8, (info.nbytes,)).cpu().numpy())
                self._reply(peer, Pulled(pull_id=msg.pull_id, info=info, inline=True), data)
                return
            if msg.capacity < info.nbytes:
                self._reply(peer, PullFailed(pull_id=msg.pull_id, code="too_small", info=info,
                                             error=f"needs {info.nbytes} bytes"))
                return
            assert self.ranges is not None
            refused = self.ranges.check(peer, msg.session, msg.dst_addr, info.nbytes,
                                        min(expires, time.monotonic() + _REGISTER_WAIT_S))
            if refused:
                self.pull_stats["unregistered"] += 1
                self._reply(peer, PullFailed(pull_id=msg.pull_id, code="unregistered",
                                             error=f"{self.endpoint} writes nothing: {refused}"))
                return
            chunk = self.config.transfer_chunk_bytes or info.nbytes
            for start in range(0, info.nbytes, chunk):
                if self._expired(msg, peer, expires):
                    return
                n = min(chunk, info.nbytes - start)
                rc = self.engine.transfer_sync_write(msg.session, held.buf.addr + start,
                                                     msg.dst_addr + start, n)
                if rc != 0:
                    self._reply(peer, PullFailed(pull_id=msg.pull_id, code="transfer",
                                                 error=f"transfer_sync_write to {msg.session} "
                                                       f"returned {rc}"))
                    return
                if start + n < info.nbytes:  # the consumer verifies it while the rest flies
                    self._reply(peer, Progress(pull_id=msg.pull_id, done=start + n))
            self._reply(peer, Pulled(pull_id=msg.pull_id, info=info))
        finally:
            self.store.unpin(held)

    # -- consumer ------------------------------------------------------------------------------
    def _link(self, endpoint: str) -> PeerLink:
        with self._links_lock:
            link = self._links.get(endpoint)
            if link is not None and link.broken:  # dropped after a failure: rebuild it
                link.close()
                link = None
            if link is None:
                link = self._links[endpoint] = PeerLink(endpoint, self._zmq, self.curve,
                                                        hello=self._hello)
            return link

    def _sources(self, location: str) -> list[str]:
        if location:
            return [location]
        return list(self.config.producers)

    def get(self, item_id: str, deadline: float, location: str = "",
            nbytes: int = 0, *, wait: bool = True) -> torch.Tensor | None:
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
            if not wait and outcome == "unknown" and i >= len(sources):
                break  # asked every producer once: not stored anywhere right now
            if outcome in ("unknown", "disconnected", "transfer", "busy") \
                    and i % len(sources) == 0:
                # Maybe still in the producer's save queue, or it restarts: retry until the
                # deadline, backing off.
                time.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
                backoff = min(backoff * 2, _UNKNOWN_RETRY_S[1])
        self.events.missing += 1
        return None

    def _pull_once(self, endpoint: str, key: str, deadline: float, nbytes: int
                   ) -> tuple[str, torch.Tensor | None, int]:
        """One pull: (outcome, tensor or None, item size if learnt)."""
        buf = None
        if nbytes > self.pool.capacity:
            self.events.errors.append(f"{key}: {nbytes} bytes exceed the consumer pool")
            logger.error("EPD: item %s (%d bytes) is larger than the whole consumer pool "
                         "(%d bytes): raise memory_pool_bytes", key, nbytes, self.pool.capacity)
            return "too_big", None, nbytes
        if nbytes > self.config.inline_max_bytes:
            try:
                buf = self.pool.allocate(nbytes, deadline)
            except PoolExhausted as exc:
                self.events.errors.append(f"consumer pool: {exc}")
                logger.warning("EPD: consumer pool exhausted, cannot pull %s: %s", key, exc)
                time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
                return "pool", None, nbytes
        link = self._link(endpoint)
        scaled = self.config.transfer_timeout_base_s + nbytes / self.config.min_transfer_bytes_per_s
        timeout = min(deadline - time.monotonic(), scaled)
        self.pull_stats["pulls"] += 1
        verifier = StreamVerifier(buf) if self.config.verify_checksum and buf is not None \
            else None
        p = link.pull(key, self.session, buf, timeout,
                      on_progress=verifier.advance if verifier else None,
                      namespace=self.namespace)
        try:
            reply = p.reply
            if isinstance(reply, Pulled):
                if reply.info.key != key:  # a peer's word: the item asked for, nothing else
                    self.events.corrupt += 1
                    logger.warning("EPD: %s answered a pull of %s with item %s; ignored",
                                   endpoint, key, reply.info.key)
                    return "corrupt", None, nbytes
                tensor = self._receive(reply, p, verifier)
                # bytes that fail verification (damaged, or written by an outsider into a
                # registered pool: docs/trust.md) are this producer's corrupt copy: the next
                # producer is asked, never this one again in a hot loop
                return ("ok" if tensor is not None else "corrupt"), tensor, nbytes
            if isinstance(reply, PullFailed):
                if reply.code == "too_small" and reply.info is not None:
                    return "too_small", None, reply.info.nbytes
                self.pull_stats[{"unknown": "unknown", "evicted": "evicted"}.get(
                    reply.code, "transfer_errors")] += 1
                if reply.code not in ("unknown",):
                    logger.warning("EPD: pull of %s from %s failed: %s %s", key, endpoint,
                                   reply.code, reply.error)
                return reply.code, None, nbytes
            if "disconnected" in p.error:
                self.events.peer_disconnects += 1
                return "disconnected", None, nbytes
            if "unreachable" in p.error:
                self.events.peer_disconnects += 1
                return "unreachable", None, nbytes
            self.events.pull_timeouts += 1
            logger.warning("EPD: pull of %s: %s", key, p.error)
            return "timeout", None, nbytes
        finally:
            if p.buf is not None:  # not quarantined: ours to free
                p.buf.release()

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
            self.pull_stats["inline"] += 1
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

    # -- the rest of the interface ---------------------------------------------------------------
    def renew(self, item_id: str) -> None:
        if self.store is not None:
            self.store.renew(item_key(item_id))

    def save_failed(self, item_id: str, reason: str) -> None:
        if self.store is not None:  # pulls of it are answered "failed" from now on
            self.store.failed(item_key(item_id))

    def exists(self, item_id: str) -> bool:
        return self.store is not None and self.store.get(item_key(item_id)) is not None

    def list_keys(self) -> Iterable[str]:
        return self.store.catalog()[0] if self.store is not None else []

    def delete(self, item_id: str) -> bool:
        return False  # items leave by lease expiry and LRU, never on request

    def reap(self) -> None:
        with self._links_lock:
            links = list(self._links.values())
        for link in links:
            link.reap(self.config.quarantine_ttl_s)

    def health(self) -> dict[str, object]:
        with self._links_lock:
            quarantined = sum(link.quarantined for link in self._links.values())
        return {"transport": self.name, "ok": True, "endpoint": self.endpoint,
                "session": self.session, "pool_addr": self.pool.base_addr,
                "pool_used_bytes": self.pool.used_bytes,
                "pool_bytes": self.pool.capacity, "held_items": len(self.store or ()),
                "quarantined": quarantined, **self.pull_stats}

    def close(self) -> None:
        for part in (self.server, self.announcer):
            if part is not None:
                part.close()
        self._serve.shutdown(wait=True, cancel_futures=True)
        self._prove.shutdown(wait=True, cancel_futures=True)
        with self._links_lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        if self.store is not None:
            self.store.clear()
        self.pool.close()
        for addr in (self.pool.base_addr, self._own.data_ptr()):
            with contextlib.suppress(Exception):
                self.engine.unregister_memory(addr)
        self.engine = None
        self._zmq.destroy(linger=0)  # sockets are closed by now; never waits
