"""Copy an item and hash it in one pass, on several threads.

One pass over an item: copy it chunk by chunk and hash each chunk right after copying it,
while it is still in this core's cache, on several threads at once (torch-free).

Why chunked: a copy then a hash of 125 MiB reads the bytes from memory twice; hashing a
chunk that was just written reads it from cache, so the hash rides on the copy's memory
traffic. Why threads: `ctypes.memmove`, xxhash and blake3 all release the GIL, so two
threads copy and hash two halves at once (one copies while the other hashes).

The digest of an item is a hash over its identity (namespace, key, dtype, shape, size), its
chunk size, and the ordered digests of its chunks: positions and identity are bound, so bytes
of one item cannot pass for another's, nor chunks be reordered. Keyed under the deployment
secret when there is one: blake3's keyed mode (a MAC) or a secret-seeded xxh3 (a checksum
nobody without the secret can predict; integrity, not a MAC: the directory's 0700 is what
keeps other users out, docs/transports.md).
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import os
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

import blake3
import xxhash

ALGOS = ("xxh3", "blake3", "none")


def usable_cores() -> int:
    """How many cores this process may run on.

    A server pinned to one core copies on one thread: a second would only take turns."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def helper_threads(wanted: int, name: str) -> tuple[ThreadPoolExecutor | None, int]:
    """(pool, threads) for copy_and_hash: up to `wanted` threads, this one and the pool's.

    No more than the cores this process may run on; no pool for one thread."""
    threads = max(1, min(wanted, usable_cores()))
    pool = ThreadPoolExecutor(threads - 1, thread_name_prefix=name) if threads > 1 else None
    return pool, threads


def derive_key(secret: bytes | None) -> bytes | None:
    """Derive the shm transport's own key from the deployment secret.

    The shm transport's own key, derived from the deployment secret (as protocol.secret_file
    derives its keys: keyed blake2b with a purpose)."""
    if secret is None:
        return None
    return hashlib.blake2b(b"shm", key=secret[:64], digest_size=32,
                           person=b"epd-shm-v1").digest()


class Digest:
    """Chunk digests and their combination for one algorithm and key.

    "none" hashes no bytes (`chunk` is None): its digests bind an item's identity and
    block only, MACed with keyed blake3 under a secret (a few dozen bytes, not the item)."""

    def __init__(self, algo: str, key: bytes | None) -> None:
        if algo not in ALGOS:
            raise ValueError(f"unknown digest {algo!r} (known: {', '.join(ALGOS)})")
        self.algo = algo
        self.keyed = key is not None
        self._final: Callable[[bytes], str]
        self.chunk: Callable[[memoryview], bytes] | None
        if algo == "xxh3":
            seed = int.from_bytes(key[:8], "little") if key else 0
            self.chunk = lambda view: xxhash.xxh3_64_digest(view, seed=seed)
            self._final = lambda data: xxhash.xxh3_128_hexdigest(data, seed=seed)
        else:  # blake3, keyed under a secret; "none" uses it for its final digest only
            b3 = blake3.blake3 if key is None else (lambda data: blake3.blake3(data, key=key))
            self.chunk = (lambda view: b3(view).digest()) if algo == "blake3" else None
            self._final = lambda data: b3(data).hexdigest()

    @property
    def hashes_bytes(self) -> bool:
        return self.chunk is not None

    def final(self, identity: str, chunk: int, parts: list[bytes]) -> str:
        return self._final(b"%s\0%d\0%s" % (identity.encode(), chunk, b"".join(parts)))

    @staticmethod
    def same(a: str, b: str) -> bool:
        return hmac.compare_digest(a, b)


def copy_and_hash(dst_addr: int, dst: memoryview, src_addr: int | None, nbytes: int,
                  chunk: int, digest: Digest, pool: Executor | None = None,
                  threads: int = 1) -> list[bytes]:
    """Copy bytes and hash each chunk from the destination.

    Copy `nbytes` from `src_addr` to `dst_addr` (`dst`: a byte view of the destination)
    and return the digests of its chunks, hashed from the destination. `src_addr` None:
    hash `dst` only (the bytes are already there). Contiguous runs of chunks go to
    `threads` threads (this one and `pool`'s). A digest that hashes no bytes ("none"):
    the copy alone, and no chunk digests."""
    count = -(-nbytes // chunk)
    hash_chunk = digest.chunk
    parts: list[bytes] = [b""] * count if hash_chunk is not None else []

    def run(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            off = i * chunk
            n = min(chunk, nbytes - off)
            if src_addr is not None:
                ctypes.memmove(dst_addr + off, src_addr + off, n)
            if hash_chunk is not None:
                parts[i] = hash_chunk(dst[off:off + n])

    t = max(1, min(threads, count)) if pool is not None else 1
    bounds = [count * j // t for j in range(t + 1)]
    futures = [pool.submit(run, bounds[j], bounds[j + 1]) for j in range(1, t)] \
        if pool is not None else []
    try:
        run(bounds[0], bounds[1])
    finally:
        for f in futures:  # every thread is done with dst before anyone may free it
            f.exception()
    for f in futures:
        f.result()
    return parts


# -- the peer transports' item checksum (mooncake, nixl) -----------------------------------------
# Not keyed (their side channel is: CURVE), bound to no identity (the pull's reply names the
# item): xxh3 of every PEER_CHUNK bytes, combined. Chunks, not one running xxh3, so that two
# threads hash an item at once while it is copied into the producer's pool (a running hash is
# one thread's: on two cores it added a second full pass to every put).
PEER_CHUNK = 1 << 20
_PEER = Digest("xxh3", None)


def peer_checksum(data: memoryview, pool: Executor | None = None, threads: int = 1) -> str:
    """The peer checksum of bytes already in place."""
    return _PEER.final("", PEER_CHUNK, copy_and_hash(0, data, None, len(data), PEER_CHUNK,
                                                     _PEER, pool, threads))


def copy_with_peer_checksum(dst_addr: int, dst: memoryview, src_addr: int, nbytes: int,
                            pool: Executor | None = None, threads: int = 1) -> str:
    """Copy `nbytes` into `dst` (as copy_and_hash) and return their peer checksum."""
    return _PEER.final("", PEER_CHUNK, copy_and_hash(dst_addr, dst, src_addr, nbytes,
                                                     PEER_CHUNK, _PEER, pool, threads))


class PeerChecksum:
    """The peer checksum of an item whose bytes come in pieces, in order.

    Every piece but the last must be a whole number of PEER_CHUNKs."""

    def __init__(self) -> None:
        self.hashed = 0
        self._parts: list[bytes] = []

    def add(self, piece: memoryview, pool: Executor | None = None, threads: int = 1) -> None:
        """Hash the next piece, on `threads` threads (this one and `pool`'s) when it is large."""
        self._parts += copy_and_hash(0, piece, None, len(piece), PEER_CHUNK, _PEER, pool,
                                     threads)
        self.hashed += len(piece)

    def hexdigest(self) -> str:
        return _PEER.final("", PEER_CHUNK, self._parts)
