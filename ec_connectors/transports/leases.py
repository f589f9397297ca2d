"""The lease book: which items a producer's store keeps, and which it drops.

The lease book: how a producer's store keeps the items it promised consumers, and which one
makes room when it is full. One book for every store that holds items for consumers (the shm
arena's blocks, the Mooncake TE producer pool's items); the store keeps its memory and its pins,
the book the policy (torch-free, no I/O).

A holding is promised when it is stored and again when a consumer is promised it (`renew`); it
stays leased for `lease_ttl_s` from its last promise. When room is needed the victim is:
1. an unleased holding (its lease lapsed, or a newer copy replaced it: `drop_lease`), the one
   promised longest ago first;
2. else the leased holding promised longest ago, once that was `lease_min_s` ago or more: its
   lease yields (consumers load an item within seconds of its promise, and the new item's
   consumer is about to), logged and counted in `leases_yielded`;
3. else none: the caller waits (`wait_s`: backpressure) until one could be, then tries again,
   until its deadline; then it fails with `full_error`.
A holding the caller's pin test refuses (a consumer is reading it) is never a victim.

Costs: holdings are kept in promise order (an OrderedDict; a promise moves one to the end).
Every lease lasts `lease_ttl_s`, so that is also the order leases lapse in: unleased holdings
are a prefix, the first leased one is the oldest promise. Every operation is O(1); a victim
search is O(holdings examined): the pinned ones it skips, plus one.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ec_connectors.log import get_logger

logger = get_logger(__name__)

_FLOOR_S = 0.001  # the shortest wait between two tries


class Holding(Protocol):
    """What the book needs of a store's holding: the item key, for the log."""

    @property
    def key(self) -> str: ...


K = TypeVar("K", bound=Hashable)
V = TypeVar("V", bound=Holding)


@dataclass(frozen=True)
class StoreNames:
    """How a store's operator sees it: in the log line and the error."""

    what: str  # "shared-memory arena", "producer pool"
    size_knob: str  # the config key of its byte budget
    ttl_knob: str  # the config key of `lease_ttl_s`
    error: type[Exception]  # what a save that found no room raises


class _Entry(Generic[V]):
    __slots__ = ("value", "promised_at", "lease_until")

    def __init__(self, value: V, now: float, lease_until: float) -> None:
        self.value = value
        self.promised_at = now  # stored or renewed: a consumer may be about to load it
        self.lease_until = lease_until


class LeaseBook(Generic[K, V]):
    """Holdings by the store's own key (a block offset, an item key), in promise order.

    Not thread-safe: the store calls it under its own lock."""

    def __init__(self, names: StoreNames, lease_ttl_s: float,
                 lease_min_s: float | None = None) -> None:
        self.names = names
        self.lease_ttl_s = lease_ttl_s
        # under pressure a lease yields once its item was promised this long ago
        self.lease_min_s = lease_ttl_s if lease_min_s is None else min(lease_min_s,
                                                                       lease_ttl_s)
        self.leases_yielded = 0
        self._held: OrderedDict[K, _Entry[V]] = OrderedDict()  # oldest promise first
        self._yieldable_at = 0.0  # set by a victim search that found none: see wait_s
        self._pinned_seen = False

    # -- holdings ----------------------------------------------------------------------------
    def add(self, key: K, value: V) -> None:
        """Hold `value` under a lease from now (replacing what `key` held)."""
        self._held.pop(key, None)
        now = time.monotonic()
        self._held[key] = _Entry(value, now, now + self.lease_ttl_s)

    def renew(self, key: K) -> bool:
        """A consumer is promised `key` again: its lease starts over. False if not held."""
        entry = self._held.get(key)
        if entry is None:
            return False
        entry.promised_at = time.monotonic()
        entry.lease_until = entry.promised_at + self.lease_ttl_s
        self._held.move_to_end(key)
        return True

    def drop_lease(self, key: K) -> None:
        """`key` is unleased from now, the first to go (a newer copy replaced it)."""
        entry = self._held.get(key)
        if entry is not None:
            entry.lease_until = 0.0
            self._held.move_to_end(key, last=False)

    def get(self, key: K) -> V | None:
        entry = self._held.get(key)
        return None if entry is None else entry.value

    def pop(self, key: K) -> V | None:
        entry = self._held.pop(key, None)
        return None if entry is None else entry.value

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def keys(self) -> Iterator[K]:
        return iter(self._held)

    def values(self) -> Iterator[V]:
        return (e.value for e in self._held.values())

    def clear(self) -> list[V]:
        """Forget every holding; returns them (the store frees their memory)."""
        values = [e.value for e in self._held.values()]
        self._held.clear()
        return values

    # -- making room ---------------------------------------------------------------------------
    def victim(self, take: Callable[[V], bool]) -> V | None:
        """The next holding to give up its memory, already out of the book, or None.

        `take` is the store's pin test: it returns False for a holding in use (pinned: skipped)
        and True once the store has let go of it (the arena frees the block under its write lock
        there; the pool store only checks its pin counter and releases the buffer after)."""
        now = time.monotonic()
        cutoff = now - self.lease_min_s
        self._pinned_seen = False
        for key, entry in self._held.items():
            leased = entry.lease_until > now
            if leased and entry.promised_at > cutoff:  # so is every holding after it
                self._yieldable_at = entry.promised_at + self.lease_min_s
                return None
            if take(entry.value):
                del self._held[key]
                if leased:
                    self._yielded(entry, now)
                return entry.value
            self._pinned_seen = True
        self._yieldable_at = float("inf")  # everything is pinned: only a pin can change that
        return None

    def _yielded(self, entry: _Entry[V], now: float) -> None:
        self.leases_yielded += 1
        logger.info("EPD: %s full: item %s gives up the rest of its lease (promised %.1f s "
                    "ago) to a new item; raise %s if consumers miss items", self.names.what,
                    entry.value.key, now - entry.promised_at, self.names.size_knob)

    def wait_s(self, deadline: float, poll_s: float, pinned_poll_s: float) -> float | None:
        """How long to wait before the next victim search, or None past the deadline.

        After a victim search found none: how long to wait before the next try, or None once
        `deadline` has passed. Until a holding can yield or its lease lapses; at most `poll_s`,
        or `pinned_poll_s` when pinned holdings stood in the way (a store told when a pin
        drops can wait as long as for anything else; one that is not must poll)."""
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            return None
        cap = pinned_poll_s if self._pinned_seen else poll_s
        return max(_FLOOR_S, min(left, self._yieldable_at - now, cap))

    def full_error(self, used_bytes: int, capacity: int) -> Exception:
        """What a save that found no room before its deadline raises."""
        now = time.monotonic()
        unleased = 0
        for entry in self._held.values():  # unleased holdings are a prefix
            if entry.lease_until > now:
                break
            unleased += 1
        n = self.names
        return n.error(f"{n.what} full: {used_bytes} of {capacity} bytes hold {len(self)} "
                       f"items, {len(self) - unleased} still leased ({n.ttl_knob}="
                       f"{self.lease_ttl_s}) or being read; raise {n.size_knob} or lower "
                       f"{n.ttl_knob}")


__all__ = ["Holding", "LeaseBook", "StoreNames"]
