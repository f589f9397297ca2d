"""The consumer's feature lifecycle: one state and one byte count per item, bytes per state.

    LOADING --(every worker rank staged it)--> STAGED --(placed into vLLM's encoder cache)-->
    MERGED --(vLLM freed the entry after the request's prefill)--> PREFILLED --> DISCARDED
    LOADING, STAGED, MERGED --(failed, dropped, aborted, evicted)--> DISCARDED

The producer's half (ENCODING -> ENCODED_CPU -> DISCARDED) is the pool's table
(`encoder_service/encoder_pool/lifecycle.py`), and a vLLM producer's save queue
(`ec_connectors/workers/save_queue.py`). An item not tracked here is DISCARDED: `begin`
starts a new life at LOADING, and every other move must be in `ALLOWED`, else
`IllegalTransition`. The bytes of LOADING are a reservation (the size the item is expected
to have), re-accounted at the real size when STAGED. `HELD` are the states whose bytes the
connector holds itself (workers' staging memory, or the scheduler's inline reads): the ones
its byte budget covers (`fits`); MERGED and PREFILLED bytes live in vLLM's encoder cache,
which vLLM bounds itself.

Pure logic over plain values: no threads (the caller locks), no vLLM.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FeatureState(str, enum.Enum):
    LOADING = "loading"  # a load started: its expected bytes are reserved
    STAGED = "staged"  # loaded and verified on every worker rank, not placed yet
    MERGED = "merged"  # placed into vLLM's encoder cache for a request
    PREFILLED = "prefilled"  # vLLM freed the entry: the request's KV cache holds the item
    DISCARDED = "discarded"  # gone: no bytes, not tracked


S = FeatureState
ALLOWED: dict[FeatureState, frozenset[FeatureState]] = {
    S.LOADING: frozenset({S.STAGED, S.DISCARDED}),
    S.STAGED: frozenset({S.MERGED, S.DISCARDED}),
    S.MERGED: frozenset({S.PREFILLED, S.DISCARDED}),
    S.PREFILLED: frozenset({S.DISCARDED}),
    S.DISCARDED: frozenset(),
}
HELD = frozenset({S.LOADING, S.STAGED})


class IllegalTransition(RuntimeError):
    """A move `ALLOWED` does not have (names the item and both states)."""


@dataclass(slots=True)
class Entry:
    state: FeatureState
    nbytes: int
    owner: str = ""  # MERGED: the request it was placed for


def fits(held: int, nbytes: int, budget: int) -> bool:
    """Whether a new load of `nbytes` fits the budget. With nothing held, any item fits (one
    larger than the budget loads alone): a wait for room always ends."""
    return held == 0 or held + nbytes <= budget


class Lifecycle:
    """Item id -> Entry, and the bytes in each state (always their entries' sum)."""

    def __init__(self) -> None:
        self._items: dict[str, Entry] = {}
        self._bytes = dict.fromkeys(FeatureState, 0)

    def state(self, item_id: str) -> FeatureState:
        e = self._items.get(item_id)
        return e.state if e is not None else S.DISCARDED

    def get(self, item_id: str) -> Entry | None:
        return self._items.get(item_id)

    def __len__(self) -> int:
        return len(self._items)

    def items_in(self, *states: FeatureState) -> list[str]:
        return [i for i, e in self._items.items() if e.state in states]

    def bytes_in(self, *states: FeatureState) -> int:
        return sum(self._bytes[s] for s in states)

    def by_state(self) -> dict[str, int]:
        """Bytes per state, every state named (DISCARDED holds none)."""
        return {s.value: n for s, n in self._bytes.items()}

    def begin(self, item_id: str, nbytes: int) -> Entry:
        """A new life at LOADING with `nbytes` reserved; the item must be DISCARDED."""
        if item_id in self._items:
            raise IllegalTransition(f"item {item_id!r}: begins again while "
                                    f"{self._items[item_id].state.name}")
        e = self._items[item_id] = Entry(S.LOADING, max(0, nbytes))
        self._bytes[S.LOADING] += e.nbytes
        return e

    def move(self, item_id: str, to: FeatureState, nbytes: int | None = None,
             owner: str | None = None) -> None:
        """One transition of `ALLOWED`; `nbytes` re-accounts the item's size (STAGED: the real
        one). DISCARDED forgets the item and its bytes."""
        e = self._items.get(item_id)
        now = e.state if e is not None else S.DISCARDED
        if e is None or to not in ALLOWED[now]:
            raise IllegalTransition(f"item {item_id!r}: {now.name} -> {to.name}")
        self._bytes[now] -= e.nbytes
        if to is S.DISCARDED:
            del self._items[item_id]
            return
        if nbytes is not None:
            e.nbytes = max(0, nbytes)
        if owner is not None:
            e.owner = owner
        e.state = to
        self._bytes[to] += e.nbytes
