"""The `shm` transport: producer and consumers on one host, one copy each way.

put (producer worker, rank 0): reserve a block in this process's arena (evicting or waiting
for room), copy the tensor in and hash it in the same pass (hashed_copy.py), stamp the block,
publish the record. get (any process of the host): read the record, check every field of it
against this deployment and the arena (names, offsets, sizes: a record is a peer's word),
take a read lock on the block (the producer cannot reuse it meanwhile), copy it into warm
memory of this process (a pre-faulted pool; the block goes back when vLLM drops the tensor)
hashing as it copies, and hand the tensor over only if the digest matches. A missing,
evicted, foreign or damaged item is a miss (the caller encodes locally), never wrong bytes.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ec_connectors.log import get_logger
from ec_connectors.protocol.item_ids import identity
from ec_connectors.protocol.keys import item_key, namespace_key
from ec_connectors.protocol.secret_file import read_secret
from ec_connectors.protocol.stored import ItemInfo
from ec_connectors.transports.base import (
    Placement,
    Transport,
    dtype_from_name,
    dtype_name,
    host_copy,
)
from ec_connectors.transports.dir_watch import DirWatch
from ec_connectors.transports.hashed_copy import (
    Digest,
    copy_and_hash,
    derive_key,
    helper_threads,
)
from ec_connectors.transports.shm.arena import (
    BLOCK_HEADER,
    BLOCK_MAGIC,
    PAGE,
    Arena,
    Mapping,
    Mappings,
    key_hash,
    sweep,
)
from ec_connectors.transports.shm.layout import (
    RECORD_SUFFIX,
    BadRecord,
    Record,
    ShmDir,
    key_of,
    tmpfs,
)

if TYPE_CHECKING:
    import torch

    from ec_connectors.config import EPDConfig
    from ec_connectors.transports.memory import MemoryPool, PoolBuffer

logger = get_logger(__name__)

_SWEEP_S = 30.0  # how often a worker looks for arenas of dead producers
_POOLED_MIN = 64 << 10  # smaller items are copied into a fresh allocation
_MIN_CHUNK, _MAX_CHUNK = 64 << 10, 64 << 20
_MADV_POPULATE_WRITE = 23


class _Evicted(Exception):
    """The record names a block that was evicted or reused since (or is being evicted)."""


class _TooLarge(Exception):
    pass


class ShmTransport(Transport):
    name = "shm"
    reads_in_scheduler = True  # a read of this host's shared memory: no worker needed
    writes_fast = True  # a small put is a memcpy and a record rename

    def __init__(self, config: EPDConfig, placement: Placement | None = None) -> None:
        super().__init__()
        self.config = config
        self.placement = placement = placement or Placement()
        self.scope = config.scope
        self.dir = ShmDir(config.shm_path, namespace_key(config.namespace or "default"))
        if not tmpfs(self.dir.path):
            logger.warning("EPD: shm_path %s is not on tmpfs: items may be written to disk",
                           self.dir.path)
        self.digest = Digest(config.shm_verify, derive_key(read_secret(config.secret_file)))
        self.chunk = config.shm_chunk_bytes
        worker = placement.role == "worker"
        # workers map whole arenas pre-faulted (large copies); the scheduler reads small
        # items and maps lazily
        self.maps = Mappings(self.dir, populate=worker)
        self._exec, self.threads = helper_threads(config.shm_copy_threads if worker else 1,
                                                  "epd-shm-copy")
        # workers use large items in the producer's block (the scheduler copies small ones)
        self.zero_copy = worker and config.shm_zero_copy
        self.arena: Arena | None = None
        self._dest: MemoryPool | None = None
        self._dest_lock = threading.Lock()
        self._swept_at = time.monotonic()
        self._evictions_seen = 0
        if worker:
            sweep(self.dir)  # arenas and records of processes that are gone
        if worker and placement.is_producer and placement.rank == 0:
            # every tensor-parallel rank saves the same item: rank 0's copy serves them all
            self.arena = Arena(self.dir, config.shm_arena_bytes, config.shm_lease_ttl_s,
                               config.shm_lease_min_s)
        if worker and placement.is_consumer and not placement.is_producer:
            self._destination_pool()  # pre-faulted now, not on the first load

    # -- write -------------------------------------------------------------------------------
    def put(self, item_id: str, tensor: torch.Tensor) -> ItemInfo:
        import torch

        key = item_key(item_id)
        tensor = host_copy(tensor).contiguous()
        dtype, shape, nbytes = dtype_name(tensor.dtype), tuple(tensor.shape), tensor.nbytes
        if self.arena is None:
            if self.placement.role == "worker" and self.placement.is_producer:
                return ItemInfo(item_id=item_id, key=key, shape=shape, dtype=dtype,
                                nbytes=nbytes, checksum="")  # rank 0 stores it
            raise RuntimeError("this shm transport instance stores no items (scheduler side)")
        self._housekeep()
        arena = self.arena
        offset, gen = arena.reserve(nbytes, time.monotonic() + self.config.shm_put_timeout_s)
        self._count_evictions()
        data = offset + BLOCK_HEADER
        committed = False
        try:
            flat = tensor.reshape(-1).view(torch.uint8)
            if self.digest.hashes_bytes or not nbytes:
                parts = copy_and_hash(arena.addr + data, arena.view[data:data + nbytes],
                                      flat.data_ptr() if nbytes else None, nbytes,
                                      self.chunk, self.digest, self._exec, self.threads)
            else:  # torch's intra-op threads: the ones the encoder just ran on, still awake
                torch.frombuffer(arena.view[data:data + nbytes], dtype=torch.uint8).copy_(flat)
                parts = []
            ident = identity(self.scope, key, dtype, shape, nbytes)
            digest = self.digest.final(ident, self.chunk, parts)
            arena.commit(key, offset, gen, nbytes)
            committed = True
            self.dir.write_record(Record(
                item_id=item_id, key=key, scope=self.scope, dtype=dtype, shape=shape,
                nbytes=nbytes, arena=arena.name, offset=offset, gen=gen, chunk=self.chunk,
                algo=self.digest.algo, digest=digest,
                seal=self._seal(ident, arena.name, offset, gen, self.chunk, digest)))
        except BaseException:
            if committed:
                arena.evict_key(key)
            else:
                arena.free(offset)
            raise
        return ItemInfo(item_id=item_id, key=key, shape=shape, dtype=dtype, nbytes=nbytes,
                        checksum=digest)

    def _count_evictions(self) -> None:
        if self.arena is not None and self.arena.evictions != self._evictions_seen:
            self.events.evictions += self.arena.evictions - self._evictions_seen
            self.events.evicted_bytes = self.arena.evicted_bytes
            self._evictions_seen = self.arena.evictions

    # -- read --------------------------------------------------------------------------------
    def get(self, item_id: str, deadline: float, location: str = "",
            nbytes: int = 0, *, wait: bool = True) -> torch.Tensor | None:
        key = item_key(item_id)
        delay = 0.001
        while True:
            try:
                return self._read(item_id, key)
            except FileNotFoundError:
                if not wait or time.monotonic() + delay > deadline or self.dir.failed(key):
                    self.events.missing += 1  # not there (in time), or its save failed
                    return None
                time.sleep(delay)  # the producer may still be writing it
                delay = min(delay * 2, 0.02)
            except _Evicted:
                self.events.missing += 1
                return None
            except BadRecord as exc:
                self.events.corrupt += 1
                logger.warning("EPD: ignoring shm item %r (%s); it will be encoded locally",
                               item_id, exc)
                return None

    def get_small(self, item_id: str, max_bytes: int) -> torch.Tensor | None:
        try:
            return self._read(item_id, item_key(item_id), max_bytes=max_bytes)
        except (OSError, BadRecord, _Evicted, _TooLarge):
            return None  # the workers' load waits for it, or counts and reports the miss

    def _check(self, rec: Record, item_id: str, key: str) -> tuple[torch.dtype, list[int]]:
        """The record's claims, checked against what was asked and this deployment."""
        if rec.key != key or rec.item_id != item_id:
            raise BadRecord("record belongs to another item")
        if rec.scope != self.scope:
            raise BadRecord(f"stored for {rec.scope!r}, this is {self.scope!r} (another model)")
        if rec.algo != self.digest.algo:
            raise BadRecord(f"verified with {rec.algo}, this instance requires "
                            f"{self.digest.algo} (shm_verify)")
        if not _MIN_CHUNK <= rec.chunk <= _MAX_CHUNK:
            raise BadRecord(f"chunk size {rec.chunk}")
        try:
            dtype = dtype_from_name(rec.dtype)
        except ValueError as exc:
            raise BadRecord(str(exc)) from None
        numel = 1
        for d in rec.shape:
            if d < 0:
                raise BadRecord(f"negative dimension in {rec.shape}")
            numel *= d
        if numel * dtype.itemsize != rec.nbytes:
            raise BadRecord(f"shape {rec.shape} of {rec.dtype} is not {rec.nbytes} bytes")
        return dtype, list(rec.shape)

    def _seal(self, ident: str, arena: str, offset: int, gen: int, chunk: int,
              digest: str) -> str:
        """The item's digest bound to its block, keyed like the digest.

        A reader that trusts the producer's hash checks this instead of hashing the bytes
        again."""
        return self.digest.final(f"{ident}\0seal\0{arena}\0{offset}\0{gen}", chunk,
                                 [digest.encode()])

    def _read(self, item_id: str, key: str, max_bytes: int | None = None) -> torch.Tensor:
        """The verified item: a view of the producer's block, or a copy.

        FileNotFoundError: no record; _Evicted; BadRecord. Large items on workers are a view
        of the producer's block, pinned while the tensor lives; others a copy."""
        rec = self.dir.read_record(key)
        dtype, shape = self._check(rec, item_id, key)
        if max_bytes is not None and rec.nbytes > max_bytes:
            raise _TooLarge
        try:
            m = self.maps.acquire(rec.arena)
        except FileNotFoundError:  # its producer is gone: so is the item
            self.dir.unlink_record_if(key, rec.arena, rec.gen)
            raise _Evicted from None
        length = BLOCK_HEADER + rec.nbytes
        pinned = handed = False
        buf: PoolBuffer | None = None
        try:
            if rec.offset < PAGE or rec.offset % PAGE or rec.offset + length > m.size:
                raise BadRecord(f"block {rec.offset}+{length} outside its arena ({m.size})")
            # the read lock pins the block: the producer cannot evict or reuse it meanwhile
            in_place = self.zero_copy and max_bytes is None and rec.nbytes >= _POOLED_MIN \
                and m.pinned_bytes + length <= m.size // 2
            if not m.pin(rec.offset, length):
                raise _Evicted
            pinned = True
            magic, gen, n, khash = m.header(rec.offset)
            if magic != BLOCK_MAGIC or gen != rec.gen or n != rec.nbytes \
                    or khash != key_hash(key):
                raise _Evicted
            data = rec.offset + BLOCK_HEADER
            ident = identity(self.scope, key, rec.dtype, rec.shape, rec.nbytes)
            # the seal instead of the bytes: nothing was hashed ("none"), or the reader
            # trusts the producer's hash of a block it uses in place
            sealed = not self.digest.hashes_bytes or (
                in_place and self.config.shm_read_verify == "seal" and bool(rec.seal))
            if sealed:
                self._check_seal(ident, rec)
            if in_place:
                if not sealed:  # one read pass over the mapped bytes, hashed where they lie
                    self._verify(ident, rec, copy_and_hash(
                        0, m.view[data:data + rec.nbytes], None, rec.nbytes, rec.chunk,
                        self.digest, self._exec, self.threads))
                out = _pinned_view(self.maps, m, rec.offset, length)
                handed = True
                return out.view(dtype).reshape(shape)
            out, buf, addr, view = self._destination(rec.nbytes, max_bytes is None)
            parts = copy_and_hash(addr, view, m.addr + data, rec.nbytes, rec.chunk,
                                  self.digest, self._exec if max_bytes is None else None,
                                  self.threads)
            self._verify(ident, rec, parts)
        except BaseException:
            if buf is not None:
                buf.release()
            raise
        finally:
            if not handed:  # the copy is done, or failed: the block may go
                if pinned:
                    m.unpin(rec.offset, length)
                self.maps.release(m)
        if buf is not None:  # the block returns to the pool when vLLM drops the tensor
            import torch

            out = buf.hand_over(torch.uint8, (rec.nbytes,))
        return out.view(dtype).reshape(shape)

    def _check_seal(self, ident: str, rec: Record) -> None:
        if not rec.seal or not Digest.same(
                self._seal(ident, rec.arena, rec.offset, rec.gen, rec.chunk, rec.digest),
                rec.seal):
            raise BadRecord("seal mismatch: not stored under this deployment's secret")

    def _verify(self, ident: str, rec: Record, parts: list[bytes]) -> None:
        if not Digest.same(self.digest.final(ident, rec.chunk, parts), rec.digest):
            raise BadRecord("digest mismatch: damaged, or not stored under this deployment's "
                            "secret")

    def _destination(self, nbytes: int, pooled: bool
                     ) -> tuple[torch.Tensor, PoolBuffer | None, int, memoryview]:
        """Where an item is copied: a block of the warm pool, else a fresh allocation."""
        import torch

        buf = None
        if pooled and nbytes >= _POOLED_MIN:
            pool = self._destination_pool()
            buf = pool.try_allocate(nbytes) if pool is not None else None
        out = buf.as_tensor(torch.uint8, (nbytes,)) if buf is not None else \
            torch.empty(nbytes, dtype=torch.uint8)
        return out, buf, out.data_ptr(), memoryview(out.numpy())

    def _destination_pool(self) -> MemoryPool | None:
        """The consumer's pre-faulted pool (made on first use; 0 bytes: none)."""
        size = self.config.shm_consumer_pool_bytes
        if self._dest is not None or not size or self.placement.role != "worker":
            return self._dest
        with self._dest_lock:
            if self._dest is None:
                from ec_connectors.transports.memory import MemoryPool

                pool = MemoryPool(size, "cpu")
                _prefault(pool.storage)
                self._dest = pool
        return self._dest

    # -- index & housekeeping ----------------------------------------------------------------
    def exists(self, item_id: str) -> bool:
        return self.dir.has_record(item_key(item_id))

    def list_keys(self) -> Iterable[str]:
        return self.dir.item_keys()

    def watch_keys(self) -> DirWatch | None:
        try:
            return DirWatch(self.dir.path, key_of)
        except (ImportError, OSError) as exc:
            logger.info("EPD: no inotify on %s (%s); the availability index scans it",
                        self.dir.path, exc)
            return None

    def delete(self, item_id: str) -> bool:
        key = item_key(item_id)
        if self.arena is not None and self.arena.holds(key):
            return self.arena.evict_key(key)
        return self.dir.unlink(key + RECORD_SUFFIX)

    def renew(self, item_id: str) -> None:
        if self.arena is not None:
            self.arena.renew(item_key(item_id))

    def save_failed(self, item_id: str, reason: str) -> None:
        self.dir.mark_failed(item_key(item_id), reason)

    def reap(self) -> None:
        self.maps.reap()
        self._housekeep()

    def _housekeep(self) -> None:
        if self.placement.role == "worker" and time.monotonic() - self._swept_at > _SWEEP_S:
            self._swept_at = time.monotonic()
            sweep(self.dir, records=False)

    def health(self) -> dict[str, object]:
        out: dict[str, object] = {"transport": self.name, "ok": True, "dir": self.dir.path,
                                  "verify": self.digest.algo, "keyed": self.digest.keyed,
                                  "mapped_arenas": len(self.maps)}
        if self.arena is not None:
            out.update(arena=self.arena.name, arena_bytes=self.arena.capacity,
                       arena_used_bytes=self.arena.used_bytes, items=len(self.arena))
        if self._dest is not None:
            out.update(pool_bytes=self._dest.capacity, pool_used_bytes=self._dest.used_bytes)
        return out

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        self.maps.close()
        if self._exec is not None:
            self._exec.shutdown(wait=True)
        if self._dest is not None:
            self._dest.close()
        self.dir.close()


class _Pin:
    """Holds a block's read lock and its mapping for a tensor that uses the block in place.

    Lets go of both when the last tensor sharing the block's memory is collected."""

    __slots__ = ("maps", "m", "offset", "length")

    def __init__(self, maps: Mappings, m: Mapping, offset: int, length: int) -> None:
        self.maps, self.m, self.offset, self.length = maps, m, offset, length

    def __del__(self) -> None:
        self.m.unpin(self.offset, self.length)
        self.maps.release(self.m)


def _pinned_view(maps: Mappings, m: Mapping, offset: int, length: int) -> torch.Tensor:
    """A uint8 tensor over the block's payload in `m`, whose storage owns the block's pin.

    Read-only memory (vLLM only reads encoder outputs), no copy; the block is neither evicted
    nor unmapped while any view of it lives (vLLM's encoder cache included)."""
    import torch

    nbytes = length - BLOCK_HEADER
    raw = (ctypes.c_uint8 * nbytes).from_address(m.addr + offset + BLOCK_HEADER)
    raw._epd_pin = _Pin(maps, m, offset, length)  # dies with the last tensor on `raw`
    return torch.frombuffer(raw, dtype=torch.uint8)


def _prefault(storage: torch.Tensor) -> None:
    """Fault in every page of a fresh buffer now.

    Fault every page of a fresh buffer in now (MADV_POPULATE_WRITE, Linux 5.14+; else
    write zeros), so no load pays for it."""
    start, size = storage.data_ptr(), storage.numel()
    aligned = (start + PAGE - 1) // PAGE * PAGE
    length = (start + size - aligned) // PAGE * PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if length <= 0 or libc.madvise(aligned, length, _MADV_POPULATE_WRITE) != 0:
        storage.zero_()
