"""The items a peer-pull producer holds in its registered pool.

The items a peer-pull producer holds in its registered pool: their buffers and pins (pulls
reading them), under the lease book (transports/leases.py: a promise to keep an item for
consumers, yielding under pressure once `lease_min_s` old; eviction order; backpressure when
the pool is full), and what it remembers of items it no longer holds. A large item may be
held where it lies instead (`HeldInPlace`), its pool block only counting its bytes."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ec_connectors.protocol.stored import ItemInfo
from ec_connectors.transports.base import tensor_bytes
from ec_connectors.transports.leases import LeaseBook, StoreNames
from ec_connectors.transports.memory import MemoryPool, PoolBuffer, PoolExhausted, typed_view
from epd_common.lru import BoundedLRU

_RECENT_EVICTIONS = 4096  # evicted keys remembered, so a pull of one fails fast


class HeldInPlace:
    """An item held where it lies (the tensor a put was given), not copied into the pool.

    Stands where a pool block holds an item (`PinnedItem.buf`, the same calls): `budget`, a
    block of the pool never written, counts its bytes against the pool (eviction and
    backpressure as for copied items); `release` frees the block and drops the tensor, once.
    Only for a host tensor that is the whole of its memory (a view into a larger allocation
    would keep all of it alive, uncounted)."""

    __slots__ = ("budget", "tensor", "addr", "nbytes")

    def __init__(self, budget: PoolBuffer, tensor: torch.Tensor) -> None:
        self.budget, self.tensor = budget, tensor
        self.addr, self.nbytes = tensor.data_ptr(), budget.nbytes

    def as_tensor(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int],
                  offset: int = 0) -> torch.Tensor:
        """The item's bytes from `offset` as `dtype` and `shape` (no copy)."""
        return typed_view(self.tensor.reshape(-1).view(torch.uint8), dtype, shape, offset)

    def as_bytes(self) -> memoryview:
        """The item's bytes (no copy)."""
        return tensor_bytes(self.tensor)

    @property
    def released(self) -> bool:
        """Whether `release` ran."""
        return self.budget.released

    def release(self) -> None:
        """Free its pool block and let the tensor go, once."""
        self.budget.release()  # raises on a second release, before anything is undone
        self.unhold()
        self.tensor = None

    def unhold(self) -> None:
        """Undo what holds the memory beside the tensor (a data path's registration)."""

    @staticmethod
    def fits(tensor: torch.Tensor, nbytes: int) -> bool:
        """Whether a put's host tensor of `nbytes` may be held where it lies."""
        return tensor.device.type == "cpu" and tensor.is_contiguous() \
            and tensor.untyped_storage().nbytes() <= nbytes + nbytes // 8


@dataclass
class PinnedItem:
    """An item the store holds: its info, what holds its bytes, the pulls reading it."""

    info: ItemInfo
    buf: PoolBuffer | HeldInPlace
    pins: int = 0

    @property
    def key(self) -> str:
        """The item's key."""
        return self.info.key


_NAMES = StoreNames("producer pool", "memory_pool_bytes", "lease_ttl_s", PoolExhausted)


class ProducerStore:
    """Items held in the registered pool: buffers and pins, under the lease book. Thread-safe."""

    def __init__(self, pool: MemoryPool, lease_ttl_s: float,
                 lease_min_s: float | None = None) -> None:
        self.pool = pool
        self._items: LeaseBook[str, PinnedItem] = LeaseBook(_NAMES, lease_ttl_s, lease_min_s)
        self._lock = threading.Lock()
        self.recently_evicted: BoundedLRU[str, None] = BoundedLRU(_RECENT_EVICTIONS)
        self.recently_failed: BoundedLRU[str, None] = BoundedLRU(_RECENT_EVICTIONS)  # saves
        # saves queued in this process, not stored yet: pulls are told to wait ("pending")
        self.expected: BoundedLRU[str, None] = BoundedLRU(_RECENT_EVICTIONS)

    @property
    def leases_yielded(self) -> int:
        """How many leases yielded to pressure so far."""
        return self._items.leases_yielded

    def get(self, key: str) -> PinnedItem | None:
        """The held item of `key`, or None."""
        with self._lock:
            return self._items.get(key)

    def pin(self, key: str) -> PinnedItem | None:
        """The held item of `key` pinned (never evicted until unpinned), or None."""
        with self._lock:
            held = self._items.get(key)
            if held is not None:
                held.pins += 1
            return held

    def unpin(self, held: PinnedItem) -> None:
        """Drop one pin (a waiting save may now evict the item)."""
        with self._lock:
            held.pins -= 1
        self.pool.notify()

    def renew(self, key: str) -> bool:
        """Renew `key`'s lease (promised again); False when not held."""
        with self._lock:
            return self._items.renew(key)

    def expect(self, key: str) -> None:
        """Pulls of `key` are answered `pending` until it is stored or failed."""
        with self._lock:
            if key not in self._items:
                self.expected[key] = None

    def add(self, info: ItemInfo, buf: PoolBuffer) -> ItemInfo:
        """Hold a new item; returns what is held.

        Two saves of one key racing (both found it absent): the first copy stays (a pull may be
        reading it), renewed; `buf` is freed."""
        with self._lock:
            held = self._items.get(info.key)
            if held is None:
                self._items.add(info.key, PinnedItem(info, buf))
            else:
                self._items.renew(info.key)
            self.recently_evicted.pop(info.key, None)
            self.recently_failed.pop(info.key, None)
            self.expected.pop(info.key, None)
        if held is None:
            return info
        buf.release()
        return held.info

    def failed(self, key: str) -> None:
        """Pulls of `key` are answered `failed` (its save failed), unless it is held."""
        with self._lock:
            self.expected.pop(key, None)
            if key in self._items:
                return  # stored before: still served
            self.recently_failed[key] = None

    def absent(self, key: str) -> str:
        """Why a key is not held.

        Why a key is not held: failed | evicted | pending (its save is queued here) |
        unknown (never here, or gone long ago)."""
        with self._lock:
            return ("failed" if key in self.recently_failed else
                    "evicted" if key in self.recently_evicted else
                    "pending" if key in self.expected else "unknown")

    def evict_one(self) -> PinnedItem | None:
        """Release the lease book's victim among the unpinned items; None if there is none."""
        with self._lock:
            victim = self._items.victim(_unpinned)
            if victim is None:
                return None
            self.recently_evicted[victim.key] = None
        victim.buf.release()
        return victim

    def reserve(self, nbytes: int, deadline: float) -> tuple[PoolBuffer, list[PinnedItem]]:
        """Get a pool block for a new item, evicting or waiting as needed.

        A block for a new item: free space, else evict, else wait for leases to lapse or
        pins to drop (backpressure) until `deadline`. Raises PoolExhausted."""
        evicted: list[PinnedItem] = []
        while True:
            buf = self.pool.try_allocate(nbytes)
            if buf is not None:
                return buf, evicted
            victim = self.evict_one()
            if victim is not None:
                evicted.append(victim)
                continue
            with self._lock:  # an unpin or a free wakes the wait (pool.notify)
                wait = self._items.wait_s(deadline, poll_s=0.25, pinned_poll_s=0.25)
                if wait is None:
                    raise self._items.full_error(self.pool.used_bytes, self.pool.capacity)
            self.pool.wait_for_change(wait)

    def catalog(self) -> tuple[list[str], list[int]]:
        """(keys, sizes) of everything held: what a snapshot announces."""
        with self._lock:
            return list(self._items.keys()), [h.info.nbytes for h in self._items.values()]

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        """Release every held item (the transport is closing)."""
        with self._lock:
            items = self._items.clear()
        for held in items:
            if not held.buf.released:
                held.buf.release()


def _unpinned(held: PinnedItem) -> bool:
    """The lease book's pin test: no pull is reading it (the buffer is released after)."""
    return held.pins == 0
