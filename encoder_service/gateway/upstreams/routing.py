"""Which instance gets what: rendezvous (highest random weight) hashing with bounded loads.

Every gateway replica computes the same order of instances for an item from the item id and
the instances' names alone (no shared state), so a repeated item reaches the encoder that
already holds it, and a request reaches the decode instance whose prefix and encoder caches
hold its items. Bounded loads (Mirrokni et al., "Consistent hashing with bounded loads"): an
instance already carrying more than `load_factor` times the average in-flight load is passed
over for the next in the item's order, so a hot item cannot pile onto one instance. Adding
or removing an instance moves only the items whose first choice it was.

Policies: `affinity` (the above), `least_loaded` (fewest in flight, ties rotating),
`round_robin` (strict rotation), for comparison (benchmarks/gateway/routing.py). `Members`: the
per-instance state both upstream pools keep (in flight, cool-down, draining, down, counts);
`Hold`: one call counted in flight, taken off exactly once.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from encoder_service.gateway.config import Policy


def _weight(key: str, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{name}\0{key}".encode(), digest_size=8).digest(),
                          "big")


def rendezvous(key: str, names: Sequence[str]) -> list[str]:
    """`names` ordered by their weight for `key`, highest first (the same everywhere)."""
    return sorted(names, key=lambda n: _weight(key, n), reverse=True)


def bounded(order: Sequence[str], load: Mapping[str, int], factor: float) -> str:
    """Pick the first instance in order whose load is under the bound.

    The first of `order` whose load is under the bound ceil(factor * (total + 1) / n)
    (the average load with this request counted, times `factor`); some instance always is."""
    cap = math.ceil(factor * (sum(load.get(n, 0) for n in order) + 1) / len(order))
    for name in order:
        if load.get(name, 0) < cap:
            return name
    return order[0]


class Chooser:
    """Orders usable instances for a key under one policy. `load`: in flight per name."""

    def __init__(self, policy: Policy, load_factor: float) -> None:
        self.policy = policy
        self.load_factor = load_factor
        self._rr = itertools.count()

    def order(self, key: str | None, names: Sequence[str], load: Mapping[str, int]
              ) -> list[str]:
        """Every name, best first: the choice, then where a retry goes."""
        if not names:
            return []
        start = next(self._rr)
        rotated = [names[(start + i) % len(names)] for i in range(len(names))]
        if self.policy == "round_robin":
            return rotated
        if self.policy == "least_loaded" or key is None:
            return sorted(rotated, key=lambda n: load.get(n, 0))
        order = rendezvous(key, names)
        first = bounded(order, load, self.load_factor)
        return [first, *(n for n in order if n != first)]


class Hold:
    """One call counted in flight on one instance, until `done()`.

    One call counted in flight on one instance of one pool, from `Members.hold` until
    `done()`: the pool and name it was counted on are kept here, and `done()` takes it off
    there exactly once (later calls change nothing), so a count is the calls really open."""

    __slots__ = ("_members", "name", "_open")

    def __init__(self, members: Members, name: str) -> None:
        self._members, self.name, self._open = members, name, True
        members.inflight[name] = members.inflight.get(name, 0) + 1

    def done(self) -> None:
        if self._open:
            self._open = False
            left = self._members.inflight.get(self.name, 0) - 1
            self._members.inflight[self.name] = max(0, left)


class Members:
    """The instances of an upstream pool and their per-instance state.

    What a pool of upstream instances (encoders, decode instances) keeps per instance:
    calls in flight, when a failed one may be tried first again, which are draining, which
    are down (`down`: their process died; a supervisor, `epd up`, restarts it: outages.py),
    what each was given (`counts`); joining, draining and describing them. Draining and down
    instances get nothing new. A subclass says which instances exist (`names`) and how one is
    forgotten once drained (`_forget`)."""

    def __init__(self, names: Sequence[str], cooldown_s: float, counts: dict[str, int]) -> None:
        self.cooldown_s = cooldown_s
        self._zero_counts = counts
        self.inflight: dict[str, int] = {}
        self.down_until: dict[str, float] = {}
        self.counts: dict[str, dict[str, int]] = {}
        self.draining: set[str] = set()
        self.down: set[str] = set()
        for name in names:
            self._join(name)

    def names(self) -> list[str]:
        raise NotImplementedError

    def _forget(self, name: str) -> None:
        raise NotImplementedError

    def _join(self, name: str) -> None:
        self.inflight.setdefault(name, 0)
        self.down_until[name] = 0.0
        self.counts.setdefault(name, dict(self._zero_counts))
        self.draining.discard(name)
        self.down.discard(name)

    def hold(self, name: str) -> Hold:
        """Count one call in flight on `name` until the returned hold's `done()`."""
        return Hold(self, name)

    def usable(self, name: str) -> bool:
        """Neither draining nor down: it may get new work."""
        return name not in self.draining and name not in self.down

    def cool_down(self, name: str, seconds: float | None = None) -> None:
        """`name` failed: try it last for `seconds` (default `cooldown_s`; 0 clears it)."""
        self.down_until[name] = time.monotonic() + (self.cooldown_s if seconds is None
                                                    else seconds)

    async def drain(self, name: str, timeout_s: float) -> bool:
        """Drain an instance: wait for its calls in flight, then forget it.

        Nothing new for `name`; wait (up to `timeout_s`) for its calls in flight, then
        forget it (unless it joined again meanwhile). True when it left drained."""
        self.draining.add(name)
        deadline = time.monotonic() + timeout_s
        while self.inflight.get(name, 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        drained = not self.inflight.get(name, 0)
        if name in self.draining:
            self._forget(name)
            self.draining.discard(name)
        return drained

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{"url": n, "state": "draining" if n in self.draining else
                 "down" if n in self.down else
                 "cooling_down" if self.down_until.get(n, 0) > now else "up",
                 "inflight": self.inflight.get(n, 0), **self.counts.get(n, {})}
                for n in self.names()]
