"""The consumer's items: one table, one state machine per item (`TRANSITIONS`).

    LOADING --(every worker rank staged it)--> STAGED --(placed into vLLM's encoder cache)-->
    MERGED --(vLLM freed the entry after the request's prefill)--> PREFILLED
    PREFILLED --(the end of that step: vLLM's cache owns the entry)--> DISCARDED
    LOADING --(a rank failed, the deadline passed, no worker)--> FAILED
    STAGED --(wrong token count, found at schedule time)--> FAILED
    FAILED --(answered "encode locally" for failed_memory_s, then forgotten)--> DISCARDED
    LOADING, STAGED --(nobody waits for it, or never placed within ready_ttl_s)--> DISCARDED
    MERGED --(its request ended before its prefill, or vLLM evicted it)--> DISCARDED
    any --(a new load of the same id: the earlier life ends)--> DISCARDED --> LOADING

DISCARDED is "not tracked". Per item: its state, bytes (LOADING: the size it is expected to
have, reserved; re-accounted at the real size when STAGED; FAILED holds none), the load's
deadline, the worker ranks that staged it, its embedding count, the error, the requests
deferred on it (waiters) and, once MERGED, the request it was placed for (the owner index:
`finished(req)` touches that request's items only). Bytes per state are kept as items move;
`HELD` (LOADING + STAGED) is what the connector holds itself, the bytes its budget covers
(`fits`); MERGED and PREFILLED bytes are in vLLM's encoder cache, which vLLM bounds.

Every cost is O(what changed): signals name their items; PREFILLED items wait for the end
of the step in a list; STAGED items never placed and FAILED ones past their memory are found
by a heap of due times (`sweep` pops what is due), never by a scan. A move `TRANSITIONS` does
not have is a bug: `move` raises `IllegalTransition`; inside the signal methods the item is
dropped instead, counted (`errors`) and reported (`on_illegal`), never failing a request.

Pure logic over plain values (times are passed in): no vLLM, no I/O. The table is shared by
the scheduler's thread, the control channel's and the inline reader's: every change goes
through `lock`; a lookup of one item (`get`, `state`) is one dict read and takes none.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field


class ItemState(str, enum.Enum):
    LOADING = "loading"  # a load started: its expected bytes are reserved
    STAGED = "staged"  # loaded and verified on every worker rank, not placed yet
    MERGED = "merged"  # placed into vLLM's encoder cache for a request
    PREFILLED = "prefilled"  # vLLM freed the entry: the request's KV cache holds the item
    FAILED = "failed"  # the load failed: "encode locally" for failed_memory_s
    DISCARDED = "discarded"  # gone: no bytes, not tracked


S = ItemState
TRANSITIONS: dict[ItemState, frozenset[ItemState]] = {
    S.LOADING: frozenset({S.STAGED, S.FAILED, S.DISCARDED}),
    S.STAGED: frozenset({S.MERGED, S.FAILED, S.DISCARDED}),
    S.MERGED: frozenset({S.PREFILLED, S.DISCARDED}),
    S.PREFILLED: frozenset({S.DISCARDED}),
    S.FAILED: frozenset({S.DISCARDED}),
    S.DISCARDED: frozenset({S.LOADING}),  # `begin`: a new life
}
HELD = frozenset({S.LOADING, S.STAGED})  # the bytes the connector holds: the budget's
LIFECYCLE = (S.LOADING, S.STAGED, S.MERGED, S.PREFILLED, S.DISCARDED)  # bytes reported
_STAGING = frozenset({S.LOADING, S.STAGED, S.FAILED})  # a load's outcome is looked up
DEADLINE_PASSED = "deadline passed"
NO_WORKER = "no worker connected"


class IllegalTransition(RuntimeError):
    """A move `TRANSITIONS` does not have (names the item and both states)."""


def fits(held: int, nbytes: int, budget: int) -> bool:
    """Whether a new load of `nbytes` fits the budget.

    With nothing held, any item fits (one larger than the budget loads alone): a wait for room
    always ends. The one rule of the staging budget: the scheduler's reservations
    (`ItemTable.begin`) and the worker's staging area (`ec_connectors/workers/worker.py`) both
    ask it."""
    return held == 0 or held + nbytes <= budget


@dataclass(slots=True, eq=False)
class Item:
    """One item's life.

    `deadline`: while LOADING, when to give up; once FAILED, when it failed (the start of its
    memory)."""

    item_id: str
    state: ItemState
    nbytes: int
    started: float
    deadline: float
    ranks_ok: set[int] = field(default_factory=set)
    num_embeds: int = 0
    error: str = ""
    ready_at: float = 0.0  # when it was STAGED (latency of the staged -> scheduled stage)
    waiters: set[str] = field(default_factory=set)  # requests deferred on this item
    owner: str = ""  # MERGED: the request it was placed for


class ItemTable:
    """Item id -> Item for one consumer scheduler, with bytes per state."""

    def __init__(self, failed_memory_s: float, ready_ttl_s: float,
                 on_illegal: Callable[[str], None] | None = None) -> None:
        self.failed_memory_s = failed_memory_s
        self.ready_ttl_s = ready_ttl_s
        self.on_illegal = on_illegal  # told of a refused move (a bug), under the lock
        self.lock = threading.Lock()
        self.errors = 0  # refused moves (each item dropped)
        self.version = 0  # bumped on every move: a change of bytes per state to publish
        self.peak_held = 0  # the most bytes ever held (LOADING + STAGED)
        self._items: dict[str, Item] = {}
        self._bytes = dict.fromkeys(ItemState, 0)
        self._owned: dict[str, set[str]] = {}  # request -> items MERGED for it
        self._prefilled: list[Item] = []  # PREFILLED since the last end_step
        self._due: list[tuple[float, int, Item, ItemState]] = []  # (when, seq, item, state)
        self._seq = itertools.count()

    # -- lookups (no lock: one dict read) -----------------------------------------------------
    def get(self, item_id: str) -> Item | None:
        return self._items.get(item_id)

    def state(self, item_id: str) -> ItemState:
        e = self._items.get(item_id)
        return e.state if e is not None else S.DISCARDED

    def __len__(self) -> int:
        return len(self._items)

    @property
    def held(self) -> int:
        return self._bytes[S.LOADING] + self._bytes[S.STAGED]

    def by_state(self) -> dict[str, int]:
        """Bytes per lifecycle state, every one named (DISCARDED holds none)."""
        return {s.value: self._bytes[s] for s in LIFECYCLE}

    def current(self, item_id: str, now: float) -> Item | None:
        """Look up an item's current load, if it has one.

        The item's load (LOADING, STAGED, or FAILED within its memory), or None: none,
        placed already (MERGED, PREFILLED), or a failure old enough to forget (then the caller
        may start a new attempt)."""
        e = self._items.get(item_id)
        if e is None or e.state not in _STAGING:
            return None
        if e.state is S.FAILED and now - e.deadline > self.failed_memory_s:
            with self.lock:
                if self._items.get(item_id) is e:
                    self._move(e, S.DISCARDED, now)
            return None
        return e

    # -- moves -------------------------------------------------------------------------------
    def begin(self, item_id: str, now: float, timeout_s: float, nbytes: int = 0,
              have_workers: bool = True, budget: int | None = None) -> Item | None:
        """Start a new load of an item, reserving its bytes in the staging budget.

        A new load at LOADING with `nbytes` reserved (FAILED at once without workers to
        load it); an earlier life of the id ends first. None: `budget` has no room for it
        (nothing started)."""
        with self.lock:
            old = self._items.get(item_id)
            if old is not None:
                self._move(old, S.DISCARDED, now)
            if budget is not None and not fits(self.held, nbytes, budget):
                return None
            e = self._items[item_id] = Item(item_id, S.DISCARDED, max(0, nbytes), now,
                                            now + timeout_s)
            self._move(e, S.LOADING, now)
            if not have_workers:
                self._move(e, S.FAILED, now, why=NO_WORKER)
            return e

    def staged(self, item_id: str, rank: int, ok: bool, num_embeds: int, error: str,
               ranks: set[int], now: float, nbytes: int = 0) -> ItemState | None:
        """A worker's report.

        Returns the new state when it changed (STAGED once every rank in `ranks` staged it, at
        `nbytes` when known; FAILED at the first failure), else None (a report about an item in
        another state: late, or not ours)."""
        with self.lock:
            e = self._items.get(item_id)
            if e is None or e.state is not S.LOADING:
                return None
            if not ok:
                return self._signal(e, S.FAILED, now, why=error)
            e.ranks_ok.add(rank)
            e.num_embeds = num_embeds
            if e.ranks_ok >= ranks:
                return self._signal(e, S.STAGED, now, nbytes=nbytes or None)
            return None

    def fail(self, e: Item, why: str, now: float) -> bool:
        """A live load (LOADING, STAGED) fails; True if this call failed it."""
        with self.lock:
            if self._items.get(e.item_id) is not e or e.state not in HELD:
                return False
            return self._signal(e, S.FAILED, now, why=why) is S.FAILED

    def expire(self, e: Item, now: float) -> bool:
        """A LOADING item past its deadline fails; True if this call failed it."""
        if e.state is not S.LOADING or now <= e.deadline:
            return False
        with self.lock:
            if self._items.get(e.item_id) is not e or e.state is not S.LOADING:
                return False
            return self._signal(e, S.FAILED, now, why=DEADLINE_PASSED) is S.FAILED

    def merged(self, item_id: str, req_id: str, now: float) -> Item | None:
        """The STAGED item is placed into vLLM's encoder cache for `req_id` (returned)."""
        with self.lock:
            e = self._items.get(item_id)
            if e is None or e.state is not S.STAGED:
                return None
            return e if self._signal(e, S.MERGED, now, owner=req_id) is S.MERGED else None

    def prefilled(self, item_id: str, now: float = 0.0) -> None:
        """Record that vLLM freed an item's entry after the prefill.

        vLLM freed the entry after the prefill: a MERGED item is PREFILLED (DISCARDED at
        `end_step`). Entries vLLM encoded itself are not ours: nothing changes."""
        with self.lock:
            e = self._items.get(item_id)
            if e is not None and e.state is S.MERGED:
                self._signal(e, S.PREFILLED, now)

    def finished(self, req_id: str, now: float = 0.0) -> None:
        """A request ended: what was placed for it and never prefilled is DISCARDED."""
        if req_id not in self._owned:  # the usual case: no lock taken
            return
        with self.lock:
            for item_id in self._owned.pop(req_id, ()):
                e = self._items.get(item_id)
                if e is not None and e.state is S.MERGED and e.owner == req_id:
                    self._signal(e, S.DISCARDED, now)

    def evicted(self, item_ids: Iterable[str], now: float = 0.0) -> None:
        """vLLM evicted these entries from its encoder cache."""
        with self.lock:
            for item_id in item_ids:
                e = self._items.get(item_id)
                if e is not None and e.state in (S.MERGED, S.PREFILLED):
                    self._signal(e, S.DISCARDED, now)

    def end_step(self, now: float = 0.0) -> None:
        """End a step: discard the items prefilled since the last one.

        The end of a step: the items PREFILLED since the last one are DISCARDED (vLLM's
        cache owns their entries from then on)."""
        if not self._prefilled:
            return
        with self.lock:
            done, self._prefilled = self._prefilled, []
            for e in done:
                if self._items.get(e.item_id) is e and e.state is S.PREFILLED:
                    self._signal(e, S.DISCARDED, now)

    def drop(self, item_id: str, now: float = 0.0) -> None:
        """Forget the item, whatever its state."""
        with self.lock:
            e = self._items.get(item_id)
            if e is not None:
                self._signal(e, S.DISCARDED, now)

    def move(self, item_id: str, to: ItemState, now: float = 0.0, *,
             nbytes: int | None = None, why: str = "", owner: str = "") -> None:
        """Move a tracked item to another state, if the transition table allows it.

        One move of `TRANSITIONS` for a tracked item (DISCARDED -> LOADING is `begin`);
        any other raises IllegalTransition and changes nothing."""
        with self.lock:
            e = self._items.get(item_id)
            if e is None:
                raise IllegalTransition(f"item {item_id!r}: DISCARDED -> {to.name}")
            self._move(e, to, now, nbytes=nbytes, why=why, owner=owner)

    # -- waiters -----------------------------------------------------------------------------
    def want(self, item_id: str, req_id: str) -> None:
        """`req_id` waits for the item's load (it is deferred until the item is STAGED)."""
        with self.lock:
            e = self._items.get(item_id)
            if e is not None and e.state in _STAGING:
                e.waiters.add(req_id)

    def release(self, item_id: str, req_id: str) -> bool:
        """`req_id` no longer needs the item.

        True when that leaves a live load (LOADING or STAGED) nobody waits for: the caller
        passes it to `unwanted` at the end of the step."""
        with self.lock:
            e = self._items.get(item_id)
            if e is None or req_id not in e.waiters:
                return False
            e.waiters.discard(req_id)
            return not e.waiters and e.state in HELD

    def unwanted(self, candidates: set[str], placed: Collection[str]) -> list[str]:
        """Drop the staged candidates that nobody waits for and nothing placed.

        Drop the STAGED candidates nobody waits for and that were not placed this step
        (returned: their staged copies must be dropped on the workers). Candidates still
        LOADING stay in `candidates` until they land or fail; the rest leave it."""
        dropped: list[str] = []
        with self.lock:
            for item_id in list(candidates):
                e = self._items.get(item_id)
                if e is not None and e.state is S.LOADING and not e.waiters:
                    continue
                candidates.discard(item_id)
                if (e is not None and e.state is S.STAGED and not e.waiters
                        and item_id not in placed):
                    self._signal(e, S.DISCARDED, 0.0)
                    dropped.append(item_id)
        return dropped

    def sweep(self, now: float) -> list[str]:
        """Drop expired staged items and forget old failures.

        Drop STAGED items nobody placed within `ready_ttl_s` of their start (returned:
        their staged memory must be dropped on the workers) and forget FAILED ones past
        their memory. Pops only what is due (and what left that state since)."""
        stale: list[str] = []
        with self.lock:
            while self._due and self._due[0][0] < now:
                _, _, e, state = heapq.heappop(self._due)
                if self._items.get(e.item_id) is not e or e.state is not state:
                    continue  # moved on since
                if state is S.STAGED and now - e.started > self.ready_ttl_s:
                    stale.append(e.item_id)
                    self._signal(e, S.DISCARDED, now)
                elif state is S.FAILED and now - e.deadline > self.failed_memory_s:
                    self._signal(e, S.DISCARDED, now)
        return stale

    # -- internals (the caller holds the lock) ------------------------------------------------
    def _signal(self, e: Item, to: ItemState, now: float, **kw) -> ItemState | None:
        """A move on a signal: a refused one (a bug) drops the item instead of raising."""
        try:
            self._move(e, to, now, **kw)
            return to
        except IllegalTransition as exc:
            self.errors += 1
            if self.on_illegal is not None:
                self.on_illegal(str(exc))
            if self._items.get(e.item_id) is e:
                self._move(e, S.DISCARDED, now)
            return None

    def _move(self, e: Item, to: ItemState, now: float, *, nbytes: int | None = None,
              why: str = "", owner: str = "") -> None:
        frm = e.state
        if to not in TRANSITIONS[frm]:
            raise IllegalTransition(f"item {e.item_id!r}: {frm.name} -> {to.name}")
        if frm is not S.DISCARDED:  # (a new Item starts there, its bytes not counted yet)
            self._bytes[frm] -= e.nbytes
        if frm is S.MERGED:
            owned = self._owned.get(e.owner)
            if owned is not None:
                owned.discard(e.item_id)
                if not owned:
                    del self._owned[e.owner]
        e.state = to
        self.version += 1
        if to is S.DISCARDED:
            del self._items[e.item_id]
            return
        if nbytes is not None:
            e.nbytes = max(0, nbytes)
        if to is S.STAGED:
            e.ready_at = now
            self._due_at(e.started + self.ready_ttl_s, e)
        elif to is S.FAILED:
            e.error, e.deadline, e.nbytes = why, now, 0
            self._due_at(now + self.failed_memory_s, e)
        elif to is S.MERGED:
            e.owner = owner
            e.waiters.clear()  # the placement took the load: nobody waits for it any more
            self._owned.setdefault(owner, set()).add(e.item_id)
        elif to is S.PREFILLED:
            self._prefilled.append(e)
        self._bytes[to] += e.nbytes
        self.peak_held = max(self.peak_held, self.held)

    def _due_at(self, when: float, e: Item) -> None:
        """`sweep` looks at `e` again at `when`, if it is still in its state then.

        Entries of items that moved on are skipped when due; past twice the live items, the heap
        is rebuilt without them (amortized O(1) per entry)."""
        if len(self._due) > 2 * len(self._items) + 64:
            self._due = [d for d in self._due
                         if self._items.get(d[2].item_id) is d[2] and d[2].state is d[3]]
            heapq.heapify(self._due)
        heapq.heappush(self._due, (when, next(self._seq), e, e.state))
