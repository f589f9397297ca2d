"""Which instance gets what: rendezvous (highest random weight) hashing with bounded loads.

Every gateway replica computes the same order of instances for an item from the item id and
the instances' names alone (no shared state), so a repeated item reaches the encoder that
already holds it, and a request reaches the decode instance whose prefix and encoder caches
hold its items. Bounded loads (Mirrokni et al., "Consistent hashing with bounded loads"): an
instance already carrying more than `load_factor` times the average in-flight load is passed
over for the next in the item's order, so a hot item cannot pile onto one instance. Adding
or removing an instance moves only the items whose first choice it was.

Policies: `affinity` (the above), `least_loaded` (fewest in flight, ties rotating),
`round_robin` (strict rotation), for comparison (benchmarks/routing_bench.py).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Literal

Policy = Literal["affinity", "least_loaded", "round_robin"]


def _weight(key: str, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{name}\0{key}".encode(), digest_size=8).digest(),
                          "big")


def rendezvous(key: str, names: Sequence[str]) -> list[str]:
    """`names` ordered by their weight for `key`, highest first (the same everywhere)."""
    return sorted(names, key=lambda n: _weight(key, n), reverse=True)


def bounded(order: Sequence[str], load: Mapping[str, int], factor: float) -> str:
    """The first of `order` whose load is under the bound ceil(factor * (total + 1) / n)
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
