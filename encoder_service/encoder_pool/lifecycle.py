"""Feature lifecycle: one state machine per embedding, byte budgets per memory tier.

    ENCODING -> ENCODED_CPU -> STAGED_GPU -> MERGED -> PREFILLED -> DISCARDED

Side exits: any live state may go to DISCARDED (failure, abort, eviction, release);
STAGED_GPU may fall back to ENCODED_CPU (unstaged under accelerator pressure); PREFILLED
goes back to ENCODED_CPU when the feature is kept for multi-turn reuse. Anything else raises
`IllegalTransition`.

Bytes: a feature reserves its *estimated* size in the CPU tier when encoding starts (so a
full budget is known before any work is done), is re-accounted at its real size when
encoded, moves to the accelerator ("gpu") tier when staged, and frees everything when
discarded. When the CPU tier is full, the least recently used unpinned ENCODED_CPU features
are evicted; if that is not enough, `BudgetExceeded` is raised and nothing changes.
All methods are thread-safe.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal

import torch

Tier = Literal["cpu", "gpu"]


class FeatureState(str, enum.Enum):
    ENCODING = "encoding"
    ENCODED_CPU = "encoded_cpu"
    STAGED_GPU = "staged_gpu"
    MERGED = "merged"
    PREFILLED = "prefilled"
    DISCARDED = "discarded"


S = FeatureState
TRANSITIONS: dict[FeatureState, frozenset[FeatureState]] = {
    S.ENCODING: frozenset({S.ENCODED_CPU, S.DISCARDED}),
    S.ENCODED_CPU: frozenset({S.STAGED_GPU, S.DISCARDED}),
    S.STAGED_GPU: frozenset({S.MERGED, S.ENCODED_CPU, S.DISCARDED}),
    S.MERGED: frozenset({S.PREFILLED, S.DISCARDED}),
    S.PREFILLED: frozenset({S.DISCARDED, S.ENCODED_CPU}),
    S.DISCARDED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A transition the state machine does not allow (names the item and both states)."""


class BudgetExceeded(RuntimeError):
    """A tier cannot take the bytes even after evicting everything evictable."""


class UnknownFeature(KeyError):
    pass


@dataclass
class Feature:
    item_id: str
    modality: str
    state: FeatureState
    nbytes: int  # reserved (ENCODING) or actual bytes
    tensor: torch.Tensor | None = None
    keep: bool = False  # keep for reuse after prefill
    pins: int = 0  # users that must not see it evicted (e.g. an in-flight publish)
    created: float = field(default_factory=time.monotonic)

    @property
    def tier(self) -> Tier | None:
        if self.state in (S.ENCODING, S.ENCODED_CPU):
            return "cpu"
        if self.state in (S.STAGED_GPU, S.MERGED, S.PREFILLED):
            return "gpu"
        return None


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FeatureStore:
    """Features by item id, their states and the bytes each tier holds."""

    def __init__(self, cpu_budget: int, gpu_budget: int, retain: str = "discard") -> None:
        if cpu_budget <= 0 or gpu_budget <= 0:
            raise ValueError("budgets must be positive")
        if retain not in ("discard", "keep"):
            raise ValueError(f"retain must be 'discard' or 'keep', not {retain!r}")
        self.budget: dict[Tier, int] = {"cpu": cpu_budget, "gpu": gpu_budget}
        self.used: dict[Tier, int] = {"cpu": 0, "gpu": 0}
        self.peak: dict[Tier, int] = {"cpu": 0, "gpu": 0}
        self.retain = retain
        self.evictions = 0
        self.discarded = 0
        self._features: OrderedDict[str, Feature] = OrderedDict()  # LRU order: oldest first
        self._lock = threading.RLock()

    # -- queries ---------------------------------------------------------------------------
    def get(self, item_id: str) -> Feature | None:
        with self._lock:
            return self._features.get(item_id)

    def state(self, item_id: str) -> FeatureState:
        f = self.get(item_id)
        return f.state if f is not None else S.DISCARDED

    def counts(self) -> dict[FeatureState, int]:
        with self._lock:
            out = dict.fromkeys(FeatureState, 0)
            for f in self._features.values():
                out[f.state] += 1
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
    def _need(self, f: Feature, to: FeatureState, *, only_from: FeatureState | None = None
              ) -> None:
        if to not in TRANSITIONS[f.state] or (only_from is not None and f.state is not only_from):
            raise IllegalTransition(
                f"feature {f.item_id!r}: illegal transition {f.state.name} -> {to.name}")

    def _make_room(self, tier: Tier, nbytes: int, exclude: str | None = None) -> None:
        """Evict LRU unpinned ENCODED_CPU features (cpu tier only) until `nbytes` fit."""
        free = self.budget[tier] - self.used[tier]
        if nbytes <= free:
            return
        victims: list[Feature] = []
        if tier == "cpu":
            for f in self._features.values():
                if free >= nbytes:
                    break
                if f.state is S.ENCODED_CPU and f.pins == 0 and f.item_id != exclude:
                    victims.append(f)
                    free += f.nbytes
        if free < nbytes:
            raise BudgetExceeded(
                f"{tier} budget {self.budget[tier]} bytes cannot take {nbytes} more bytes "
                f"({self.used[tier]} in use, nothing more evictable)")
        for f in victims:
            self._discard(f)
            self.evictions += 1

    def _charge(self, tier: Tier, nbytes: int) -> None:
        self.used[tier] += nbytes
        self.peak[tier] = max(self.peak[tier], self.used[tier])

    def _discard(self, f: Feature) -> None:
        tier = f.tier
        if tier is not None:
            self.used[tier] -= f.nbytes
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
        """New feature in ENCODING with `est_bytes` reserved in the CPU tier."""
        with self._lock:
            if item_id in self._features:
                raise IllegalTransition(f"feature {item_id!r} already exists "
                                        f"({self._features[item_id].state.name})")
            self._make_room("cpu", est_bytes)
            f = Feature(item_id, modality, S.ENCODING, est_bytes, keep=keep)
            self._features[item_id] = f
            self._charge("cpu", est_bytes)
            return f

    def encoded(self, item_id: str, tensor: torch.Tensor) -> Feature:
        """ENCODING -> ENCODED_CPU; the reservation becomes the tensor's real size."""
        with self._lock:
            f = self._live(item_id)
            self._need(f, S.ENCODED_CPU, only_from=S.ENCODING)
            actual = tensor_nbytes(tensor)
            if actual > f.nbytes:
                self._make_room("cpu", actual - f.nbytes, exclude=item_id)
            self.used["cpu"] += actual - f.nbytes
            self.peak["cpu"] = max(self.peak["cpu"], self.used["cpu"])
            f.nbytes, f.tensor, f.state = actual, tensor, S.ENCODED_CPU
            self._features.move_to_end(item_id)
            return f

    def stage(self, item_id: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """ENCODED_CPU -> STAGED_GPU: bytes move from the CPU tier to the accelerator tier."""
        with self._lock:
            f = self._live(item_id)
            self._need(f, S.STAGED_GPU)
            self._make_room("gpu", f.nbytes)
            assert f.tensor is not None
            f.tensor = f.tensor.to(device, non_blocking=False)
            self.used["cpu"] -= f.nbytes
            self._charge("gpu", f.nbytes)
            f.state = S.STAGED_GPU
            return f.tensor

    def unstage(self, item_id: str) -> None:
        """STAGED_GPU -> ENCODED_CPU (accelerator pressure)."""
        with self._lock:
            f = self._live(item_id)
            self._need(f, S.ENCODED_CPU, only_from=S.STAGED_GPU)
            self._make_room("cpu", f.nbytes, exclude=item_id)
            assert f.tensor is not None
            f.tensor = f.tensor.cpu()
            self.used["gpu"] -= f.nbytes
            self._charge("cpu", f.nbytes)
            f.state = S.ENCODED_CPU

    def merged(self, item_id: str) -> None:
        with self._lock:
            f = self._live(item_id)
            self._need(f, S.MERGED)
            f.state = S.MERGED

    def prefilled(self, item_id: str, keep: bool | None = None) -> FeatureState:
        """MERGED -> PREFILLED, then the cache-or-discard policy: DISCARDED by default, back
        to ENCODED_CPU when kept (per call, per feature, or `retain="keep"`) and it fits.
        Returns the resulting state."""
        with self._lock:
            f = self._live(item_id)
            self._need(f, S.PREFILLED)
            f.state = S.PREFILLED
            if not self._keeps(f, keep):
                self._discard(f)
                return S.DISCARDED
            try:
                self._make_room("cpu", f.nbytes, exclude=item_id)
            except BudgetExceeded:
                self._discard(f)
                return S.DISCARDED
            assert f.tensor is not None
            f.tensor = f.tensor.cpu()
            self.used["gpu"] -= f.nbytes
            self._charge("cpu", f.nbytes)
            f.state = S.ENCODED_CPU
            self._features.move_to_end(item_id)
            return S.ENCODED_CPU

    def _keeps(self, f: Feature, keep: bool | None) -> bool:
        if keep is not None:
            return keep
        return f.keep or self.retain == "keep"

    def release(self, item_id: str, keep: bool | None = None) -> FeatureState:
        """A consumer outside this process (vLLM) is done with an ENCODED_CPU feature:
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
