"""The items a Mooncake TE producer holds in its registered pool: leases (a promise to keep an
item for consumers, yielding under pressure once `lease_min_s` old), pins (pulls reading it),
LRU eviction and backpressure when the pool is full."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ec_connectors.log import get_logger
from ec_connectors.protocol.items import ItemInfo
from ec_connectors.protocol.lru import BoundedLRU
from ec_connectors.transports.memory import MemoryPool, PoolBuffer, PoolExhausted

logger = get_logger(__name__)

_RECENT_EVICTIONS = 4096  # evicted keys remembered, so a pull of one fails fast


@dataclass
class Held:
    info: ItemInfo
    buf: PoolBuffer
    lease_until: float
    promised_at: float  # stored or renewed: a consumer may be about to pull it
    pins: int = 0


class ProducerStore:
    """Items held in the registered pool: leases, pins, LRU. Thread-safe."""

    def __init__(self, pool: MemoryPool, lease_ttl_s: float,
                 lease_min_s: float | None = None) -> None:
        self.pool = pool
        self.lease_ttl_s = lease_ttl_s
        # a full pool takes back the lease of the item promised longest ago once it was
        # promised this long ago (consumers pull within seconds of a promise)
        self.lease_min_s = lease_ttl_s if lease_min_s is None else min(lease_min_s,
                                                                       lease_ttl_s)
        self.leases_yielded = 0
        self._items: OrderedDict[str, Held] = OrderedDict()  # LRU first
        self._lock = threading.Lock()
        self.recently_evicted: BoundedLRU[str, None] = BoundedLRU(_RECENT_EVICTIONS)
        self.recently_failed: BoundedLRU[str, None] = BoundedLRU(_RECENT_EVICTIONS)  # saves
        # saves queued in this process, not stored yet: pulls are told to wait ("pending")
        self.expected: BoundedLRU[str, None] = BoundedLRU(_RECENT_EVICTIONS)

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
            held.promised_at = time.monotonic()
            held.lease_until = held.promised_at + self.lease_ttl_s
            self._items.move_to_end(key)
            return True

    def expect(self, key: str) -> None:
        with self._lock:
            if key not in self._items:
                self.expected[key] = None

    def add(self, info: ItemInfo, buf: PoolBuffer) -> None:
        with self._lock:
            now = time.monotonic()
            self._items[info.key] = Held(info, buf, now + self.lease_ttl_s, now)
            self.recently_evicted.pop(info.key, None)
            self.recently_failed.pop(info.key, None)
            self.expected.pop(info.key, None)

    def failed(self, key: str) -> None:
        with self._lock:
            self.expected.pop(key, None)
            if key in self._items:
                return  # stored before: still served
            self.recently_failed[key] = None

    def absent(self, key: str) -> str:
        """Why a key is not held: failed | evicted | pending (its save is queued here) |
        unknown (never here, or gone long ago)."""
        with self._lock:
            return ("failed" if key in self.recently_failed else
                    "evicted" if key in self.recently_evicted else
                    "pending" if key in self.expected else "unknown")

    def evict_one(self) -> Held | None:
        """Release the least recently used unleased, unpinned item, else the unpinned one
        promised longest ago if that was `lease_min_s` ago or more (its lease yields to a
        new item, whose consumer is about to pull); None if there is none."""
        now = time.monotonic()
        with self._lock:
            victim = next((h for h in self._items.values()
                           if h.pins == 0 and h.lease_until <= now), None)
            if victim is None:
                victim = min((h for h in self._items.values() if h.pins == 0),
                             key=lambda h: h.promised_at, default=None)
                if victim is None or now - victim.promised_at < self.lease_min_s:
                    return None
                self.leases_yielded += 1
                logger.info("EPD: producer pool full: item %s gives up the rest of its lease "
                            "(promised %.1f s ago) to a new item; raise memory_pool_bytes if "
                            "consumers miss items", victim.info.key, now - victim.promised_at)
            del self._items[victim.info.key]
            self.recently_evicted[victim.info.key] = None
        victim.buf.release()
        return victim

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
