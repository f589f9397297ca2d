"""The consumer's feature lifecycle inside the scheduler side, with a real worker, control
channel and safetensors store (as test_roles.py): a burst of loads under a small staging
budget waits for room instead of failing, never holds more than the budget, and every
state's bytes return to zero once vLLM (played here in its call order) is done."""

from __future__ import annotations

import time

import torch

from scheduler_hooks.item_table import LIFECYCLE, ItemState
from tests.ec_connectors.fakes import NUM_EMBEDS, request
from tests.ec_connectors.test_roles import Pair, produce, wait_until
from tests.ec_connectors.test_roles import pair_factory as pair_factory  # noqa: F401 (fixture)

S = ItemState
ZERO = dict.fromkeys([s.value for s in LIFECYCLE], 0)
ITEM_BYTES = NUM_EMBEDS * 32 * 4  # float32 [16, 32]


def _stored(prod: Pair, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Each item saved by the producer; its params once they describe the stored bytes."""
    params = {}
    for n, (item_id, x) in enumerate(tensors.items()):
        produce(prod, request(f"p{n}", item_id), {item_id: x})
        wait_until(lambda i=item_id: prod.sched.saves.info(i) is not None)
        again = request(f"q{n}", item_id)
        prod.sched.update_state_after_alloc(again, 0)
        params[item_id] = prod.sched.request_finished(again)
        assert params[item_id]["epd"]["items"][item_id]["nbytes"] == ITEM_BYTES
    return params


def _step(cons: Pair, waiting: list, done: dict, cache: dict) -> list:
    """One scheduler step as vLLM runs it: ask for every waiting request, allocate what is
    ready, build the metadata, place, then (after the step executed) free the prefilled
    entries and finish those requests. Returns the requests scheduled."""
    sched = cons.sched
    ready = [r for r in waiting if sched.ensure_cache_available(r, 0)]
    for r in ready:
        assert sched.has_cache_item(r.mm_features[0].identifier), "fell back to local encode"
        sched.update_state_after_alloc(r, 0)
    meta = sched.build_connector_meta()
    cons.worker.place(cache, meta.place, meta.inline)
    for r in ready:  # the step ran: prefill passed the item, the one-token request ends
        done[r.request_id] = cache[r.mm_features[0].identifier]
        sched.update_state_after_free(r, 0)
        sched.request_finished(r)
        waiting.remove(r)
    return ready


def test_a_burst_under_a_small_budget_waits_for_room_and_ends_at_zero(pair_factory):
    budget = 3 * ITEM_BYTES
    prod = pair_factory("producer")
    cons = pair_factory("consumer", max_staged_bytes=budget)
    tensors = {f"img{n}": torch.randn(NUM_EMBEDS, 32) for n in range(12)}
    params = _stored(prod, tensors)
    waiting = [request(f"c{n}", i, params=params[i]) for n, i in enumerate(tensors)]
    table, done, cache = cons.sched.items, {}, {}
    deadline = time.monotonic() + 20
    while waiting:
        assert time.monotonic() < deadline, f"{len(waiting)} requests still waiting"
        _step(cons, waiting, done, cache)
        assert table.held <= budget and cons.worker.staged_bytes <= budget
        time.sleep(0.002)
    cons.sched.build_connector_meta()  # the next step closes the books of the last ones
    for n, item_id in enumerate(tensors):  # none dropped, none encoded locally
        assert torch.equal(done[f"c{n}"], tensors[item_id])
    totals = cons.sched.stats.totals
    assert totals["budget_waits"] > 0 and not totals.get("local_encode_fallbacks")
    assert not totals.get("load_failures") and table.errors == 0
    assert table.peak_held <= budget and table.by_state() == ZERO
    assert cons.worker.staged_bytes == 0
    wait_until(lambda: cons.sched.stats.pending)  # the zeros wait for vLLM's next take
    assert cons.sched.stats.take().data["gauges"]["feature_bytes"] == ZERO


def test_each_vllm_signal_moves_an_item_one_step(pair_factory):
    prod, cons = pair_factory("producer"), pair_factory("consumer")
    tensors = {i: torch.randn(NUM_EMBEDS, 32) for i in ("a", "b", "c")}
    params = _stored(prod, tensors)
    sched, items = cons.sched, cons.sched.items
    reqs = {i: request(f"c-{i}", i, params=params[i]) for i in tensors}
    for r in reqs.values():
        cons.step_until_ready(r)
    assert items.by_state() == {**ZERO, "staged": 3 * ITEM_BYTES}
    cache: dict = {}
    for r in reqs.values():
        sched.has_cache_item(r.mm_features[0].identifier)
        sched.update_state_after_alloc(r, 0)
    cons.worker.place(cache, sched.build_connector_meta().place)
    assert items.by_state() == {**ZERO, "merged": 3 * ITEM_BYTES}
    sched.update_state_after_free(reqs["a"], 0)  # a's prefill passed it
    sched.request_finished(reqs["b"])  # b aborted before its prefill
    assert {i: items.state(i) for i in tensors} == {
        "a": S.PREFILLED, "b": S.DISCARDED, "c": S.MERGED}
    sched.build_connector_meta(evicted=["c"])  # vLLM evicted c (preempted, room needed)
    assert items.by_state() == ZERO and items.errors == 0


def test_an_item_that_never_finds_room_is_encoded_locally_at_its_deadline(pair_factory):
    prod = pair_factory("producer")
    cons = pair_factory("consumer", max_staged_bytes=ITEM_BYTES, load_timeout_s=0.3)
    tensors = {i: torch.randn(NUM_EMBEDS, 32) for i in ("held", "late")}
    params = _stored(prod, tensors)
    cons.step_until_ready(request("c1", "held", params=params["held"]))  # never scheduled
    late = request("c2", "late", params=params["late"])
    t0 = time.monotonic()
    steps = cons.step_until_ready(late)
    assert steps > 0 and 0.3 <= time.monotonic() - t0 < 3
    assert not cons.sched.has_cache_item("late")  # vLLM encodes it: not failed, not dropped
    assert cons.sched.stats.totals["budget_waits"] > 0
    assert cons.sched.take_unavailable_requests() == set()
    assert cons.sched.items.state("late") is S.DISCARDED
