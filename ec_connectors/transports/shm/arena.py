"""Arenas: producers' shared memory blocks and consumers' mappings of them.

Arenas: a producer's pre-faulted shared memory and its blocks (held under the lease book,
transports/leases.py: leases, eviction order, backpressure), and a consumer's read-only
mappings of producers' arenas.

Why an arena: a fresh tmpfs page costs a page fault on first write (and another on first
read in every process that maps it); 125 MiB is 32,000 of them, several times the copy
itself. An arena is reserved (posix_fallocate: no SIGBUS on a full tmpfs later) and mapped
with MAP_POPULATE once; blocks are reused, so a put is one memcpy into warm pages.

Blocks: `[header 64 B][payload]` at 4 KiB-aligned offsets. The header holds a generation:
a consumer checks it against the record under a read lock (an OFD byte-range lock on the
block: per open file, released if the reader dies), the producer takes a write lock before
it evicts a block and bumps the generation. So a block being read is never reused (it is
pinned), and a reader of a block evicted before it got there sees another generation (a
miss, never someone else's bytes). Liveness: the producer holds flock(LOCK_EX) on its
arena for its whole life; an arena whose lock anyone can take belongs to a dead process and
is removed with its records (`sweep`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass

import numpy as np

from ec_connectors.log import get_logger
from ec_connectors.transports.leases import LeaseBook, StoreNames
from ec_connectors.transports.memory import Allocator
from ec_connectors.transports.shm.layout import (
    ARENA_RE,
    FAILED_SUFFIX,
    RECORD_SUFFIX,
    TMP_PREFIX,
    BadRecord,
    ShmDir,
    ShmError,
    arena_name,
    stale,
)

logger = get_logger(__name__)

PAGE = 4096
ARENA_MAGIC = b"EPDSHMA1"
BLOCK_MAGIC = b"EPDSHMB1"
BLOCK_HEADER = 64  # magic, generation, payload bytes, key hash (16 B), padding
_BLOCK = struct.Struct("<8sQQ16s24x")
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86-64 / arm64 (l_pid 0: OFD)
_MAX_ARENA = 1 << 41
_STALE_S = 600.0  # temporary files and tombstones older than this are removed


class ArenaFull(MemoryError):
    """No room in the arena before the put's deadline (every block leased or being read)."""


def key_hash(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def range_lock(fd: int, kind: int, start: int, length: int) -> bool:
    """Take, or drop, an OFD byte-range lock without waiting.

    An OFD byte-range lock (F_RDLCK / F_WRLCK / F_UNLCK) without waiting: False when
    another open file holds a conflicting one."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


@dataclass
class ArenaBlock:
    key: str
    offset: int  # block start in the arena file
    nbytes: int  # payload
    gen: int
    current: bool = True  # False: a newer copy of the key replaced it (evict first)


_NAMES = StoreNames("shared-memory arena", "shm_arena_bytes", "shm_lease_ttl_s", ArenaFull)


class Arena:
    """A producer's arena: created, reserved and mapped at start; removed at close."""

    def __init__(self, shm_dir: ShmDir, capacity: int, lease_ttl_s: float,
                 lease_min_s: float | None = None) -> None:
        self.dir = shm_dir
        self.leases: LeaseBook[int, ArenaBlock] = LeaseBook(_NAMES, lease_ttl_s, lease_min_s)
        self.name = arena_name()
        self.size = PAGE + (capacity + PAGE - 1) // PAGE * PAGE
        tmp = TMP_PREFIX + self.name
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=shm_dir.fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # alive while we hold it
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError as exc:
                raise ShmError(f"cannot reserve {self.size} bytes of shared memory in "
                               f"{shm_dir.path}: {exc.strerror}; lower shm_arena_bytes or "
                               "give the tmpfs more room") from None
            self._mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self._mm[:PAGE] = ARENA_MAGIC + struct.pack("<QQ", self.size, os.getpid()) \
                + bytes(PAGE - 24)
            os.rename(tmp, self.name, src_dir_fd=shm_dir.fd, dst_dir_fd=shm_dir.fd)
        except BaseException:
            os.close(fd)
            shm_dir.unlink(tmp)
            raise
        self.fd = fd
        self._np = np.frombuffer(self._mm, dtype=np.uint8)
        self.addr = self._np.ctypes.data
        self.view = memoryview(self._np)
        self.allocator = Allocator(self.size - PAGE, PAGE)
        self._by_key: dict[str, int] = {}
        self._lock = threading.Lock()
        self._gen = int.from_bytes(os.urandom(4), "little") << 20  # unique across restarts
        self.evictions = 0
        self.evicted_bytes = 0

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def leases_yielded(self) -> int:
        return self.leases.leases_yielded

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    def __len__(self) -> int:
        return len(self._by_key)

    # -- blocks ------------------------------------------------------------------------------
    def reserve(self, nbytes: int, deadline: float) -> tuple[int, int]:
        """Reserve a block for a new item, evicting or waiting as needed.

        (offset, generation) of a new block for `nbytes` of payload: free room, else the
        lease book's victim nobody reads is evicted, else wait (backpressure) until
        `deadline`. Raises ArenaFull."""
        need = BLOCK_HEADER + nbytes
        if need > self.capacity:
            raise ArenaFull(f"an item of {nbytes} bytes exceeds the whole arena "
                            f"({self.capacity} bytes); raise shm_arena_bytes")
        while True:
            with self._lock:
                off = self.allocator.alloc(need)
                if off is not None:
                    self._gen += 1
                    return PAGE + off, self._gen
                if self.leases.victim(self._evict_locked) is not None:
                    continue
                # readers hold range locks, and nothing tells us when they let go: poll
                wait = self.leases.wait_s(deadline, poll_s=0.05, pinned_poll_s=0.001)
                if wait is None:
                    raise self.leases.full_error(self.used_bytes, self.capacity)
            time.sleep(wait)

    def free(self, offset: int) -> None:
        """Give back a block that was reserved but never committed (a failed put)."""
        with self._lock:
            self.allocator.free(offset - PAGE)

    def commit(self, key: str, offset: int, gen: int, nbytes: int) -> None:
        """The payload is written: stamp the header and hold the block under a lease.

        An older copy of the key becomes the first to evict."""
        _BLOCK.pack_into(self._mm, offset, BLOCK_MAGIC, gen, nbytes, key_hash(key))
        with self._lock:
            old = self._by_key.get(key)
            old_held = None if old is None else self.leases.get(old)
            if old_held is not None:
                old_held.current = False
                self.leases.drop_lease(old)
            self.leases.add(offset, ArenaBlock(key, offset, nbytes, gen))
            self._by_key[key] = offset

    def renew(self, key: str) -> bool:
        with self._lock:
            off = self._by_key.get(key)
            return off is not None and self.leases.renew(off)

    def holds(self, key: str) -> bool:
        return key in self._by_key

    def evict_key(self, key: str) -> bool:
        """Evict `key`'s block now (delete), unless someone is reading it."""
        with self._lock:
            off = self._by_key.get(key)
            held = None if off is None else self.leases.get(off)
            if held is None or not self._evict_locked(held):
                return False
            self.leases.pop(off)
            return True

    def _evict_locked(self, held: ArenaBlock) -> bool:
        """Free a held block unless a consumer is reading it.

        Free `held`'s block unless a consumer is reading it (the lease book's pin test;
        the book forgets the block when this says True)."""
        length = BLOCK_HEADER + held.nbytes
        if not range_lock(self.fd, fcntl.F_WRLCK, held.offset, length):
            return False  # a consumer is reading it: pinned
        try:
            if held.current:
                self.dir.unlink_record_if(held.key, self.name, held.gen)
                del self._by_key[held.key]
            _BLOCK.pack_into(self._mm, held.offset, bytes(8), 0, 0, bytes(16))
        finally:
            range_lock(self.fd, fcntl.F_UNLCK, held.offset, length)
        self.allocator.free(held.offset - PAGE)
        self.evictions += 1
        self.evicted_bytes += held.nbytes
        return True

    def close(self) -> None:
        """Remove this arena and the records that name it (its items go with it)."""
        with self._lock:
            for held in self.leases.clear():
                if held.current:
                    self.dir.unlink_record_if(held.key, self.name, held.gen)
            self._by_key.clear()
        self.dir.unlink(self.name)
        self.view.release()
        del self._np
        try:
            self._mm.close()
        except BufferError:  # a copy still under way holds a view: the GC unmaps it
            logger.warning("EPD: shm arena %s closed while in use", self.name)
        os.close(self.fd)


class Mapping:
    """A consumer's read-only mapping of one arena, and the read locks its readers hold.

    One mapping is shared by its readers; it holds read locks on the blocks they use (pins:
    the producer cannot evict a pinned block).
    Its descriptor stays open while it is mapped: the locks are on it, per block, counted."""

    def __init__(self, shm_dir: ShmDir, name: str, populate: bool) -> None:
        fd = shm_dir.open_arena(name)
        try:
            st = os.fstat(fd)
            if not PAGE <= st.st_size <= _MAX_ARENA:
                raise BadRecord(f"arena of {st.st_size} bytes")
            if os.pread(fd, 8, 0) != ARENA_MAGIC:
                raise BadRecord("not an arena of this transport")
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            self.mm = mmap.mmap(fd, st.st_size, flags=flags, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.name, self.size, self.ino = name, st.st_size, st.st_ino
        self._np = np.frombuffer(self.mm, dtype=np.uint8)
        self.addr = self._np.ctypes.data
        self.view = memoryview(self._np)
        self.users = 0  # readers now, and tensors that use its blocks in place
        self.closing = False  # the transport closed: unmap when the last user goes
        self.pinned_bytes = 0
        self._pins: dict[int, int] = {}  # block offset -> readers holding it
        # reentrant: a tensor's finalizer (unpin) may run on this thread inside pin
        self._lock = threading.RLock()

    def header(self, offset: int) -> tuple[bytes, int, int, bytes]:
        return _BLOCK.unpack_from(self.mm, offset)

    def pin(self, offset: int, length: int) -> bool:
        """Hold a read lock on the block (False: the producer is evicting it)."""
        with self._lock:
            held = self._pins.get(offset, 0)
            if not held and not range_lock(self.fd, fcntl.F_RDLCK, offset, length):
                return False
            self._pins[offset] = held + 1
            if not held:
                self.pinned_bytes += length
            return True

    def unpin(self, offset: int, length: int) -> None:
        with self._lock:
            held = self._pins.pop(offset) - 1
            if held:
                self._pins[offset] = held
                return
            self.pinned_bytes -= length
            if self.fd >= 0:
                range_lock(self.fd, fcntl.F_UNLCK, offset, length)

    def close(self) -> bool:
        self.view.release()
        del self._np
        try:
            self.mm.close()
        except BufferError:
            return False
        with self._lock:
            os.close(self.fd)
            self.fd = -1
        return True


class Mappings:
    """A consumer's read-only mappings of producers' arenas.

    Made on first use, closed once their arena is gone (its memory is freed only when nobody
    maps it). A mapping is never closed while a reader or a tensor uses it (`users`): a
    producer that died leaves its blocks readable until the last tensor on them goes."""

    def __init__(self, shm_dir: ShmDir, populate: bool) -> None:
        self.dir = shm_dir
        self.populate = populate
        self._maps: dict[str, Mapping] = {}
        self._lock = threading.RLock()  # reentrant: see Mapping._lock

    def acquire(self, name: str) -> Mapping:
        with self._lock:
            m = self._maps.get(name)
            if m is None:
                m = self._maps[name] = Mapping(self.dir, name, self.populate)
            m.users += 1
            return m

    def release(self, m: Mapping) -> None:
        with self._lock:
            m.users -= 1
            last = m.closing and m.users == 0
        if last:
            m.close()

    def reap(self) -> None:
        """Unmap arenas whose file is gone or replaced and that nobody uses now."""
        with self._lock:
            names = [n for n, m in self._maps.items() if m.users == 0]
        for name in names:
            try:
                gone = os.stat(name, dir_fd=self.dir.fd, follow_symlinks=False).st_ino \
                    != self._maps[name].ino
            except FileNotFoundError:
                gone = True
            except KeyError:
                continue
            if gone:
                with self._lock:
                    m = self._maps.get(name)
                    if m is None or m.users:
                        continue
                    del self._maps[name]
                m.close()

    def __len__(self) -> int:
        return len(self._maps)

    def close(self) -> None:
        """Unmap every arena nobody uses; the others when their last user goes."""
        with self._lock:
            maps, self._maps = list(self._maps.values()), {}
            idle = [m for m in maps if m.users == 0]
            for m in maps:
                m.closing = True
        for m in idle:
            m.close()


def sweep(shm_dir: ShmDir, records: bool = True) -> int:
    """Remove dead producers' arenas and stale files.

    Remove arenas of dead producers (their flock is free), the records that name an arena
    that is gone (`records`), and old temporary files and tombstones. Returns how many
    arenas were removed."""
    dead = 0
    live: set[str] = set()
    for name, mtime in list(shm_dir.names()):
        if name.startswith(TMP_PREFIX) or name.endswith(FAILED_SUFFIX):
            if stale(mtime, _STALE_S) and not _locked(shm_dir, name):
                shm_dir.unlink(name)
        elif ARENA_RE.fullmatch(name):
            if _locked(shm_dir, name):
                live.add(name)
            else:
                shm_dir.unlink(name)
                dead += 1
                logger.info("EPD: removed shm arena %s of a process that is gone", name)
    if records or dead:
        for key in shm_dir.item_keys():
            with contextlib.suppress(FileNotFoundError):
                try:
                    arena = shm_dir.read_record(key).arena
                    # an arena made since the listing above is alive too
                    if arena in live or (ARENA_RE.fullmatch(arena) and _locked(shm_dir, arena)):
                        continue
                except BadRecord:
                    pass
                shm_dir.unlink(key + RECORD_SUFFIX)
    return dead


def _locked(shm_dir: ShmDir, name: str) -> bool:
    """Whether a live process holds `name`'s flock (an arena's owner)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=shm_dir.fd)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # drops the lock we may have taken
    return False


__all__ = ["Arena", "ArenaFull", "Mapping", "Mappings", "key_hash", "range_lock", "sweep"]
