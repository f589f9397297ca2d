"""Readiness and failure decisions of a consumer's scheduler, as pure functions of plain
values: is an item needed at all, where may it be pulled from, is a staged item usable
this step, and what happens to a request whose item cannot arrive."""

from __future__ import annotations

import enum
from typing import Literal, NamedTuple

from scheduler_hooks.staging import StagingTable, Status


class Verdict(enum.Enum):
    WAIT = "wait"  # still loading: defer the request this step
    READY = "ready"  # staged on every worker with the expected token count
    UNAVAILABLE = "unavailable"  # failed: local encode or fail the request


def covered(offset: int, length: int, num_computed_tokens: int) -> bool:
    """The item's placeholder tokens are all in the KV cache already: nothing to load."""
    return offset + length <= num_computed_tokens


def pull_location(hinted: str, allowed: list[str]) -> str:
    """The location a request names for an item, or "" when a list of producers is
    configured and it is not on it (params are client-controlled: never pull from there)."""
    return "" if hinted and allowed and hinted not in allowed else hinted


class Decision(NamedTuple):
    verdict: Verdict
    why: str = ""
    just_failed: bool = False  # this call failed it (deadline, token count): report it once


def decide(table: StagingTable, item_id: str, expected_embeds: int, now: float) -> Decision:
    """Where a staged item stands this step: applies its deadline, and fails a READY item
    whose token count differs from what the request expects."""
    st = table.get(item_id)
    if st is None:
        return Decision(Verdict.UNAVAILABLE, "not staged")
    if table.expire(st, now):
        return Decision(Verdict.UNAVAILABLE, st.error, just_failed=True)
    if st.status is Status.READY:
        if st.num_embeds and st.num_embeds != expected_embeds:
            failed = table.fail(st, f"token count: the item holds {st.num_embeds} "
                                f"embeddings, the request expects {expected_embeds}", now)
            return Decision(Verdict.UNAVAILABLE, st.error, just_failed=failed)
        return Decision(Verdict.READY)
    if st.status is Status.LOADING:
        return Decision(Verdict.WAIT)
    return Decision(Verdict.UNAVAILABLE, st.error)


def unavailable_action(promised: bool,
                       policy: Literal["local_encode", "fail"]) -> Literal["local_encode", "fail"]:
    """An item that cannot arrive: the request fails only when its params promised the item
    and the policy says so; otherwise vLLM encodes it locally (slower, never lost)."""
    return "fail" if promised and policy == "fail" else "local_encode"
