"""Feature lifecycle: one state machine per embedding, one byte budget (CPU memory).

    ENCODING -> ENCODED_CPU -> DISCARDED

Either live state may go to DISCARDED (failure, abort, eviction, release: the decode side
has prefilled it); a released ENCODED_CPU feature stays when kept for multi-turn reuse.
Anything else raises `IllegalTransition` (the one class the consumer's item table,
`scheduler_hooks/item_table.py`, raises too).

Bytes: a feature reserves its *estimated* size when encoding starts (so a full budget is
known before any work is done), is re-accounted at its real size when encoded, and frees
everything when discarded. When the budget is full, the least recently used unpinned
ENCODED_CPU features are evicted; if that is not enough, `BudgetExceeded` is raised and
nothing changes. All methods are thread-safe.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from scheduler_hooks.item_table import IllegalTransition  # one class for every state table


class PoolItemState(str, enum.Enum):
    ENCODING = "encoding"
    ENCODED_CPU = "encoded_cpu"
    DISCARDED = "discarded"


S = PoolItemState
TRANSITIONS: dict[PoolItemState, frozenset[PoolItemState]] = {
    S.ENCODING: frozenset({S.ENCODED_CPU, S.DISCARDED}),
    S.ENCODED_CPU: frozenset({S.DISCARDED}),
    S.DISCARDED: frozenset(),
}


class BudgetExceeded(RuntimeError):
    """The budget cannot take the bytes even after evicting everything evictable."""


class UnknownFeature(KeyError):
    pass


@dataclass
class Feature:
    item_id: str
    modality: str
    state: PoolItemState
    nbytes: int  # reserved (ENCODING) or actual bytes
    tensor: torch.Tensor | None = None
    keep: bool = False  # keep for reuse after release
    pins: int = 0  # users that must not see it evicted (e.g. an in-flight publish)
    created: float = field(default_factory=time.monotonic)


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FeatureStore:
    """The pool's features by item id, with their states and byte budget.

    Features by item id, their states and the bytes they hold (`used`, at most `budget`;
    `peak`: the most ever held)."""

    def __init__(self, budget: int, retain: str = "discard") -> None:
        if budget <= 0:
            raise ValueError("the budget must be positive")
        if retain not in ("discard", "keep"):
            raise ValueError(f"retain must be 'discard' or 'keep', not {retain!r}")
        self.budget = budget
        self.used = 0
        self.peak = 0
        self.retain = retain
        self.evictions = 0
        self.discarded = 0
        self._features: OrderedDict[str, Feature] = OrderedDict()  # LRU order: oldest first
        self._lock = threading.RLock()

    # -- queries ---------------------------------------------------------------------------
    def get(self, item_id: str) -> Feature | None:
        with self._lock:
            return self._features.get(item_id)

    def state(self, item_id: str) -> PoolItemState:
        f = self.get(item_id)
        return f.state if f is not None else S.DISCARDED

    def counts(self) -> dict[PoolItemState, int]:
        with self._lock:
            out = dict.fromkeys(PoolItemState, 0)
            for f in self._features.values():
                out[f.state] += 1
            return out

    def bytes_by_state(self) -> dict[PoolItemState, int]:
        """Bytes held per state (DISCARDED holds none); they sum to `used`."""
        with self._lock:
            out = dict.fromkeys(PoolItemState, 0)
            for f in self._features.values():
                out[f.state] += f.nbytes
            return out

    def lookup(self, item_id: str) -> torch.Tensor | None:
        """The CPU tensor of an ENCODED_CPU feature (and mark it recently used), else None."""
        with self._lock:
            f = self._features.get(item_id)
            if f is None or f.state is not S.ENCODED_CPU:
                return None
            self._features.move_to_end(item_id)
            return f.tensor

    # -- internals -------------------------------------------------------------------------
    def _need(self, f: Feature, to: PoolItemState) -> None:
        if to not in TRANSITIONS[f.state]:
            raise IllegalTransition(
                f"feature {f.item_id!r}: illegal transition {f.state.name} -> {to.name}")

    def _make_room(self, nbytes: int, exclude: str | None = None) -> None:
        """Evict LRU unpinned ENCODED_CPU features until `nbytes` fit."""
        free = self.budget - self.used
        if nbytes <= free:
            return
        victims: list[Feature] = []
        for f in self._features.values():
            if free >= nbytes:
                break
            if f.state is S.ENCODED_CPU and f.pins == 0 and f.item_id != exclude:
                victims.append(f)
                free += f.nbytes
        if free < nbytes:
            raise BudgetExceeded(
                f"cpu budget {self.budget} bytes cannot take {nbytes} more bytes "
                f"({self.used} in use, nothing more evictable)")
        for f in victims:
            self._discard(f)
            self.evictions += 1

    def _charge(self, nbytes: int) -> None:
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def _discard(self, f: Feature) -> None:
        self.used -= f.nbytes
        f.state = S.DISCARDED
        f.tensor = None
        self._features.pop(f.item_id, None)
        self.discarded += 1

    def _live(self, item_id: str) -> Feature:
        f = self._features.get(item_id)
        if f is None:
            raise UnknownFeature(f"no live feature {item_id!r} (never made, or discarded)")
        return f

    # -- transitions -----------------------------------------------------------------------
    def begin(self, item_id: str, modality: str, est_bytes: int, keep: bool = False) -> Feature:
        """New feature in ENCODING with `est_bytes` reserved."""
        with self._lock:
            if item_id in self._features:
                raise IllegalTransition(f"feature {item_id!r} already exists "
                                        f"({self._features[item_id].state.name})")
            self._make_room(est_bytes)
            f = Feature(item_id, modality, S.ENCODING, est_bytes, keep=keep)
            self._features[item_id] = f
            self._charge(est_bytes)
            return f

    def encoded(self, item_id: str, tensor: torch.Tensor) -> Feature:
        """ENCODING -> ENCODED_CPU; the reservation becomes the tensor's real size."""
        with self._lock:
            f = self._live(item_id)
            self._need(f, S.ENCODED_CPU)
            actual = tensor_nbytes(tensor)
            if actual > f.nbytes:
                self._make_room(actual - f.nbytes, exclude=item_id)
            self._charge(actual - f.nbytes)
            f.nbytes, f.tensor, f.state = actual, tensor, S.ENCODED_CPU
            self._features.move_to_end(item_id)
            return f

    def _keeps(self, f: Feature, keep: bool | None) -> bool:
        if keep is not None:
            return keep
        return f.keep or self.retain == "keep"

    def release(self, item_id: str, keep: bool | None = None) -> PoolItemState:
        """Release a feature a consumer is done with, unless kept for reuse.

        A consumer outside this process (vLLM) is done with an ENCODED_CPU feature:
        discard it unless kept for reuse. Unknown ids are a no-op (already discarded)."""
        with self._lock:
            f = self._features.get(item_id)
            if f is None:
                return S.DISCARDED
            if f.state is S.ENCODED_CPU and self._keeps(f, keep):
                return f.state
            self._need(f, S.DISCARDED)
            self._discard(f)
            return S.DISCARDED

    def discard(self, item_id: str) -> None:
        """Any live state -> DISCARDED (failure, abort). Unknown ids raise UnknownFeature."""
        with self._lock:
            f = self._live(item_id)
            self._need(f, S.DISCARDED)
            self._discard(f)

    def pin(self, item_id: str) -> None:
        with self._lock:
            self._live(item_id).pins += 1

    def unpin(self, item_id: str) -> None:
        with self._lock:
            f = self._features.get(item_id)
            if f is not None and f.pins > 0:
                f.pins -= 1
