"""Mooncake Store transport: embeddings in a distributed store (a master plus memory segments
its clients contribute), so any instance can fetch what another instance encoded.

One object per item, key `epd/<namespace>/<dtype>/<item key>` (namespace = model, dtype =
embedding dtype: two models, or one model in two dtypes, never share an item). The object is
a small header (magic, namespace, key, dtype, shape, size, xxh3 of the payload) followed by the
raw tensor bytes. Puts and gets go from/to a buffer registered with the store once
(`register_buffer`, `upsert_from`, `get_into`): one copy into the pool on put, none on get (the
pool block is handed over as the tensor).

Store behaviour designed around (see docs/architecture.md, "Store quirks"):
- `put` of an existing key keeps the old value: puts use `upsert_from`, the newest value wins;
- a full segment evicts objects silently, and `get` fails the same way for every cause: a
  missing, evicted, foreign or damaged object is a miss (header and checksum are verified),
  never wrong data;
- `health_check` says healthy after the master died: a monitor thread asks the master itself
  (an RPC with a deadline) every `store_health_interval_s`; while it is down the tier reports
  unavailable, probes answer "no" at once and loads miss at once (tiered: the next tier);
- `setup` blocks ~90 s when no master answers: the master is probed first (bounded);
- a frozen holder blocks `get_into` ~30 s: every data call runs with the caller's deadline;
  a buffer a late call may still touch stays quarantined until that call returns;
- transient errors (-800 transfer, -900 RPC, -200 no space) are retried with backoff, bounded.

Scheduler process: a client that contributes no memory and answers `probe` from a cache,
asking the master in a background thread (batch_is_exist), so the scheduler never blocks.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import msgspec

from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.protocol.items import ItemInfo
from ec_connectors.protocol.keys import item_key, namespace_key
from ec_connectors.protocol.net import parse_endpoint, resolve_host
from ec_connectors.protocol.secret import identity
from ec_connectors.transports.base import (
    Placement,
    Transport,
    Want,
    checksum,
    describe,
    dtype_name,
    tensor_bytes,
)

logger = get_logger(__name__)

MAGIC = b"EPDSTOR1"
HEADER_BYTES = 512  # fixed: the payload starts aligned, right after it
_PREFIX = struct.Struct("<8sI")
NOT_FOUND = -704
NO_SPACE = -200
TRANSIENT = {-800, -900, NO_SPACE, -1}  # worth another try (bounded, with backoff)
RPC_FAILED = -900
_HEALTH_KEY = "epd/health-probe"
_PROBE_BATCH = 256
_PROBE_CACHE = 65536
_MISSING_BACKOFF_S = (0.005, 0.1)


class StoreUnavailable(RuntimeError):
    """The store cannot be used (no master, setup failed, master down)."""


class StoreHeader(msgspec.Struct, frozen=True):
    namespace: str  # namespace_key of the model namespace
    key: str  # item_key of the item id
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: str
    mac: str = ""  # the deployment secret's seal (protocol/secret.py Seal); "" without one


_encode_header = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(StoreHeader).decode


def pack_header(header: StoreHeader) -> bytes:
    body = _encode_header(header)
    if _PREFIX.size + len(body) > HEADER_BYTES:
        raise ValueError("store header too large")
    return (_PREFIX.pack(MAGIC, len(body)) + body).ljust(HEADER_BYTES, b"\0")


def unpack_header(raw: bytes | memoryview) -> StoreHeader:
    magic, n = _PREFIX.unpack_from(raw, 0)
    if magic != MAGIC or _PREFIX.size + n > HEADER_BYTES:
        raise ValueError("not an EPD store object")
    return _decode_header(bytes(raw[_PREFIX.size:_PREFIX.size + n]))


def store_key(namespace: str, dtype: str, item_id: str) -> str:
    return f"epd/{namespace_key(namespace)}/{namespace_key(dtype)}/{item_key(item_id)}"


class StoreClient:
    """One `MooncakeDistributedStore` client: bounded setup, calls with deadlines and retries,
    and a monitor that knows whether the master is alive."""

    def __init__(self, config: EPDConfig, segment_bytes: int, name: str,
                 on_down: Callable[[], None] | None = None) -> None:
        self.config = config
        self._on_down = on_down
        self.name = name
        self.master = config.store_master
        self._store = None
        self._alive = False
        self._down_since: float | None = time.monotonic()
        self._last_error = ""
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._on_connect: list[Callable[[], None]] = []
        self._segment_bytes = segment_bytes
        # Data calls run here so a call stuck on a frozen peer costs its caller only the
        # deadline (the thread finishes on its own when Mooncake gives up).
        self._calls = ThreadPoolExecutor(max(2, config.load_threads + 2),
                                         thread_name_prefix=f"{name}-call")
        self._health = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-health")
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(config.progress_timeout_s))
        self._connect(deadline=time.monotonic() + config.store_setup_timeout_s)
        self._monitor = threading.Thread(target=self._watch, name=f"{name}-monitor",
                                         daemon=True)
        self._monitor.start()

    # -- setup -----------------------------------------------------------------------------
    def _connect(self, deadline: float) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise StoreUnavailable(
                "transport 'mooncake_store' needs Mooncake: pip install 'epd-serve[cpu]' "
                "(mooncake-transfer-engine-non-cuda) or '[cuda]'; it needs libibverbs.so.1 "
                f"(apt-get install libibverbs1). Import failed: {exc}") from exc
        host, port = parse_endpoint(self.master)
        # setup() blocks ~90 s retrying when no master answers: probe it first.
        if not _port_open(host, port, max(0.1, min(2.0, deadline - time.monotonic()))):
            raise StoreUnavailable(
                f"Mooncake Store master {self.master} is not reachable: start it (`epd "
                "master`, or `epd up` with transport mooncake_store) or fix store_master")
        store = MooncakeDistributedStore()
        local = resolve_host(self.config.host)
        args = (local, self.config.store_metadata_url, self._segment_bytes, 0,
                self.config.protocol, self.config.device_name or
                os.environ.get("RDMA_DEVICE_NAME", "") if self.config.protocol == "rdma" else "",
                self.master)
        rc = self._bounded(lambda: store.setup(*args), deadline, executor=self._health)
        if rc is None or rc != 0:
            raise StoreUnavailable(
                f"Mooncake Store setup({local!r}, {self.config.store_metadata_url!r}, segment "
                f"{self._segment_bytes} bytes, {self.config.protocol!r}, master "
                f"{self.master!r}) " + ("timed out" if rc is None else f"failed with {rc}") +
                ": check store_master / store_metadata and that the master runs with its "
                "HTTP metadata server")
        with self._lock:
            self._store = store
        for hook in self._on_connect:
            hook()
        self._set_alive(True)

    def on_connect(self, hook: Callable[[], None]) -> None:
        """Run `hook` now if connected, and after every (re)connect (buffer registration)."""
        self._on_connect.append(hook)
        if self._store is not None:
            hook()

    @property
    def store(self):
        if self._store is None:
            raise StoreUnavailable(f"not connected to Mooncake Store master {self.master}")
        return self._store

    # -- health ------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._alive

    def _set_alive(self, ok: bool, why: str = "") -> None:
        with self._lock:
            was, self._alive = self._alive, ok
            if ok:
                self._down_since = None
            elif was or self._down_since is None:
                self._down_since = time.monotonic()
                self._last_error = why
        if was and not ok:
            if self._on_down is not None:
                self._on_down()
            logger.error("EPD: Mooncake Store master %s is down (%s); its tier is skipped "
                         "until it answers again", self.master, why)
        elif ok and not was:
            logger.info("EPD: Mooncake Store master %s is up", self.master)

    def _watch(self) -> None:
        interval = self.config.store_health_interval_s
        while not self._closed.wait(interval):
            # An RPC to the master with a deadline: a dead master answers -900 at once, a
            # frozen one not at all (health_check() says healthy in both cases).
            rc = self._bounded(lambda: self._store.is_exist(_HEALTH_KEY),
                               time.monotonic() + max(1.0, interval), executor=self._health)
            if rc is None:
                self._set_alive(False, "master did not answer in time")
            elif rc < 0:
                self._set_alive(False, f"master RPC failed ({rc})")
            else:
                self._set_alive(True)

    def health(self) -> dict[str, object]:
        down = self._down_since
        return {"master": self.master, "ok": self._alive,
                "down_s": round(time.monotonic() - down, 1) if down is not None else 0.0,
                "last_error": self._last_error}

    # -- calls -------------------------------------------------------------------------------
    def _bounded(self, fn: Callable[[], int], deadline: float,
                 executor: ThreadPoolExecutor | None = None,
                 on_late: Callable[[], None] | None = None) -> int | None:
        """fn() in a worker thread; its result, or None when `deadline` passed first (then
        `on_late` runs when the call finally returns)."""
        fut: Future = (executor or self._calls).submit(fn)
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            if on_late is not None:
                fut.add_done_callback(lambda _f: on_late())
            return None

    def call(self, fn: Callable[[], int], deadline: float, what: str,
             on_late: Callable[[], None] | None = None, retry_missing: bool = False) -> int:
        """One store call with bounded retries on transient errors (and on "not found" when
        `retry_missing`: a producer's put may still be under way). Returns the last result;
        None-equivalent (timeout) is reported as -1 after `on_late` is armed."""
        backoff = self.config.store_retry_backoff_s
        tries = 0
        while True:
            if not self._alive:
                return RPC_FAILED
            rc = self._bounded(fn, deadline, on_late=on_late)
            if rc is None:
                self._last_error = f"{what}: deadline passed"
                return -1 if on_late is None else -2  # -2: a late call may still run
            if rc == RPC_FAILED:
                self._set_alive(False, f"{what} failed with {rc}")
            retry = (rc in TRANSIENT and rc != RPC_FAILED and tries < self.config.store_retries) \
                or (rc == NOT_FOUND and retry_missing)
            if not retry or time.monotonic() + backoff > deadline:
                return rc
            tries += rc != NOT_FOUND
            time.sleep(backoff)
            backoff = min(backoff * 2, _MISSING_BACKOFF_S[1] if rc == NOT_FOUND else 1.0)

    def close(self) -> None:
        self._closed.set()
        self._monitor.join(timeout=self.config.store_health_interval_s + 2)
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._health.shutdown(wait=False, cancel_futures=True)
        store, self._store = self._store, None
        if store is not None:
            # With the master gone, close() retries its unmount RPCs for ~20 s: bounded here,
            # the rest runs out in a daemon thread (the process is leaving anyway).
            closer = threading.Thread(target=_quiet_close, args=(store,), daemon=True,
                                      name=f"{self.name}-close")
            closer.start()
            closer.join(timeout=5.0 if self._alive else 0.5)


def _quiet_close(store) -> None:
    with contextlib.suppress(Exception):
        store.close()


def _port_open(host: str, port: int, timeout_s: float) -> bool:
    import socket

    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


class ProbeCache:
    """Non-blocking "is it in the store?" for the scheduler: answers from a cache; unknown keys
    are asked in batches by a background thread. An answer not back within `timeout_s` is
    "no" (the request encodes locally rather than wait on a slow master)."""

    def __init__(self, client: StoreClient, timeout_s: float, ttl_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._answers: OrderedDict[str, tuple[bool | None, float]] = OrderedDict()
        self._pending: list[str] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="epd-store-probe", daemon=True)
        self._thread.start()

    def probe(self, key: str) -> bool | None:
        now = time.monotonic()
        entry = self._answers.get(key)
        if entry is not None:
            answer, t = entry
            if answer is None:
                if now - t < self.timeout_s:
                    return None
                return False
            if now - t < self.ttl_s:
                return answer
        if not self.client.alive:
            return False
        with self._cond:
            self._answers[key] = (None, now)
            self._answers.move_to_end(key)
            while len(self._answers) > _PROBE_CACHE:
                self._answers.popitem(last=False)
            self._pending.append(key)
            self._cond.notify()
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                keys, self._pending = self._pending[:_PROBE_BATCH], self._pending[_PROBE_BATCH:]
            deadline = time.monotonic() + self.timeout_s
            try:
                rcs = self.client._bounded(lambda k=keys: self.client.store.batch_is_exist(k),
                                           deadline)
            except StoreUnavailable:
                rcs = None
            now = time.monotonic()
            with self._cond:
                for i, key in enumerate(keys):
                    if rcs is None or rcs[i] < 0:
                        self._answers.pop(key, None)  # unknown: ask again next time
                        if rcs is not None and rcs[i] == RPC_FAILED:
                            self.client._set_alive(False, "probe RPC failed")
                    else:
                        self._answers[key] = (rcs[i] == 1, now)

    def forget(self, key: str) -> None:
        self._answers.pop(key, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=2)


class MooncakeStoreTransport(Transport):
    name = "mooncake_store"
    batches_loads = True

    def __init__(self, config: EPDConfig, placement: Placement) -> None:
        super().__init__()
        self.config = config
        self.placement = placement
        self.namespace = config.scope  # the model's name and fingerprint: keys and headers
        self.dtype_label = config.embedding_dtype or "any"
        self._ns_key = namespace_key(self.namespace)
        self._seal = config.seal  # with the deployment secret: objects are authenticated
        scheduler = placement.role == "scheduler"
        self.client = StoreClient(config, 0 if scheduler else config.store_segment_bytes,
                                  name="epd-store-sched" if scheduler else "epd-store",
                                  on_down=self._count_down)
        self.pool = None
        self._probes = ProbeCache(self.client, config.store_probe_timeout_s,
                                  config.store_probe_ttl_s)
        if not scheduler:
            from ec_connectors.transports.memory import MemoryPool

            # CPU memory: the store's TCP/RDMA path reads and writes it directly.
            self.pool = MemoryPool(config.store_buffer_bytes, "cpu")
            self.client.on_connect(self._register)

    def _count_down(self) -> None:
        self.events.transport_down += 1

    def _register(self) -> None:
        rc = self.client.store.register_buffer(self.pool.base_addr, self.pool.capacity)
        if rc != 0:
            raise StoreUnavailable(f"register_buffer of {self.pool.capacity} bytes failed "
                                   f"with {rc}")

    def key(self, item_id: str) -> str:
        return store_key(self.namespace, self.dtype_label, item_id)

    @property
    def available(self) -> bool:
        return self.client.alive

    # -- producer --------------------------------------------------------------------------
    def put(self, item_id: str, tensor) -> ItemInfo:
        import torch

        if self.pool is None:
            raise RuntimeError("the scheduler-side store client does not store items")
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        tensor = tensor.contiguous()
        key = self.key(item_id)
        if self.placement.rank != 0:
            # Every tensor-parallel rank saves the same item: one copy in the store is enough.
            return ItemInfo(item_id=item_id, key=item_key(item_id), shape=tuple(tensor.shape),
                            dtype=dtype_name(tensor.dtype), nbytes=tensor.nbytes,
                            checksum=checksum(tensor_bytes(tensor)))
        if not self.client.alive:
            raise StoreUnavailable(f"Mooncake Store master {self.client.master} is down")
        deadline = time.monotonic() + self.config.save_queue_timeout_s
        total = HEADER_BYTES + tensor.nbytes
        buf = self.pool.allocate(total, deadline)
        late = False
        try:
            buf.write(tensor, HEADER_BYTES)  # the one copy: into registered memory
            payload = buf.as_bytes()[HEADER_BYTES:total]
            digest = checksum(payload)
            info = ItemInfo(item_id=item_id, key=item_key(item_id),
                            shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype),
                            nbytes=tensor.nbytes, checksum=digest)
            mac = self._seal.mac(identity(self._ns_key, info.key, info.dtype, info.shape,
                                          info.nbytes), payload)
            header = pack_header(StoreHeader(self._ns_key, info.key, info.dtype, info.shape,
                                             info.nbytes, digest, mac))
            buf.write(torch.frombuffer(bytearray(header), dtype=torch.uint8))
            store = self.client.store
            rc = self.client.call(lambda: store.upsert_from(key, buf.addr, total), deadline,
                                  f"upsert {key}", on_late=buf.release)
            late = rc == -2
            if rc != 0:
                raise StoreUnavailable(f"Mooncake Store upsert of {key} ({total} bytes) "
                                       f"failed with {rc}" + (" (no space: raise the "
                                                              "segments' store_segment_bytes)"
                                                              if rc == NO_SPACE else ""))
        finally:
            if not late:
                buf.release()
        self._probes.forget(key)
        return info

    # -- consumer --------------------------------------------------------------------------
    def get(self, item_id: str, deadline: float, location: str = "",
            nbytes: int = 0, *, wait: bool = True):
        return self.get_many([Want(item_id, location, nbytes)], deadline, wait=wait)[0]

    def get_many(self, wants: list[Want], deadline: float, *, wait: bool = True) -> list:
        """Sizes first (one cheap RPC each), then every object in one `batch_get_into` into
        pool blocks; each block is verified and handed over as its tensor."""
        out: list = [None] * len(wants)
        if self.pool is None or not self.client.alive:
            self.events.missing += len(wants)
            return out
        store = self.client.store
        keys: list[str] = []
        sizes: list[int] = []
        bufs: list = []
        where: list[int] = []
        for i, want in enumerate(wants):
            key = self.key(want.item_id)
            size = self.client.call(lambda k=key: store.get_size(k), deadline,
                                    f"get_size {key}", retry_missing=wait)
            if size < 0:
                self.events.missing += 1
                if size not in (NOT_FOUND, RPC_FAILED):
                    self.events.errors.append(f"{key}: get_size failed with {size}")
                continue
            if size <= HEADER_BYTES or size > self.pool.capacity:
                self.events.corrupt += 1
                logger.warning("EPD: store object %s has an impossible size %d (pool %d "
                               "bytes)", key, size, self.pool.capacity)
                continue
            try:
                bufs.append(self.pool.allocate(size, deadline))
            except MemoryError as exc:
                self.events.errors.append(f"{key}: {exc}")
                continue
            keys.append(key)
            sizes.append(size)
            where.append(i)
        if not keys:
            return out
        # Size-scaled like a TE pull: a stuck holder costs this, not the whole load deadline
        # (the next tier still has time).
        deadline = min(deadline, time.monotonic() + self.config.transfer_timeout_base_s
                       + sum(sizes) / self.config.min_transfer_bytes_per_s)
        rcs = self._get_into(store, keys, bufs, sizes, deadline)
        if rcs is None:  # deadline passed: the blocks go back when the late call returns
            self.events.pull_timeouts += 1
            self.events.missing += len(keys)
            return out
        for j, i in enumerate(where):
            tensor = None
            if rcs[j] == -2:  # a late retry owns (and will release) this block
                self.events.pull_timeouts += 1
                continue
            if rcs[j] == sizes[j]:
                tensor = self._verified(keys[j], wants[i].item_id, bufs[j], sizes[j])
            else:  # evicted or replaced since get_size, or failed after retries
                self.events.missing += 1
            if tensor is None:
                bufs[j].release()
            out[i] = tensor  # a handed-over block belongs to its tensor now
        return out

    def _get_into(self, store, keys: list[str], bufs: list, sizes: list[int],
                  deadline: float) -> list[int] | None:
        """get_into / batch_get_into with retries of transient failures; None = timed out
        (the blocks are released by the late call)."""
        def release_all() -> None:
            for b in bufs:
                b.release()

        if len(keys) == 1:
            rc = self.client.call(lambda: store.get_into(keys[0], bufs[0].addr, sizes[0]),
                                  deadline, f"get_into {keys[0]}", on_late=release_all)
            return None if rc == -2 else [rc]
        addrs = [b.addr for b in bufs]
        rcs = self.client._bounded(lambda: store.batch_get_into(keys, addrs, sizes),
                                   deadline, on_late=release_all)
        if rcs is None:
            return None
        rcs = list(rcs)
        if RPC_FAILED in rcs:
            self.client._set_alive(False, f"batch_get_into failed with {RPC_FAILED}")
        for j, rc in enumerate(rcs):  # one by one, with retries, what failed transiently
            if rc != sizes[j] and rc in TRANSIENT and rc != RPC_FAILED:
                rcs[j] = self.client.call(
                    lambda j=j: store.get_into(keys[j], bufs[j].addr, sizes[j]), deadline,
                    f"get_into {keys[j]}", on_late=bufs[j].release)  # -2: late, released then
        return rcs

    def _payload_problem(self, header: StoreHeader, payload) -> str:
        """With the secret the seal is checked (it covers integrity: one pass over the
        bytes); without it the xxh3 checksum."""
        if self._seal.active:
            ok = self._seal.check(identity(header.namespace, header.key, header.dtype,
                                           header.shape, header.nbytes), payload, header.mac)
            return "" if ok else "not sealed with this deployment's secret (or damaged)"
        if self.config.verify_checksum and checksum(payload) != header.checksum:
            return "checksum mismatch"
        return ""

    def _verified(self, key: str, item_id: str, buf, size: int):
        raw = buf.as_bytes()
        try:
            header = unpack_header(raw[:HEADER_BYTES])
            info = ItemInfo(item_id=item_id, key=header.key, shape=header.shape,
                            dtype=header.dtype, nbytes=header.nbytes, checksum=header.checksum)
            dtype, shape = describe(info)
            problem = ("another namespace" if header.namespace != self._ns_key else
                       "another item" if header.key != item_key(item_id) else
                       "size mismatch" if HEADER_BYTES + header.nbytes != size else
                       self._payload_problem(header, raw[HEADER_BYTES:size]))
        except (ValueError, msgspec.DecodeError, struct.error) as exc:
            problem = f"bad header ({exc})"
        if problem:
            self.events.corrupt += 1
            logger.warning("EPD: store object %s rejected: %s; the item is a miss", key,
                           problem)
            return None
        return buf.hand_over(dtype, shape, HEADER_BYTES)

    # -- both --------------------------------------------------------------------------------
    def probe(self, item_id: str) -> bool | None:
        return self._probes.probe(self.key(item_id))

    def exists(self, item_id: str) -> bool:
        if not self.client.alive:
            return False
        key = self.key(item_id)
        store = self.client.store
        return self.client.call(lambda: store.is_exist(key),
                                time.monotonic() + self.config.store_probe_timeout_s,
                                f"is_exist {key}") == 1

    def list_keys(self) -> Iterable[str]:
        return ()  # the store cannot list: schedulers ask with probe()

    def delete(self, item_id: str) -> bool:
        if not self.client.alive:
            return False
        key = self.key(item_id)
        store = self.client.store
        rc = self.client.call(lambda: store.remove(key),
                              time.monotonic() + self.config.store_probe_timeout_s,
                              f"remove {key}")
        self._probes.forget(key)
        return rc == 0

    def health(self) -> dict[str, object]:
        out: dict[str, object] = {"transport": self.name, **self.client.health()}
        if self.pool is not None:
            out["buffer_used_bytes"] = self.pool.used_bytes
        return out

    def close(self) -> None:
        self._probes.close()
        self.client.close()
        if self.pool is not None:
            self.pool.close()
