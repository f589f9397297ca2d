"""The consumer's per-item plan (`plan_item`), as a pure function: a table of the cases that
matter, then every combination of facts, probe answers and staging decisions, run through the
same loop the scheduler runs (steps until an outcome), against the rules it must keep."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from scheduler_hooks.decisions import (
    BUDGET_FULL,
    NOT_STORED,
    STEPS,
    Decision,
    ItemAction,
    ItemFacts,
    Lookup,
    Promise,
    Verdict,
    lookup_of,
    plan_item,
)
from scheduler_hooks.item_table import DEADLINE_PASSED

A = ItemAction
READY, LOADING = Decision(Verdict.READY), Decision(Verdict.WAIT)
LATE = Decision(Verdict.UNAVAILABLE, DEADLINE_PASSED, just_failed=True)
WRONG = Decision(Verdict.UNAVAILABLE, "token count: 3 vs 4", just_failed=True)
FAILED = Decision(Verdict.UNAVAILABLE, "a worker failed")  # failed earlier, remembered
DECISIONS = (READY, LOADING, LATE, WRONG, FAILED, Decision(Verdict.UNAVAILABLE, "not staged"))


def run(facts: ItemFacts, probe: bool | None = True, decision: Decision = READY,
        room: bool = True, expired: bool = False):
    """The scheduler's loop: take each step the plan asks for, fill in its fact, ask again.
    `room`: whether the staging budget takes a load; `expired`: the request waited too long."""
    steps = []
    plan = plan_item(facts)
    while plan.action in STEPS:
        assert plan.action not in steps, f"{plan.action} asked twice"
        steps.append(plan.action)
        if plan.action is A.PROBE:
            facts = dataclasses.replace(facts, lookup=lookup_of(probe))
        elif plan.action is A.LOAD:
            facts = dataclasses.replace(facts, staged=room, over_budget=not room,
                                        budget_expired=expired)
        else:
            facts = dataclasses.replace(facts, decision=decision)
        plan = plan_item(facts)
    return steps, plan


@pytest.mark.parametrize("facts, probe, decision, steps, action, defer", [
    # vLLM has it: nothing else matters, nothing is asked
    (ItemFacts(covered=True, staged=True, promise=Promise.EXPIRED), None, LATE, [], A.SKIP,
     False),
    (ItemFacts(in_engine_cache=True), None, LATE, [], A.SKIP, False),
    # ... but a metadata-only item is staged all the same (our view of vLLM's cache can be a
    # step stale, and vLLM encoding it with no media kills the engine); if it cannot be
    # staged, vLLM's cache is the way left
    (ItemFacts(in_engine_cache=True, metadata_only=True, lookup=Lookup.YES), None, READY,
     [A.LOAD, A.CHECK], A.USE, False),
    (ItemFacts(in_engine_cache=True, metadata_only=True, lookup=Lookup.YES), None, LATE,
     [A.LOAD, A.CHECK], A.SKIP, False),
    (ItemFacts(in_engine_cache=True, metadata_only=True, lookup=Lookup.NO), None, READY, [],
     A.SKIP, False),
    # named by the params or the index: loaded, then the staging decides
    (ItemFacts(lookup=Lookup.YES, hinted=True), None, READY, [A.LOAD, A.CHECK], A.USE, False),
    (ItemFacts(lookup=Lookup.YES), None, LOADING, [A.LOAD, A.CHECK], A.WAIT, True),
    # already staged: no new load
    (ItemFacts(staged=True, lookup=Lookup.YES), None, READY, [A.CHECK], A.USE, False),
    # unknown: the store is asked; no, it is encoded by vLLM, quietly; asking: wait
    (ItemFacts(), False, READY, [A.PROBE], A.LOCAL_ENCODE, False),
    (ItemFacts(), None, READY, [A.PROBE], A.WAIT, True),
    (ItemFacts(), True, READY, [A.PROBE, A.LOAD, A.CHECK], A.USE, False),
    # unknown and metadata-only: nothing to encode it from
    (ItemFacts(lookup=Lookup.NO, metadata_only=True), None, READY, [], A.FAIL, True),
    # a promise: waited for without asking anybody, loaded once landed
    (ItemFacts(promise=Promise.WAITING, hinted=True, lookup=Lookup.YES), None, READY, [],
     A.WAIT, True),
    (ItemFacts(promise=Promise.LANDED, hinted=True, lookup=Lookup.YES), None, READY,
     [A.LOAD, A.CHECK], A.USE, False),
    (ItemFacts(promise=Promise.EXPIRED, hinted=True, lookup=Lookup.YES), None, READY, [],
     A.LOCAL_ENCODE, False),
    (ItemFacts(promise=Promise.EXPIRED, hinted=True, policy="fail"), None, READY, [], A.FAIL,
     False),
    # a load that fails: local encode, or fail where promised and the policy says so
    (ItemFacts(staged=True, hinted=True), None, LATE, [A.CHECK], A.LOCAL_ENCODE, False),
    (ItemFacts(staged=True, hinted=True, policy="fail"), None, LATE, [A.CHECK], A.FAIL, False),
    (ItemFacts(staged=True, policy="fail"), None, LATE, [A.CHECK], A.LOCAL_ENCODE, False),
    (ItemFacts(staged=True, metadata_only=True), None, WRONG, [A.CHECK], A.FAIL, True),
])
def test_the_plan_for_each_case(facts, probe, decision, steps, action, defer):
    got_steps, plan = run(facts, probe, decision)
    assert (got_steps, plan.action, plan.defer) == (steps, action, defer)


@pytest.mark.parametrize("facts, expired, action, defer", [
    # no room in the staging budget: the request waits, as for an item still loading
    (ItemFacts(lookup=Lookup.YES, hinted=True), False, A.WAIT, True),
    (ItemFacts(lookup=Lookup.YES, metadata_only=True), False, A.WAIT, True),
    # waited load_timeout_s: vLLM encodes it, even where the policy fails late loads
    (ItemFacts(lookup=Lookup.YES, hinted=True, policy="fail"), True, A.LOCAL_ENCODE, False),
    (ItemFacts(promise=Promise.LANDED, hinted=True, lookup=Lookup.YES, policy="fail"), True,
     A.LOCAL_ENCODE, False),
    # ... but a metadata-only item has no media to encode
    (ItemFacts(lookup=Lookup.YES, metadata_only=True), True, A.FAIL, True),
])
def test_an_item_over_the_budget_waits_then_is_encoded(facts, expired, action, defer):
    steps, plan = run(facts, room=False, expired=expired)
    assert (steps, plan.action, plan.defer) == ([A.LOAD], action, defer)
    assert plan.why.startswith(BUDGET_FULL)
    assert plan.report == expired and plan.timeout == expired


def test_a_budget_wait_is_counted_as_a_timeout_once():
    facts = ItemFacts(lookup=Lookup.YES, over_budget=True, budget_expired=True, reported=True,
                      load_timeout_s=2.0)
    plan = plan_item(facts)
    assert plan.why == f"{BUDGET_FULL} for 2 s" and not plan.timeout


def test_the_reasons_and_counts_a_plan_carries():
    _, plan = run(ItemFacts(staged=True), decision=LATE)
    assert plan.why == DEADLINE_PASSED and plan.failed_now and plan.timeout and plan.report
    _, plan = run(ItemFacts(staged=True), decision=WRONG)
    assert plan.failed_now and not plan.timeout
    _, plan = run(ItemFacts(staged=True), decision=FAILED)  # another look already failed it
    assert not plan.failed_now and not plan.timeout and plan.report
    plan = plan_item(ItemFacts(promise=Promise.EXPIRED, hinted=True, load_timeout_s=2.5))
    assert plan.why == "promised as pending, not stored within 2.5 s" and plan.timeout
    assert plan.promise is Promise.EXPIRED
    assert not plan_item(ItemFacts(promise=Promise.EXPIRED, reported=True)).timeout
    assert plan_item(ItemFacts(lookup=Lookup.NO)).why == NOT_STORED
    assert plan_item(ItemFacts(promise=Promise.LANDED, lookup=Lookup.YES)).promise is \
        Promise.LANDED


def _all_facts():
    for (cov, cache, staged, promise, lookup, hinted, meta, policy,
         reported) in itertools.product((False, True), (False, True), (False, True), Promise,
                                        Lookup, (False, True), (False, True),
                                        ("local_encode", "fail"), (False, True)):
        yield ItemFacts(covered=cov, in_engine_cache=cache, staged=staged, promise=promise,
                        lookup=lookup, hinted=hinted, metadata_only=meta, policy=policy,
                        reported=reported, load_timeout_s=1.0)


def test_every_combination_keeps_the_rules():
    seen = set()
    for facts in _all_facts():
        for probe, decision, room, expired in itertools.product(
                (True, False, None), DECISIONS, (True, False), (False, True)):
            steps, plan = run(facts, probe, decision, room, expired)
            action = plan.action
            seen.add(action)
            assert len(steps) <= 3 and action not in STEPS
            if facts.covered or (facts.in_engine_cache and not facts.metadata_only):
                assert (steps, action) == ([], A.SKIP)  # vLLM has it
                continue
            # a metadata-only item in vLLM's cache: SKIP only when it could not be staged
            assert action is not A.SKIP or (facts.in_engine_cache and facts.metadata_only
                                             and action is not A.USE)
            # ... and a request fails there only when the item does not fit its part
            assert not (facts.in_engine_cache and action is A.FAIL) or (
                facts.metadata_only and plan.why == WRONG.why)
            # never scheduled without its embedding when there is no media to encode
            assert not (facts.metadata_only and action is A.LOCAL_ENCODE)
            assert plan.defer == (action is A.WAIT or (action is A.FAIL and facts.metadata_only))
            # a request fails only with no media, or when promised and the policy says so
            if action is A.FAIL:
                assert facts.metadata_only or (facts.policy == "fail" and (
                    facts.hinted or facts.promise is not Promise.NONE))
            # a load starts only for an item known to be there, not staged, not waited for
            if A.LOAD in steps:
                assert not facts.staged and facts.promise in (Promise.NONE, Promise.LANDED)
                assert facts.lookup is Lookup.YES or (A.PROBE in steps and probe)
            # the store is asked only about what nothing cheap knows
            if A.PROBE in steps:
                assert facts.lookup is Lookup.UNASKED and not facts.staged
            if facts.promise is Promise.WAITING and not facts.staged:
                assert (steps, action) == ([], A.WAIT)
            # only an item nobody promised falls back without a report
            if action in (A.LOCAL_ENCODE, A.FAIL):
                assert plan.report or (action is A.LOCAL_ENCODE and plan.why == NOT_STORED)
            elif action is A.SKIP:  # served by vLLM's cache: nothing to report (a failed
                assert not plan.report  # load is still warned about and counted)
            else:
                assert not plan.report and not plan.timeout and not plan.failed_now
            if plan.timeout:
                assert (plan.why == DEADLINE_PASSED or (
                    facts.promise is Promise.EXPIRED and not facts.reported)
                    or (plan.why.startswith(BUDGET_FULL) and not facts.reported))
            # no room in the budget: never loaded, never failed for it (but with no media)
            if A.LOAD in steps and not room:
                assert action is A.WAIT if not expired else (
                    A.FAIL if facts.metadata_only else A.LOCAL_ENCODE)
    assert seen == {A.SKIP, A.USE, A.WAIT, A.LOCAL_ENCODE, A.FAIL}
