"""The consumer scheduler's staging state machine and decisions, as pure logic (no vLLM,
no sockets): times are passed in, so every deadline is exact."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_hooks.decisions import (
    Verdict,
    covered,
    decide,
    pull_location,
    unavailable_action,
)
from scheduler_hooks.staging import (
    DEADLINE_PASSED,
    TRANSITIONS,
    IllegalTransition,
    Staging,
    StagingTable,
    Status,
)

RANKS = {0, 1}


def table() -> StagingTable:
    return StagingTable(failed_memory_s=5.0, ready_ttl_s=120.0)


def test_ready_only_once_every_rank_staged():
    t = table()
    t.begin("a", now=0.0, timeout_s=10.0, have_workers=True)
    assert t.staged("a", 0, True, 16, "", RANKS, now=0.1) is None
    assert decide(t, "a", 16, now=0.1).verdict is Verdict.WAIT
    assert t.staged("a", 1, True, 16, "", RANKS, now=0.2) is Status.READY
    assert decide(t, "a", 16, now=0.2).verdict is Verdict.READY


def test_one_failed_rank_fails_the_item_and_later_reports_change_nothing():
    t = table()
    t.begin("a", 0.0, 10.0, True)
    assert t.staged("a", 0, False, 0, "checksum", RANKS, 0.1) is Status.FAILED
    assert t.staged("a", 1, True, 16, "", RANKS, 0.2) is None
    d = decide(t, "a", 16, 0.2)
    assert d.verdict is Verdict.UNAVAILABLE and d.why == "checksum" and not d.just_failed


def test_deadline_fails_a_loading_item_exactly_once():
    t = table()
    t.begin("a", 0.0, 10.0, True)
    assert decide(t, "a", 16, 10.0).verdict is Verdict.WAIT  # at the deadline: still waiting
    first = decide(t, "a", 16, 10.01)
    assert first.verdict is Verdict.UNAVAILABLE and first.why == DEADLINE_PASSED
    assert first.just_failed
    again = decide(t, "a", 16, 11.0)
    assert again.verdict is Verdict.UNAVAILABLE and not again.just_failed
    assert t.staged("a", 0, True, 16, "", RANKS, 11.0) is None  # too late: stays FAILED


def test_wrong_token_count_is_unavailable_not_placed():
    t = table()
    t.begin("a", 0.0, 10.0, True)
    t.staged("a", 0, True, 15, "", {0}, 0.1)
    d = decide(t, "a", 16, 0.2)
    assert d.verdict is Verdict.UNAVAILABLE and d.just_failed and "15" in d.why
    assert t.get("a").status is Status.FAILED


def test_no_workers_fails_at_once():
    t = table()
    st_ = t.begin("a", 0.0, 10.0, have_workers=False)
    assert st_.status is Status.FAILED and "no worker" in st_.error


def test_failed_items_are_remembered_then_forgotten():
    t = table()
    t.begin("a", 0.0, 10.0, True)
    t.staged("a", 0, False, 0, "boom", {0}, 1.0)
    assert t.current("a", 5.9) is not None  # within failed_memory_s: encode locally
    assert t.current("a", 6.1) is None  # forgotten: a new attempt may start
    assert t.get("a") is None


def test_sweep_drops_unplaced_ready_items_and_old_failures():
    t = table()
    t.begin("ready", 0.0, 10.0, True)
    t.staged("ready", 0, True, 16, "", {0}, 0.5)
    t.begin("failed", 0.0, 10.0, True)
    t.staged("failed", 0, False, 0, "x", {0}, 0.5)
    t.begin("loading", 100.0, 10.0, True)
    assert t.sweep(50.0) == []  # failure past its memory is forgotten silently
    assert t.get("failed") is None and len(t) == 2
    assert t.sweep(121.0) == ["ready"]  # staged memory to drop on the workers
    assert t.get("loading") is not None


def test_transition_table_is_enforced():
    s = Staging(Status.LOADING, 0.0, 1.0)
    s.move(Status.READY, 0.5)
    with pytest.raises(IllegalTransition):
        s.move(Status.LOADING, 0.6)
    s.move(Status.FAILED, 0.7, "token count")
    for to in Status:
        with pytest.raises(IllegalTransition):
            s.move(to, 0.8)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["staged_ok", "staged_fail", "decide", "sweep",
                                           "begin", "forget"]),
                          st.integers(0, 2), st.floats(0, 30)), max_size=40))
def test_any_sequence_only_takes_allowed_transitions(ops):
    """Whatever order reports, deadlines and sweeps come in, every observed change of an
    item's status is in TRANSITIONS (or a fresh attempt after the item was forgotten)."""
    t = table()
    now = 0.0
    seen: dict[str, tuple[Staging, Status]] = {}  # the object itself: ids get reused
    for op, rank, dt in ops:
        now += dt
        if op == "begin":
            if t.current("a", now) is None:
                t.begin("a", now, 10.0, True)
        elif op == "staged_ok":
            t.staged("a", rank, True, 16, "", RANKS, now)
        elif op == "staged_fail":
            t.staged("a", rank, False, 0, "x", RANKS, now)
        elif op == "decide":
            if t.get("a") is not None:
                assert decide(t, "a", 16, now).verdict in Verdict
        elif op == "sweep":
            t.sweep(now)
        else:
            t.forget("a")
        cur = t.get("a")
        if cur is not None:
            prev = seen.get("a")
            if prev is not None and prev[0] is cur and prev[1] is not cur.status:
                assert cur.status in TRANSITIONS[prev[1]]
            seen["a"] = (cur, cur.status)


def test_decisions_on_plain_values():
    assert covered(offset=4, length=16, num_computed_tokens=20)
    assert not covered(offset=4, length=16, num_computed_tokens=19)
    assert pull_location("evil:1", ["enc:15500"]) == ""
    assert pull_location("enc:15500", ["enc:15500"]) == "enc:15500"
    assert pull_location("any:1", []) == "any:1"  # no list configured: params may name it
    assert unavailable_action(promised=True, policy="fail") == "fail"
    assert unavailable_action(promised=False, policy="fail") == "local_encode"
    assert unavailable_action(promised=True, policy="local_encode") == "local_encode"


def test_a_copy_nobody_waits_for_is_dropped_at_the_end_of_the_step():
    t = table()
    t.begin("x", 0.0, 10.0, True)
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
        t.begin(item, 0.0, 10.0, True)
        t.want(item, "r1")
        t.staged(item, 0, True, 16, "", {0}, 0.1)
        assert t.release(item, "r1")
    t.want("again", "r2")
    candidates = {"placed", "again"}
    assert t.unwanted(candidates, placed={"placed": 16}) == []
    assert t.get("again") is not None and candidates == set()
