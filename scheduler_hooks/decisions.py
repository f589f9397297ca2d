"""Pure readiness and failure decisions of a consumer's scheduler.

Readiness and failure decisions of a consumer's scheduler, as pure functions of plain
values: the plan for one item of a request this step (`plan_item`: skip, use, wait, load,
encode locally or fail), is an item needed at all, where may it be pulled from, is a staged
item usable this step (`decide`, over the item table `item_table.py`), and what happens to a
request whose item cannot arrive."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, NamedTuple

from scheduler_hooks.fit import is_mismatch
from scheduler_hooks.item_table import DEADLINE_PASSED, ItemState, ItemTable


class Verdict(enum.Enum):
    WAIT = "wait"  # still loading: defer the request this step
    READY = "ready"  # STAGED on every worker with the expected token count
    UNAVAILABLE = "unavailable"  # failed: local encode or fail the request


def covered(offset: int, length: int, num_computed_tokens: int) -> bool:
    """The item's placeholder tokens are all in the KV cache already: nothing to load."""
    return offset + length <= num_computed_tokens


def pull_location(hinted: str, allowed: list[str]) -> str:
    """Check the location a request names against the configured producers.

    The location a request names for an item, or "" when a list of producers is
    configured and it is not on it (params are client-controlled: never pull from there)."""
    return "" if hinted and allowed and hinted not in allowed else hinted


class Decision(NamedTuple):
    verdict: Verdict
    why: str = ""
    just_failed: bool = False  # this call failed it (deadline, token count): report it once


def decide(table: ItemTable, item_id: str, expected_embeds: int, now: float) -> Decision:
    """Decide where an item's load stands this step.

    Where an item's load stands this step: applies its deadline, and fails a STAGED item
    whose token count differs from what the request expects."""
    st = table.get(item_id)
    if st is None or st.state not in (ItemState.LOADING, ItemState.STAGED, ItemState.FAILED):
        return Decision(Verdict.UNAVAILABLE, "not staged")
    if table.expire(st, now):
        return Decision(Verdict.UNAVAILABLE, st.error, just_failed=True)
    if st.state is ItemState.STAGED:
        if st.num_embeds and st.num_embeds != expected_embeds:
            failed = table.fail(st, f"token count: the item holds {st.num_embeds} "
                                f"embeddings, the request expects {expected_embeds}", now)
            return Decision(Verdict.UNAVAILABLE, st.error, just_failed=failed)
        return Decision(Verdict.READY)
    if st.state is ItemState.LOADING:
        return Decision(Verdict.WAIT)
    return Decision(Verdict.UNAVAILABLE, st.error)


def unavailable_action(promised: bool,
                       policy: Literal["local_encode", "fail"]) -> Literal["local_encode", "fail"]:
    """Choose what happens to a request whose item cannot arrive.

    An item that cannot arrive: the request fails only when its params promised the item
    and the policy says so; otherwise vLLM encodes it locally (slower, never lost)."""
    return "fail" if promised and policy == "fail" else "local_encode"


# -- the consumer's per-item plan --------------------------------------------------------------
# `ensure_cache_available` asks `plan_item` about every item of a request, every step. The
# plan is the whole policy; the scheduler gathers the facts and carries the plan out. Facts
# that cost something or change something (a store probe, starting a load, joining a
# staging) are not gathered up front: the plan asks for them with a step action (PROBE, LOAD,
# CHECK), the scheduler does it, fills the fact in and asks again (at most three rounds).

NOT_STORED = "not in the transport"
BUDGET_FULL = "staging budget full"


class Promise(enum.Enum):
    """A gateway's `pending` promise for the item (it sent the request while encoding it)."""

    NONE = "none"  # not promised (or the id is no valid key)
    WAITING = "waiting"  # not landed here yet, first looked at less than load_timeout_s ago
    LANDED = "landed"  # its save reached this process (or nothing here follows saves)
    EXPIRED = "expired"  # not landed within load_timeout_s


class Lookup(enum.Enum):
    """Whether the transport holds the item."""

    UNASKED = "unasked"  # nothing cheap says so: ask the transport (PROBE)
    YES = "yes"  # the request's params or the availability index name it, or a probe said so
    NO = "no"  # a probe said no, or the id can never be a key
    ASKING = "asking"  # the probe goes on in the background: look again next step


class ItemAction(enum.Enum):
    SKIP = "skip"  # vLLM has it (KV cache, its own encoder cache): nothing to load or wait for
    USE = "use"  # STAGED: has_cache_item says yes, the item is placed this step
    WAIT = "wait"  # defer the request this step
    LOCAL_ENCODE = "local_encode"  # vLLM encodes it from the request's media
    FAIL = "fail"  # the request fails (take_unavailable_requests)
    # steps: the scheduler does it, fills in the fact named, and asks again
    PROBE = "probe"  # ask the transport -> lookup
    LOAD = "load"  # start loading it -> staged, or over_budget (no room: nothing started)
    CHECK = "check"  # wait on its staging and `decide` where it stands -> decision


STEPS = frozenset({ItemAction.PROBE, ItemAction.LOAD, ItemAction.CHECK})


@dataclass(frozen=True, slots=True)
class ItemFacts:
    """What the scheduler knows about one item of one request, this step."""

    covered: bool = False  # its placeholder tokens are all in the KV cache (`covered`)
    in_engine_cache: bool = False  # vLLM's encoder cache holds it (as far as we saw)
    staged: bool = False  # a load of it is current (LOADING, STAGED, or FAILED recently)
    decision: Decision | None = None  # staged: `decide`'s answer (after CHECK)
    promise: Promise = Promise.NONE
    lookup: Lookup = Lookup.UNASKED
    hinted: bool = False  # the request's params name it (it was promised)
    metadata_only: bool = False  # no media in the request: vLLM cannot encode it
    policy: Literal["local_encode", "fail"] = "local_encode"  # config.on_unavailable
    reported: bool = False  # this request already fell back or failed on something
    load_timeout_s: float = 0.0  # how long a promise is waited for (named in the reason)
    over_budget: bool = False  # LOAD found no room in the staging budget (max_staged_bytes)
    budget_expired: bool = False  # ... and the request has waited load_timeout_s already
    mismatch: str = ""  # metadata-only: why the stored item does not fit the part (fit.py)


class ItemPlan(NamedTuple):
    action: ItemAction
    why: str = ""  # FAIL / LOCAL_ENCODE: the reason (refusals.classify reads it)
    defer: bool = False  # the request must not be scheduled this step
    report: bool = False  # an item that cannot arrive: log it, count it, post the reason
    failed_now: bool = False  # this look failed its load (deadline, token count): warn
    timeout: bool = False  # count a timeout
    promise: Promise = Promise.NONE  # the promise this plan went by (the caller times it)


def plan_item(f: ItemFacts) -> ItemPlan:
    """What to do about one item this step.

    Order: what vLLM has needs nothing; a staging in progress decides; a promise is waited for
    until it lands or expires; a known item is loaded (when the staging budget has room: else it
    waits, at most load_timeout_s, then is encoded by vLLM), an unknown one encoded by vLLM (or,
    with no media to encode, the request fails).

    A metadata-only item in vLLM's encoder cache is still staged: our view of that cache
    can be one step stale (vLLM evicts a free entry to make room for another request earlier
    in the same step), and vLLM then encodes the item itself, which, with no media, kills
    the engine (its sanity check: 0 embeddings for 1 item). Staged, has_cache_item says yes
    instead. If it cannot be staged, vLLM's cache is the way left (SKIP), unless the item
    does not fit the part (`mismatch`): then the request fails, whatever holds the item."""
    if f.covered or (f.in_engine_cache and not f.metadata_only):
        return ItemPlan(ItemAction.SKIP)
    if f.mismatch:
        return ItemPlan(ItemAction.FAIL, f.mismatch, defer=True, report=True,
                        promise=f.promise)
    if f.staged:
        return ItemPlan(ItemAction.CHECK) if f.decision is None else _settle(f, f.decision)
    if f.promise is Promise.WAITING:
        return ItemPlan(ItemAction.WAIT, "promised as pending", defer=True, promise=f.promise)
    if f.promise is Promise.EXPIRED:
        why = f"promised as pending, not stored within {f.load_timeout_s:g} s"
        return _unavailable(f, True, why)._replace(timeout=not f.reported, promise=f.promise)
    if f.lookup is Lookup.UNASKED:
        return ItemPlan(ItemAction.PROBE, promise=f.promise)
    if f.lookup is Lookup.ASKING:
        return ItemPlan(ItemAction.WAIT, "asking the transport", defer=True, promise=f.promise)
    if f.lookup is Lookup.NO:
        if f.metadata_only:
            return _unavailable(f, True, NOT_STORED)._replace(promise=f.promise)
        # nobody promised it: vLLM encodes it, as without EPD (nothing to report)
        return ItemPlan(ItemAction.LOCAL_ENCODE, NOT_STORED, promise=f.promise)
    if f.over_budget:
        return _over_budget(f)
    return ItemPlan(ItemAction.LOAD, promise=f.promise)


def _over_budget(f: ItemFacts) -> ItemPlan:
    """Plan an item that does not fit the staging budget: it waits for room.

    Backpressure: the item waits for room like an item still loading, never fails for the
    budget alone: past the wait vLLM encodes it (a metadata-only one, with no media, fails)."""
    if not f.budget_expired:
        return ItemPlan(ItemAction.WAIT, BUDGET_FULL, defer=True, promise=f.promise)
    why = f"{BUDGET_FULL} for {f.load_timeout_s:g} s"
    return _unavailable(f, f.metadata_only, why)._replace(timeout=not f.reported, promise=f.promise)


def _settle(f: ItemFacts, d: Decision) -> ItemPlan:
    if d.verdict is Verdict.READY:
        return ItemPlan(ItemAction.USE)
    if d.verdict is Verdict.WAIT:
        return ItemPlan(ItemAction.WAIT, "loading", defer=True)
    return _unavailable(f, f.metadata_only or f.hinted, d.why)._replace(
        failed_now=d.just_failed, timeout=d.just_failed and d.why == DEADLINE_PASSED)


def _unavailable(f: ItemFacts, promised: bool, why: str) -> ItemPlan:
    """An item that cannot arrive.

    A metadata-only one always fails the request (there is no media to encode) and is never
    scheduled without its embedding, unless vLLM's encoder cache holds it (and fits: a token
    count that does not fit fails it there too)."""
    if f.in_engine_cache and not (f.metadata_only and is_mismatch(why)):
        return ItemPlan(ItemAction.SKIP, why)
    policy = "fail" if f.metadata_only else f.policy
    action = (ItemAction.FAIL if unavailable_action(promised, policy) == "fail"
              else ItemAction.LOCAL_ENCODE)
    return ItemPlan(action, why, defer=f.metadata_only, report=True)


def lookup_of(answer: bool | None) -> Lookup:
    """A transport's probe answer as a Lookup."""
    return Lookup.ASKING if answer is None else Lookup.YES if answer else Lookup.NO
