"""Mooncake Transfer Engine transport: consumers pull items from producers' registered pools.

Producer worker: `put` copies the encoder output once into its registered pool and announces
it (ZMQ PUB). A ZMQ ROUTER side channel answers `Pull`: the producer writes the item straight
into the consumer's registered buffer with the transfer engine (RDMA or TCP), then replies
`Pulled`. Small items ride inline in the reply (one round trip, no engine call).
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

Scheduler process: `mooncake_catalog.MooncakeCatalog` subscribes to producers'
announcements and answers `list_keys` / `locate` from memory (the availability index).

Routing, retries across tiers and request lifecycle live above (worker.py, scheduler_hooks/).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import torch
import xxhash
import zmq

from ec_connectors import messages
from ec_connectors.config import EPDConfig
from ec_connectors.control import ControlEndpoint
from ec_connectors.log import get_logger
from ec_connectors.messages import (
    Announce,
    Evicted,
    ItemInfo,
    PeerMessage,
    Progress,
    Pull,
    Pulled,
    PullFailed,
    Snapshot,
)
from ec_connectors.protocol.keys import item_key
from ec_connectors.protocol.net import (
    PURPOSE_ANNOUNCE,
    PURPOSE_SERVE,
    parse_endpoint,
    port_for,
    resolve_host,
)
from ec_connectors.transports.base import (
    Placement,
    Transport,
    checksum,
    describe,
    dtype_name,
    tensor_bytes,
)
from ec_connectors.transports.memory import MemoryPool, PoolBuffer, PoolExhausted

logger = get_logger(__name__)

_RECENT_EVICTIONS = 4096  # evicted keys remembered, so a pull of one fails fast
_UNKNOWN_RETRY_S = (0.005, 0.2)  # backoff while a producer's save may still be queued


class TransferEngineUnavailable(RuntimeError):
    pass


def _start_engine(config: EPDConfig, host: str):
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(config.progress_timeout_s))
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransferEngineUnavailable(
            "transport 'mooncake' needs the Mooncake Transfer Engine: pip install "
            "'epd-serve[cpu]' (mooncake-transfer-engine-non-cuda) or '[cuda]'; it needs "
            f"libibverbs.so.1 (apt-get install libibverbs1). Import failed: {exc}") from exc
    engine = TransferEngine()
    device = config.device_name or os.environ.get("RDMA_DEVICE_NAME", "")
    rc = engine.initialize(host, "P2PHANDSHAKE", config.protocol, device if
                           config.protocol == "rdma" else "")
    if rc != 0:
        raise TransferEngineUnavailable(
            f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {config.protocol!r}, "
            f"{device!r}) failed with {rc}; check host/protocol/device_name")
    return engine


# --- producer -------------------------------------------------------------------------------


@dataclass
class Held:
    info: ItemInfo
    buf: PoolBuffer
    lease_until: float
    pins: int = 0


class ProducerStore:
    """Items held in the registered pool: leases, pins, LRU. Thread-safe."""

    def __init__(self, pool: MemoryPool, lease_ttl_s: float) -> None:
        self.pool = pool
        self.lease_ttl_s = lease_ttl_s
        self._items: OrderedDict[str, Held] = OrderedDict()  # LRU first
        self._lock = threading.Lock()
        self.recently_evicted: OrderedDict[str, None] = OrderedDict()

    def get(self, key: str) -> Held | None:
        with self._lock:
            held = self._items.get(key)
            if held is not None:
                self._items.move_to_end(key)
            return held

    def pin(self, key: str) -> Held | None:
        with self._lock:
            held = self._items.get(key)
            if held is not None:
                held.pins += 1
                self._items.move_to_end(key)
            return held

    def unpin(self, held: Held) -> None:
        with self._lock:
            held.pins -= 1
        self.pool.notify()

    def renew(self, key: str) -> bool:
        with self._lock:
            held = self._items.get(key)
            if held is None:
                return False
            held.lease_until = time.monotonic() + self.lease_ttl_s
            self._items.move_to_end(key)
            return True

    def add(self, info: ItemInfo, buf: PoolBuffer) -> None:
        with self._lock:
            self._items[info.key] = Held(info, buf, time.monotonic() + self.lease_ttl_s)
            self.recently_evicted.pop(info.key, None)

    def evict_one(self) -> Held | None:
        """Release the least recently used unleased, unpinned item; None if there is none."""
        now = time.monotonic()
        with self._lock:
            for key, held in self._items.items():
                if held.pins == 0 and held.lease_until <= now:
                    del self._items[key]
                    self.recently_evicted[key] = None
                    while len(self.recently_evicted) > _RECENT_EVICTIONS:
                        self.recently_evicted.popitem(last=False)
                    break
            else:
                return None
        held.buf.release()
        return held

    def reserve(self, nbytes: int, deadline: float) -> tuple[PoolBuffer, list[Held]]:
        """A block for a new item: free space, else evict, else wait for leases to lapse or
        pins to drop (backpressure) until `deadline`. Raises PoolExhausted."""
        evicted: list[Held] = []
        while True:
            buf = self.pool.try_allocate(nbytes)
            if buf is not None:
                return buf, evicted
            victim = self.evict_one()
            if victim is not None:
                evicted.append(victim)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                with self._lock:
                    n, leased = len(self._items), sum(1 for h in self._items.values()
                                                      if h.lease_until > time.monotonic())
                raise PoolExhausted(
                    f"producer pool full: {self.pool.used_bytes} of {self.pool.capacity} bytes "
                    f"hold {n} items, {leased} still leased (lease_ttl_s={self.lease_ttl_s}); "
                    f"raise memory_pool_bytes or lower lease_ttl_s")
            with self._lock:
                soonest = min((h.lease_until for h in self._items.values() if h.pins == 0),
                              default=time.monotonic() + 0.05)
            self.pool.wait_for_change(max(0.001, min(left, soonest - time.monotonic(), 0.25)))

    def catalog(self) -> tuple[list[str], list[int]]:
        with self._lock:
            return list(self._items), [h.info.nbytes for h in self._items.values()]

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        with self._lock:
            items, self._items = list(self._items.values()), OrderedDict()
        for held in items:
            if not held.buf.released:
                held.buf.release()


class Announcer:
    """ZMQ PUB of a producer: each stored/evicted item at once, a full snapshot periodically."""

    def __init__(self, bind: str, endpoint: str, store: ProducerStore, interval_s: float,
                 context: zmq.Context, namespace: str):
        self.endpoint = endpoint
        self.namespace = namespace
        self._store = store
        self._interval_s = interval_s
        self._queue: queue.SimpleQueue[msgspec.Struct | None] = queue.SimpleQueue()
        self._sock = context.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.bind(bind)
        self._thread = threading.Thread(target=self._run, name="epd-announce", daemon=True)
        self._thread.start()

    def stored(self, info: ItemInfo) -> None:
        self._queue.put(Announce(endpoint=self.endpoint, items=[info], namespace=self.namespace))

    def evicted(self, keys: list[str]) -> None:
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
                self._sock.send(messages.encode(msg))
        finally:
            self._sock.close()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


# --- consumer ---------------------------------------------------------------------------------


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
    flight to it and the buffers it may still write into."""

    def __init__(self, endpoint: str, context: zmq.Context) -> None:
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
                                       on_disconnect=self._on_disconnect, context=context)

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
                               capacity=buf.nbytes if buf else 0, namespace=namespace))
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


class _StreamVerifier:
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


# --- the transport ----------------------------------------------------------------------------


class MooncakeTransport(Transport):
    """Worker-role transport (see module docstring). One per worker process."""

    name = "mooncake"

    def __init__(self, config: EPDConfig, placement: Placement) -> None:
        super().__init__()
        self.config = config
        self.placement = placement
        self.host = resolve_host(config.host)
        self.namespace = config.namespace or "default"  # one model per producer process
        self.engine = _start_engine(config, self.host)
        self._zmq = zmq.Context()  # ours alone, so close() can terminate it
        self.session = f"{self.host}:{self.engine.get_rpc_port()}"
        self.pool = MemoryPool(config.memory_pool_bytes, config.memory_pool_device,
                               register=self._register)
        self.store: ProducerStore | None = None
        self.server: ControlEndpoint | None = None
        self.announcer: Announcer | None = None
        self._endpoint = ""
        self._links: dict[str, PeerLink] = {}
        self._links_lock = threading.Lock()
        self._serve = ThreadPoolExecutor(config.serve_threads, thread_name_prefix="epd-serve")
        self.pull_stats = {"pulls": 0, "inline": 0, "unknown": 0, "evicted": 0,
                           "transfer_errors": 0}
        if placement.is_producer:
            self._start_producer()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def _register(self, addr: int, size: int) -> None:
        location = "cpu:0" if self.config.memory_pool_device == "cpu" else \
            f"cuda:{torch.cuda.current_device()}"
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
        try:
            self.server = ControlEndpoint(f"tcp://{self.host}:{ports[0]}", bind=True,
                                          on_message=self._on_pull, name="epd-peer-server",
                                          decode=messages.decode_peer, context=self._zmq)
            self.announcer = Announcer(f"tcp://{self.host}:{ports[1]}", self.endpoint,
                                       self.store, c.announce_interval_s, self._zmq,
                                       self.namespace)
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
        if not isinstance(msg, Pull) or peer is None:
            return
        try:
            parse_endpoint(msg.session)
        except ValueError as exc:
            self._reply(peer, PullFailed(pull_id=msg.pull_id, code="bad_request", error=str(exc)))
            return
        self._serve.submit(self._serve_pull, msg, peer)

    def _reply(self, peer: bytes, msg: msgspec.Struct, payload: bytes | None = None) -> None:
        if self.server is not None:
            self.server.send(msg, to=peer, payload=payload)

    def _serve_pull(self, msg: Pull, peer: bytes) -> None:
        assert self.store is not None
        if msg.namespace and msg.namespace != self.namespace:
            self._reply(peer, PullFailed(pull_id=msg.pull_id, code="namespace",
                                         error=f"{self.endpoint} serves model namespace "
                                               f"{self.namespace!r}, not {msg.namespace!r}"))
            return
        held = self.store.pin(msg.key)
        if held is None:
            code = "evicted" if msg.key in self.store.recently_evicted else "unknown"
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
            chunk = self.config.transfer_chunk_bytes or info.nbytes
            for start in range(0, info.nbytes, chunk):
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
                link = self._links[endpoint] = PeerLink(endpoint, self._zmq)
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
            if outcome in ("evicted", "corrupt", "timeout", "namespace") and len(sources) == 1:
                break  # a frozen producer would only cost more quarantined buffers
            i += 1
            if not wait and outcome == "unknown" and i >= len(sources):
                break  # asked every producer once: not stored anywhere right now
            if outcome in ("unknown", "disconnected", "transfer") and i % len(sources) == 0:
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
        verifier = _StreamVerifier(buf) if self.config.verify_checksum and buf is not None \
            else None
        p = link.pull(key, self.session, buf, timeout,
                      on_progress=verifier.advance if verifier else None,
                      namespace=self.namespace)
        try:
            reply = p.reply
            if isinstance(reply, Pulled):
                return "ok", self._receive(reply, p, verifier), nbytes
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
            self.events.pull_timeouts += 1
            logger.warning("EPD: pull of %s: %s", key, p.error)
            return "timeout", None, nbytes
        finally:
            if p.buf is not None:  # not quarantined: ours to free
                p.buf.release()

    def _receive(self, reply: Pulled, p: PendingPull, verifier: _StreamVerifier | None = None
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
                "session": self.session, "pool_used_bytes": self.pool.used_bytes,
                "pool_bytes": self.pool.capacity, "held_items": len(self.store or ()),
                "quarantined": quarantined, **self.pull_stats}

    def close(self) -> None:
        for part in (self.server, self.announcer):
            if part is not None:
                part.close()
        self._serve.shutdown(wait=True, cancel_futures=True)
        with self._links_lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        if self.store is not None:
            self.store.clear()
        self.pool.close()
        with contextlib.suppress(Exception):
            self.engine.unregister_memory(self.pool.base_addr)
        self.engine = None
        self._zmq.destroy(linger=0)  # sockets are closed by now; never waits
