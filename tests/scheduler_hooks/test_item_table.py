"""The consumer's item table (`scheduler_hooks.item_table`) and `decide` over it, as pure logic (no
vLLM, no sockets): times are passed in, so every deadline is exact. Every path the transition
table allows is walked, every move it does not allow raises, the bytes per state always sum
to the items', and the per-step and per-request work touches only what changed."""

from __future__ import annotations

import heapq
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_hooks import item_table as items_mod
from scheduler_hooks.decisions import (
    Verdict,
    covered,
    decide,
    pull_location,
    unavailable_action,
)
from scheduler_hooks.item_table import (
    DEADLINE_PASSED,
    HELD,
    LIFECYCLE,
    TRANSITIONS,
    IllegalTransition,
    Item,
    ItemState,
    ItemTable,
    fits,
)

S = ItemState
RANKS = {0, 1}
ILLEGAL = [(a, b) for a, b in itertools.product(S, S) if b not in TRANSITIONS[a]]
ZERO = dict.fromkeys([s.value for s in LIFECYCLE], 0)


def table() -> ItemTable:
    return ItemTable(failed_memory_s=5.0, ready_ttl_s=120.0)


def _begin(t: ItemTable, item_id: str, now: float = 0.0, timeout_s: float = 10.0,
           nbytes: int = 0, have_workers: bool = True) -> Item:
    e = t.begin(item_id, now, timeout_s, nbytes=nbytes, have_workers=have_workers)
    assert e is not None
    return e


def _paths(state: ItemState) -> list[list[ItemState]]:
    """Every path from `state` to DISCARDED the table allows (DISCARDED ends a path)."""
    if state is S.DISCARDED:
        return [[state]]
    return [[state, *rest] for nxt in sorted(TRANSITIONS[state]) for rest in _paths(nxt)]


def _to(t: ItemTable, item_id: str, state: ItemState, nbytes: int = 10) -> None:
    """Bring an item to `state` along the main path (DISCARDED: begun, then dropped)."""
    _begin(t, item_id, nbytes=nbytes)
    main = [S.STAGED, S.MERGED, S.PREFILLED]
    for s in main[:main.index(state) + 1] if state in main else []:
        t.move(item_id, s, owner="r1")
    if state is S.FAILED:
        t.move(item_id, S.FAILED, why="boom")
    if state is S.DISCARDED:
        t.drop(item_id)


# -- the transition table --------------------------------------------------------------------

def test_the_design_names_and_the_main_path():
    assert [s.value for s in LIFECYCLE] == ["loading", "staged", "merged", "prefilled",
                                            "discarded"]
    assert [S.LOADING, S.STAGED, S.MERGED, S.PREFILLED, S.DISCARDED] in _paths(S.LOADING)
    assert [S.LOADING, S.FAILED, S.DISCARDED] in _paths(S.LOADING)
    assert frozenset({S.LOADING, S.STAGED}) == HELD


@pytest.mark.parametrize("path", _paths(S.LOADING), ids=lambda p: "-".join(s.name for s in p))
def test_every_legal_path_ends_with_no_bytes(path):
    t = table()
    _begin(t, "x", nbytes=100)
    assert t.by_state()["loading"] == 100
    for state in path[1:]:
        t.move("x", state, nbytes=120 if state is S.STAGED else None, owner="r1")
        assert t.state("x") is state
        if state is not S.DISCARDED:
            want = 0 if state is S.FAILED else 120 if state is not S.LOADING else 100
            assert t.by_state().get(state.value, 0) == want  # (FAILED: not listed)
            assert sum(t.by_state().values()) == t.get("x").nbytes
    assert t.by_state() == ZERO and len(t) == 0


@pytest.mark.parametrize("frm, to", ILLEGAL, ids=lambda s: s.name)
def test_every_illegal_transition_raises_and_changes_nothing(frm, to):
    t = table()
    _to(t, "x", frm)
    before = (t.state("x"), t.by_state(), len(t))
    with pytest.raises(IllegalTransition, match=f"{frm.name} -> {to.name}"):
        t.move("x", to)
    assert (t.state("x"), t.by_state(), len(t)) == before


def test_the_illegal_list_is_the_table_complement():
    # a back step or a skipped step is illegal; an untracked item only begins (LOADING)
    assert (S.STAGED, S.LOADING) in ILLEGAL and (S.LOADING, S.MERGED) in ILLEGAL
    assert (S.STAGED, S.PREFILLED) in ILLEGAL and (S.PREFILLED, S.MERGED) in ILLEGAL
    assert (S.FAILED, S.STAGED) in ILLEGAL and (S.MERGED, S.FAILED) in ILLEGAL
    assert all((S.DISCARDED, s) in ILLEGAL for s in S if s is not S.LOADING)
    assert len(ILLEGAL) == len(S) ** 2 - sum(len(v) for v in TRANSITIONS.values())


def test_a_refused_move_on_a_signal_drops_the_item_counts_and_reports_it(monkeypatch):
    """A signal whose move the table refuses is a bug: the item leaves the books, the
    error is counted and reported, nothing raises (no request fails for it)."""
    seen: list[str] = []
    t = ItemTable(5.0, 120.0, on_illegal=seen.append)
    _to(t, "a", S.MERGED)
    monkeypatch.setitem(items_mod.TRANSITIONS, S.MERGED, frozenset({S.DISCARDED}))
    t.prefilled("a")  # MERGED -> PREFILLED, refused by the patched table
    assert t.errors == 1 and t.state("a") is S.DISCARDED and t.by_state() == ZERO
    assert seen == ["item 'a': MERGED -> PREFILLED"]


def test_a_new_load_ends_the_earlier_life_and_an_untracked_item_is_discarded():
    t = table()
    assert t.state("never") is S.DISCARDED
    first = _begin(t, "x", nbytes=5)
    second = _begin(t, "x", nbytes=7)  # a retry: the earlier life ends first
    assert first.state is S.DISCARDED and t.get("x") is second
    assert t.by_state()["loading"] == 7
    t.drop("x")
    _begin(t, "x", nbytes=9)  # a new life once discarded
    assert t.by_state()["loading"] == 9


def test_bytes_per_state_sum_over_many_items_and_return_to_zero():
    t = table()
    for n, state in enumerate([S.LOADING, S.STAGED, S.MERGED, S.PREFILLED] * 3):
        _to(t, f"i{n}", state, nbytes=n + 1)
    by = t.by_state()
    assert by["loading"] == 1 + 5 + 9 and by["prefilled"] == 4 + 8 + 12
    assert t.held == by["loading"] + by["staged"] == sum(by[s.value] for s in HELD)
    assert sorted(i for i in (f"i{n}" for n in range(12)) if t.state(i) is S.MERGED) == [
        "i10", "i2", "i6"]
    for item_id in [f"i{n}" for n in range(12)]:
        t.drop(item_id)
    assert sum(t.by_state().values()) == 0 and len(t) == 0


def test_owner_and_real_size():
    t = table()
    _begin(t, "x")  # size unknown: nothing reserved
    assert t.staged("x", 0, True, 4, "", {0}, 0.1, nbytes=64) is S.STAGED
    assert t.merged("x", "req-1", 0.2) is t.get("x")
    assert t.get("x").owner == "req-1" and t.by_state()["merged"] == 64


@pytest.mark.parametrize("held, nbytes, budget, ok", [
    (0, 10, 5, True),  # nothing held: an item larger than the budget loads alone
    (3, 2, 5, True), (3, 3, 5, False), (5, 0, 5, True),
])
def test_fits(held, nbytes, budget, ok):
    assert fits(held, nbytes, budget) is ok


def test_begin_with_a_budget_refuses_what_does_not_fit():
    t = table()
    assert t.begin("a", 0.0, 10.0, nbytes=60, budget=100) is not None
    assert t.begin("b", 0.0, 10.0, nbytes=60, budget=100) is None
    assert t.state("b") is S.DISCARDED and t.held == 60


# -- loads: ranks, deadlines, failures (decide over the table) --------------------------------

def test_staged_only_once_every_rank_staged():
    t = table()
    _begin(t, "a")
    assert t.staged("a", 0, True, 16, "", RANKS, now=0.1) is None
    assert decide(t, "a", 16, now=0.1).verdict is Verdict.WAIT
    assert t.staged("a", 1, True, 16, "", RANKS, now=0.2) is S.STAGED
    assert decide(t, "a", 16, now=0.2).verdict is Verdict.READY


def test_one_failed_rank_fails_the_item_and_later_reports_change_nothing():
    t = table()
    _begin(t, "a", nbytes=50)
    assert t.staged("a", 0, False, 0, "checksum", RANKS, 0.1) is S.FAILED
    assert t.held == 0  # a failed load holds nothing
    assert t.staged("a", 1, True, 16, "", RANKS, 0.2) is None
    d = decide(t, "a", 16, 0.2)
    assert d.verdict is Verdict.UNAVAILABLE and d.why == "checksum" and not d.just_failed


def test_deadline_fails_a_loading_item_exactly_once():
    t = table()
    _begin(t, "a")
    assert decide(t, "a", 16, 10.0).verdict is Verdict.WAIT  # at the deadline: still waiting
    first = decide(t, "a", 16, 10.01)
    assert first.verdict is Verdict.UNAVAILABLE and first.why == DEADLINE_PASSED
    assert first.just_failed
    again = decide(t, "a", 16, 11.0)
    assert again.verdict is Verdict.UNAVAILABLE and not again.just_failed
    assert t.staged("a", 0, True, 16, "", RANKS, 11.0) is None  # too late: stays FAILED


def test_wrong_token_count_is_unavailable_not_placed():
    t = table()
    _begin(t, "a")
    t.staged("a", 0, True, 15, "", {0}, 0.1)
    d = decide(t, "a", 16, 0.2)
    assert d.verdict is Verdict.UNAVAILABLE and d.just_failed and "15" in d.why
    assert t.state("a") is S.FAILED


def test_no_workers_fails_at_once():
    t = table()
    e = _begin(t, "a", have_workers=False)
    assert e.state is S.FAILED and "no worker" in e.error


def test_a_placed_item_is_no_load_any_more():
    t = table()
    _begin(t, "a")
    t.staged("a", 0, True, 16, "", {0}, 0.1)
    t.want("a", "r1")
    t.merged("a", "r1", 0.2)
    assert t.current("a", 0.3) is None  # placed: a new request starts a new load
    assert decide(t, "a", 16, 0.3) == (Verdict.UNAVAILABLE, "not staged", False)
    assert not t.release("a", "r1")  # the placement took it: nothing to drop


def test_failed_items_are_remembered_then_forgotten():
    t = table()
    _begin(t, "a")
    t.staged("a", 0, False, 0, "boom", {0}, 1.0)
    assert t.current("a", 5.9) is not None  # within failed_memory_s: encode locally
    assert t.current("a", 6.1) is None  # forgotten: a new attempt may start
    assert t.get("a") is None


def test_sweep_drops_unplaced_staged_items_and_old_failures():
    t = table()
    _begin(t, "ready")
    t.staged("ready", 0, True, 16, "", {0}, 0.5)
    _begin(t, "failed")
    t.staged("failed", 0, False, 0, "x", {0}, 0.5)
    _begin(t, "loading", now=100.0)
    assert t.sweep(50.0) == []  # failure past its memory is forgotten silently
    assert t.get("failed") is None and len(t) == 2
    assert t.sweep(121.0) == ["ready"]  # staged memory to drop on the workers
    assert t.get("loading") is not None


def test_sweep_skips_items_that_moved_on_and_the_heap_stays_bounded():
    t = table()
    for n in range(500):  # staged and placed at once: their sweep entries go stale
        _begin(t, f"i{n}", now=float(n))
        t.staged(f"i{n}", 0, True, 1, "", {0}, float(n))
        t.merged(f"i{n}", "r", float(n))
    assert len(t._due) <= 2 * len(t) + 65
    assert t.sweep(10_000.0) == [] and len(t) == 500  # MERGED items are not swept


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["staged_ok", "staged_fail", "decide", "sweep",
                                           "begin", "forget", "merge", "free", "step"]),
                          st.integers(0, 2), st.floats(0, 30)), max_size=40))
def test_any_sequence_only_takes_allowed_transitions(ops):
    """Whatever order reports, deadlines, placements and sweeps come in, every observed
    change of an item's state is in TRANSITIONS (or a fresh life after it was forgotten),
    and the bytes per state are always the items' sum."""
    t = table()
    now = 0.0
    seen: dict[str, tuple[Item, ItemState]] = {}  # the object itself: ids get reused
    for op, rank, dt in ops:
        now += dt
        if op == "begin":
            if t.current("a", now) is None:
                _begin(t, "a", now=now, nbytes=rank * 10)
        elif op == "staged_ok":
            t.staged("a", rank, True, 16, "", RANKS, now, nbytes=32)
        elif op == "staged_fail":
            t.staged("a", rank, False, 0, "x", RANKS, now)
        elif op == "decide":
            if t.get("a") is not None:
                assert decide(t, "a", 16, now).verdict in Verdict
        elif op == "sweep":
            t.sweep(now)
        elif op == "merge":
            t.merged("a", "r", now)
        elif op == "free":
            t.prefilled("a", now)
        elif op == "step":
            t.end_step(now)
        else:
            t.drop("a")
        cur = t.get("a")
        if cur is not None:
            prev = seen.get("a")
            if prev is not None and prev[0] is cur and prev[1] is not cur.state:
                assert cur.state in TRANSITIONS[prev[1]]
            seen["a"] = (cur, cur.state)
        assert sum(t.by_state().values()) == (cur.nbytes if cur is not None else 0)
    assert t.errors == 0


def test_decisions_on_plain_values():
    assert covered(offset=4, length=16, num_computed_tokens=20)
    assert not covered(offset=4, length=16, num_computed_tokens=19)
    assert pull_location("evil:1", ["enc:15500"]) == ""
    assert pull_location("enc:15500", ["enc:15500"]) == "enc:15500"
    assert pull_location("any:1", []) == "any:1"  # no list configured: params may name it
    assert unavailable_action(promised=True, policy="fail") == "fail"
    assert unavailable_action(promised=False, policy="fail") == "local_encode"
    assert unavailable_action(promised=True, policy="local_encode") == "local_encode"


# -- waiters ---------------------------------------------------------------------------------

def test_a_copy_nobody_waits_for_is_dropped_at_the_end_of_the_step():
    t = table()
    _begin(t, "x")
    t.want("x", "r1")
    t.want("x", "r2")
    assert not t.release("x", "r1")  # r2 still waits
    assert t.release("x", "r2")  # the last waiter left a LOADING copy
    candidates = {"x"}
    assert t.unwanted(candidates, placed={}) == []  # still loading: kept as a candidate
    assert candidates == {"x"}
    t.staged("x", 0, True, 16, "", {0}, 0.1)
    assert t.unwanted(candidates, placed={}) == ["x"]  # landed: dropped, forgotten
    assert t.get("x") is None and candidates == set()


def test_an_unwanted_copy_placed_this_step_or_wanted_again_is_kept():
    t = table()
    for item in ("placed", "again"):
        _begin(t, item)
        t.want(item, "r1")
        t.staged(item, 0, True, 16, "", {0}, 0.1)
        assert t.release(item, "r1")
    t.want("again", "r2")
    candidates = {"placed", "again"}
    assert t.unwanted(candidates, placed={"placed": 16}) == []
    assert t.get("again") is not None and candidates == set()


# -- vLLM's signals: merged, prefilled, finished, evicted, the end of a step -------------------

def test_prefilled_items_are_discarded_at_the_end_of_the_step_and_evictions_at_once():
    t = table()
    for item_id, req in (("a", "r1"), ("b", "r2"), ("c", "r2")):
        _to(t, item_id, S.STAGED)
        t.merged(item_id, req, 0.0)
    t.prefilled("a")
    t.prefilled("never-merged")  # vLLM frees entries it encoded itself: not ours
    assert t.state("a") is S.PREFILLED and t.by_state()["prefilled"] == 10
    t.end_step()
    assert t.state("a") is S.DISCARDED
    t.finished("r2")  # ended before its prefill
    assert len(t) == 0 and t.errors == 0
    _to(t, "d", S.MERGED)
    t.evicted(["d", "unknown"])
    assert len(t) == 0 and t.by_state() == ZERO


class NoScan(dict):
    """A dict that refuses to be scanned and records the keys looked up in it."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.touched: list[str] = []

    def _scan(self, *_a):
        raise AssertionError("the whole table was scanned")

    __iter__ = keys = values = items = _scan  # type: ignore[assignment]

    def get(self, key, default=None):
        self.touched.append(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.touched.append(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.touched.append(key)
        return super().__contains__(key)


def _many(n: int) -> ItemTable:
    """`n` idle items: STAGED (nobody placed them yet), and MERGED for other requests."""
    t = table()
    for i in range(n):
        _begin(t, f"s{i}", now=1.0)
        t.staged(f"s{i}", 0, True, 4, "", {0}, 1.0, nbytes=8)
    for i in range(n):
        _begin(t, f"m{i}", now=1.0)
        t.staged(f"m{i}", 0, True, 4, "", {0}, 1.0, nbytes=8)
        t.merged(f"m{i}", f"other{i}", 1.0)
    t._items = NoScan(t._items)
    return t


def test_finished_touches_only_that_requests_items():
    t = _many(10_000)
    for item_id in ("x", "y"):
        _begin(t, item_id, now=2.0)
        t.staged(item_id, 0, True, 4, "", {0}, 2.0, nbytes=8)
        t.merged(item_id, "mine", 2.0)
    t._items.touched.clear()
    t.finished("mine")
    assert sorted(set(t._items.touched)) == ["x", "y"]
    assert t.state("x") is t.state("y") is S.DISCARDED and len(t) == 20_000
    t._items.touched.clear()
    t.finished("never-placed-anything")  # nothing placed for it: not even a lookup
    assert t._items.touched == []


def test_a_step_with_many_idle_items_does_constant_work(monkeypatch):
    """The per-step calls (evictions, unwanted copies, the sweep, the end of the step) with
    20,000 idle tracked items: the table is never scanned, no sweep entry is popped before
    it is due, and the bytes per state are read without summing items."""
    t = _many(10_000)
    pops = []
    real_pop = heapq.heappop
    monkeypatch.setattr(items_mod.heapq, "heappop", lambda h: pops.append(1) or real_pop(h))
    before = t.by_state()
    for now in (2.0, 3.0, 100.0):  # before any STAGED item is due (started 1 + 120 s)
        t.evicted([], now)
        assert t.unwanted(set(), placed={}) == []
        assert t.sweep(now) == []
        t.end_step(now)
        t.finished(f"idle-{now}")
        assert t.by_state() == before
    assert not pops and t._items.touched == []
    assert t.sweep(122.0) == [f"s{i}" for i in range(10_000)]  # due now: popped, dropped
    assert len(pops) == 20_000  # and the MERGED items' stale entries, once each
