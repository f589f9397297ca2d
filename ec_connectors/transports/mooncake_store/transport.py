"""Mooncake Store transport: embeddings in a distributed store.

Mooncake Store transport: embeddings in a distributed store (a master plus memory segments
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

import struct
import time
from collections.abc import Iterable

import msgspec

from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.protocol.item_ids import identity
from ec_connectors.protocol.keys import item_key, namespace_key
from ec_connectors.protocol.stored import ItemInfo
from ec_connectors.transports.base import (
    Placement,
    Transport,
    Want,
    checksum,
    describe,
    dtype_name,
    host_copy,
    tensor_bytes,
)
from ec_connectors.transports.mooncake_store.client import (
    NO_SPACE,
    NOT_FOUND,
    RPC_FAILED,
    TRANSIENT,
    StoreClient,
    StoreUnavailable,
)
from ec_connectors.transports.mooncake_store.objects import (
    HEADER_BYTES,
    StoreHeader,
    pack_header,
    store_key,
    unpack_header,
)
from ec_connectors.transports.mooncake_store.probes import ProbeCache

logger = get_logger(__name__)


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
        tensor = host_copy(tensor).contiguous()
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
        """Fetch several items in one batch into pool blocks, verified.

        Sizes first (one cheap RPC each), then every object in one `batch_get_into` into
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
        """Fetch objects into pool blocks, retrying transient failures.

        get_into / batch_get_into with retries of transient failures; None = timed out
        (the blocks are released by the late call)."""
        def release_all() -> None:
            for b in bufs:
                b.release()

        if len(keys) == 1:
            rc = self.client.call(lambda: store.get_into(keys[0], bufs[0].addr, sizes[0]),
                                  deadline, f"get_into {keys[0]}", on_late=release_all)
            return None if rc == -2 else [rc]
        addrs = [b.addr for b in bufs]
        rcs = self.client.bounded(lambda: store.batch_get_into(keys, addrs, sizes),
                                   deadline, on_late=release_all)
        if rcs is None:
            return None
        rcs = list(rcs)
        if RPC_FAILED in rcs:
            self.client.set_alive(False, f"batch_get_into failed with {RPC_FAILED}")
        for j, rc in enumerate(rcs):  # one by one, with retries, what failed transiently
            if rc != sizes[j] and rc in TRANSIENT and rc != RPC_FAILED:
                rcs[j] = self.client.call(
                    lambda j=j: store.get_into(keys[j], bufs[j].addr, sizes[j]), deadline,
                    f"get_into {keys[j]}", on_late=bufs[j].release)  # -2: late, released then
        return rcs

    def _payload_problem(self, header: StoreHeader, payload) -> str:
        """Check a store object's payload by its seal or checksum.

        With the secret the seal is checked (it covers integrity: one pass over the
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
