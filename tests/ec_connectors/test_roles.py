"""Scheduler-side and worker-side objects together, in one process, over the real control
channel (ZMQ unix sockets) and the real safetensors transport. vLLM's Request is replaced
by a small stand-in: this tests the logic around vLLM, the e2e tests prove it inside vLLM."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from ec_connectors.config import EPDConfig
from ec_connectors.control.endpoint import control_address
from ec_connectors.sched.scheduler import EPDSchedulerSide
from ec_connectors.transports import make_transport
from ec_connectors.workers.worker import EPDWorker
from scheduler_hooks.item_table import ItemState
from tests.ec_connectors.fakes import NUM_EMBEDS, request
from tests.helpers import wait_for


class Pair:
    """A scheduler side and one worker of the same role, like one vLLM instance."""

    def __init__(self, tmp: Path, ctl: str, role: str, placeholders=None, **extra):
        # The workers' path unless a test asks for inline reads (test_inline_*).
        cfg = EPDConfig.from_dict({"storage_path": str(tmp / "store"), "namespace": "m",
                                   "control_dir": ctl, "scan_interval_s": 0.05,
                                   "inline_max_bytes": 0, **extra})
        producer, consumer = role in ("producer", "both"), role in ("consumer", "both")
        addr = control_address(ctl, f"engine-{role}", 0)
        self.sched = EPDSchedulerSide(cfg, make_transport(cfg), is_producer=producer,
                                      is_consumer=consumer, address=addr, engine_id=role,
                                      placeholders=placeholders)
        self.worker = EPDWorker(cfg, make_transport(cfg), is_producer=producer,
                                is_consumer=consumer, address=addr, rank=0,
                                device=torch.device("cpu"))
        wait_until(lambda: self.sched.num_workers == 1)

    def close(self):
        self.worker.close()
        self.sched.close()

    def step_until_ready(self, req, timeout=5.0) -> int:
        """Call ensure_cache_available like vLLM's scheduler loop; returns steps deferred."""
        steps = 0
        deadline = time.monotonic() + timeout
        while not self.sched.ensure_cache_available(req, 0):
            steps += 1
            assert time.monotonic() < deadline, "request deferred forever"
            time.sleep(0.005)
        return steps

    def schedule(self, req) -> tuple[dict, dict[str, torch.Tensor]]:
        """has_cache_item + alloc for every feature, then build meta and place: one step."""
        for i, f in enumerate(req.mm_features):
            if self.sched.has_cache_item(f.identifier):
                self.sched.update_state_after_alloc(req, i)
        meta = self.sched.build_connector_meta()
        cache: dict[str, torch.Tensor] = {}
        self.worker.place(cache, meta.place, meta.inline)
        return meta.place, cache


def wait_until(pred, timeout=5.0):
    assert wait_for(pred, timeout), "condition not reached"


@pytest.fixture
def pair_factory(tmp_path, ctl_dir):
    made = []

    def make(role, **extra):
        p = Pair(tmp_path, ctl_dir, role, **extra)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def produce(pair: Pair, req, tensors: dict[str, torch.Tensor]) -> dict:
    for i, f in enumerate(req.mm_features):
        assert not pair.sched.has_cache_item(f.identifier)
        pair.sched.update_state_after_alloc(req, i)
        pair.worker.save(f.identifier, tensors[f.identifier])
    assert pair.worker.flush()
    return pair.sched.request_finished(req)


def test_producer_to_consumer_round_trip(pair_factory):
    prod, cons = pair_factory("producer"), pair_factory("consumer")
    x = torch.randn(NUM_EMBEDS, 32).bfloat16()
    params = produce(prod, request("p1", "img"), {"img": x})
    assert params["epd"]["items"]["img"]["num_embeds"] == NUM_EMBEDS
    # once the save is reported, the producer's params describe the stored bytes too
    later = request("p2", "img")
    prod.sched.update_state_after_alloc(later, 0)
    wait_until(lambda: prod.sched.saves.info("img") is not None)
    described = prod.sched.request_finished(later)["epd"]["items"]["img"]
    assert described["nbytes"] == x.numel() * 2 and described["shape"] == [NUM_EMBEDS, 32]
    assert len(described["checksum"]) == 16

    req = request("c1", "img", params=params)
    assert not cons.sched.has_cache_item("img")  # nothing staged before ensure
    cons.step_until_ready(req)
    meta, cache = cons.schedule(req)
    assert meta == {"img": NUM_EMBEDS}
    assert torch.equal(cache["img"], x)
    assert cons.worker.staged_bytes == 0  # moved, not copied
    assert cons.worker.get_finished() == (None, {"img"})
    # worker-side counters reach the scheduler side (vLLM publishes the scheduler's stats)
    wait_until(lambda: cons.sched.stats.totals.get("loads") == 1)
    wait_until(lambda: prod.sched.stats.totals.get("saves") == 1)
    # Once handed over, later steps of the same request are not deferred again.
    assert cons.sched.ensure_cache_available(req, 0)


def test_an_item_the_prefix_cache_covers_is_neither_waited_for_nor_moved(pair_factory):
    """vLLM passes num_computed_tokens with its prefix-cache hit: an item whose tokens are
    all inside it needs no embedding, even one a producer promised."""
    prod, cons = pair_factory("producer"), pair_factory("consumer")
    params = produce(prod, request("p1", "img"), {"img": torch.randn(NUM_EMBEDS, 32)})
    req = request("c1", "img", params=params)
    pos = req.mm_features[0].mm_position
    assert cons.sched.ensure_cache_available(req, pos.offset + pos.length)
    assert cons.sched.stats.totals.get("prefix_cached") == 1
    assert not cons.sched.has_cache_item("img") and len(cons.sched.items) == 0
    time.sleep(0.2)
    assert cons.worker.staged_bytes == 0 and not cons.sched.stats.totals.get("loads")


def test_consumer_finds_items_without_params_through_the_index(pair_factory):
    prod, cons = pair_factory("producer"), pair_factory("consumer")
    x = torch.randn(NUM_EMBEDS, 8)
    produce(prod, request("p", "img"), {"img": x})
    req = request("c", "img")
    wait_until(lambda: cons.sched.ensure_cache_available(req, 0) is False
             or cons.sched.items.get("img") is not None)
    cons.step_until_ready(req)
    _, cache = cons.schedule(req)
    assert torch.equal(cache["img"], x)


def test_unknown_item_is_encoded_locally_without_waiting(pair_factory):
    cons = pair_factory("consumer")
    req = request("c", "never-seen")
    assert cons.sched.ensure_cache_available(req, 0)
    assert not cons.sched.has_cache_item("never-seen")


def test_promised_item_that_never_lands_times_out_to_local_encode(pair_factory):
    cons = pair_factory("consumer", load_timeout_s=0.3)
    req = request("c", "ghost", params={"epd": {"items": ["ghost"]}})
    t0 = time.monotonic()
    steps = cons.step_until_ready(req, timeout=5)
    assert steps > 0 and time.monotonic() - t0 < 3
    assert not cons.sched.has_cache_item("ghost")  # vLLM will encode it
    assert cons.sched.take_unavailable_requests() == set()


def test_fail_policy_fails_the_request_with_its_id(pair_factory):
    cons = pair_factory("consumer", load_timeout_s=0.2, on_unavailable="fail")
    req = request("doomed", "ghost", params={"epd": {"items": ["ghost"]}})
    cons.step_until_ready(req)
    assert cons.sched.take_unavailable_requests() == {"doomed"}
    assert cons.sched.take_unavailable_requests() == set()


@pytest.mark.parametrize("inline", [0, 1 << 20], ids=["workers", "inline"])
def test_corrupt_file_falls_back_to_local_encode(pair_factory, inline):
    """A damaged file is a miss on either path (the inline read hands it to the workers,
    which count it): vLLM encodes the item."""
    prod, cons = pair_factory("producer"), pair_factory("consumer", inline_max_bytes=inline)
    params = produce(prod, request("p", "img"), {"img": torch.randn(NUM_EMBEDS, 8)})
    path = prod.worker.transport.path_for("img")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x55
    path.write_bytes(bytes(data))
    req = request("c", "img", params=params)
    cons.step_until_ready(req)
    assert not cons.sched.has_cache_item("img")
    assert cons.sched.items.state("img") is ItemState.FAILED


@pytest.mark.parametrize("inline", [0, 1 << 20], ids=["workers", "inline"])
def test_token_count_mismatch_is_not_placed(pair_factory, inline):
    prod, cons = pair_factory("producer"), pair_factory("consumer", inline_max_bytes=inline)
    params = produce(prod, request("p", "img"), {"img": torch.randn(NUM_EMBEDS + 3, 8)})
    req = request("c", "img", params=params)
    cons.step_until_ready(req)
    assert not cons.sched.has_cache_item("img")


def test_producer_skips_items_already_stored_and_renews_them(pair_factory):
    prod = pair_factory("producer")
    produce(prod, request("p", "img"), {"img": torch.randn(NUM_EMBEDS, 8)})
    path = prod.worker.transport.path_for("img")
    wait_until(path.exists)
    old = time.time() - 3600
    os.utime(path, (old, old))  # as if stored an hour ago: first in line for LRU eviction
    wait_until(lambda: prod.sched.has_cache_item("img"))
    # vLLM skips the encode (no save), but the item is promised again: it is young again.
    wait_until(lambda: path.stat().st_mtime > old + 3000)


def test_an_item_larger_than_the_staging_budget_loads_alone(pair_factory):
    """One rule for the budget on both sides (`scheduler_hooks.item_table.fits`): the scheduler
    starts the load of an item larger than `max_staged_bytes` when nothing is held, and the
    worker stages it (it once refused it, 'staging full (0 of 1024 bytes)': the item was
    pulled, thrown away, then encoded locally)."""
    prod = pair_factory("producer")
    cons = pair_factory("consumer", max_staged_bytes=1024)
    big = torch.randn(NUM_EMBEDS, 64)  # 4 KiB
    params = produce(prod, request("p", "big"), {"big": big})
    req = request("c", "big", params=params)
    cons.step_until_ready(req)
    assert cons.sched.items.state("big") is ItemState.STAGED
    assert cons.sched.has_cache_item("big")
    assert cons.worker.staged_bytes == big.nbytes
    place, cache = cons.schedule(req)
    assert torch.equal(cache["big"], big)
    assert cons.worker.staged_bytes == 0


def test_the_worker_stages_beyond_the_budget_only_with_nothing_staged(pair_factory):
    """The worker's side of the rule: an oversized item with nothing staged is staged; with
    something staged, an item that does not fit is refused ('staging full')."""
    from ec_connectors.control.messages import Prefetch

    prod, cons = pair_factory("producer"), pair_factory("consumer", max_staged_bytes=1024)
    big, small = torch.randn(NUM_EMBEDS, 64), torch.randn(NUM_EMBEDS, 8)  # 4 KiB, 512 B
    produce(prod, request("p1", "big"), {"big": big})
    produce(prod, request("p2", "small"), {"small": small})
    cons.worker._prefetch([Prefetch(item_id="big", timeout_s=5.0)], time.perf_counter())
    assert cons.worker.staged_bytes == big.nbytes  # nothing staged before: loads alone
    cons.worker._prefetch([Prefetch(item_id="small", timeout_s=5.0)], time.perf_counter())
    assert cons.worker.staged_bytes == big.nbytes  # 4 KiB held: 512 B more does not fit
    cons.worker.place({}, {"big": NUM_EMBEDS})
    cons.worker._prefetch([Prefetch(item_id="small", timeout_s=5.0)], time.perf_counter())
    assert cons.worker.staged_bytes == small.nbytes


def test_garbled_control_message_is_dropped(pair_factory, ctl_dir):
    import zmq

    cons = pair_factory("consumer", load_timeout_s=0.3)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(cons.sched.channel.address)
    sock.send(b"\x93garbage")
    wait_until(lambda: cons.sched.channel.bad_frames == 1)
    sock.close(0)
    req = request("c", "x", params={"epd": {"items": ["x"]}})
    cons.step_until_ready(req)  # still serving: the prefetch runs and times out normally
    assert cons.sched.items.state("x") is ItemState.FAILED


def test_second_request_for_an_item_in_vllms_cache_neither_waits_nor_loads(pair_factory):
    prod, cons = pair_factory("producer"), pair_factory("consumer")
    params = produce(prod, request("p", "img"), {"img": torch.randn(NUM_EMBEDS, 8)})
    first = request("c1", "img", params=params)
    cons.step_until_ready(first)
    cons.schedule(first)  # placed: vLLM's encoder cache now holds it
    second = request("c2", "img", params=params)
    assert cons.sched.ensure_cache_available(second, 0)  # no deferral, no prefetch
    assert cons.sched.items.state("img") is ItemState.MERGED  # placed for c1: no new load
    assert cons.sched.stats.totals["engine_cache_hits"] == 1
    cons.sched.build_connector_meta(evicted=["img"])  # vLLM evicted it: load it again
    third = request("c3", "img", params=params)
    # (not asserting a deferral: the worker may stage a tiny item before the scheduler looks)
    cons.sched.ensure_cache_available(third, 0)
    assert cons.sched.items.state("img") in (ItemState.LOADING, ItemState.STAGED)  # a new load
    assert cons.sched.stats.totals["engine_cache_hits"] == 1
    cons.step_until_ready(third)
    placed, cache = cons.schedule(third)
    assert placed == {"img": NUM_EMBEDS} and "img" in cache


def test_a_staged_copy_the_request_did_not_use_is_freed(pair_factory):
    """vLLM took the item from its own cache (the request was scheduled without asking the
    connector): the copy staged for it is dropped at the end of the step, not after
    staged_ttl_s."""
    prod, cons = pair_factory("producer"), pair_factory("consumer")
    params = produce(prod, request("p", "img"), {"img": torch.randn(NUM_EMBEDS, 8)})
    req = request("c", "img", params=params)
    cons.step_until_ready(req)
    wait_until(lambda: cons.worker.staged_bytes > 0)
    pos = req.mm_features[0].mm_position
    assert cons.sched.ensure_cache_available(req, pos.offset + pos.length)  # running, past it
    assert cons.sched.build_connector_meta().place == {}
    wait_until(lambda: cons.worker.staged_bytes == 0)
    assert cons.sched.items.get("img") is None


def test_an_aborted_request_frees_its_staged_copy(pair_factory):
    prod, cons = pair_factory("producer"), pair_factory("consumer")
    params = produce(prod, request("p", "img"), {"img": torch.randn(NUM_EMBEDS, 8)})
    req = request("c", "img", params=params)
    cons.step_until_ready(req)
    cons.sched.request_finished(req)
    cons.sched.build_connector_meta()
    wait_until(lambda: cons.worker.staged_bytes == 0)


class MetadataOnlyItems:
    """Stand-in for ec_connectors.placeholders.Placeholders (which reads vLLM's model
    registry; the e2e tests use the real one): items named `meta-*` came without media."""

    def metadata_only(self, feature) -> bool:
        return feature.identifier.startswith("meta-")

    def describe(self, features) -> dict:
        return {f.identifier: {"image_grid_thw": [1, 4, 4]} for f in features}

    def asked(self, feature) -> dict:
        return {"image_grid_thw": [1, 4, 4]}


def steps_until_failed(pair: Pair, req, timeout=5.0) -> int:
    """Steps until the scheduler side fails `req`; it must never say ready meanwhile (vLLM
    would schedule an item it has no media for: its model runner dies)."""
    steps, deadline = 0, time.monotonic() + timeout
    while True:
        assert not pair.sched.ensure_cache_available(req, 0), "scheduled without embedding"
        steps += 1
        if req.request_id in pair.sched.take_unavailable_requests():
            return steps
        assert time.monotonic() < deadline, "request neither ready nor failed"
        time.sleep(0.005)


def test_unknown_metadata_only_item_fails_the_request_at_once(pair_factory):
    cons = pair_factory("consumer", placeholders=MetadataOnlyItems())
    assert steps_until_failed(cons, request("c", "meta-never-seen")) == 1
    assert not cons.sched.has_cache_item("meta-never-seen")
    # an item with media is still encoded locally, as before
    assert cons.sched.ensure_cache_available(request("c2", "never-seen"), 0)


def test_metadata_only_item_that_never_lands_fails_instead_of_local_encode(pair_factory):
    cons = pair_factory("consumer", placeholders=MetadataOnlyItems(), load_timeout_s=0.3)
    req = request("c", "meta-ghost", params={"epd": {"items": ["meta-ghost"]}})
    t0 = time.monotonic()
    assert steps_until_failed(cons, req) > 1
    assert time.monotonic() - t0 < 3


def test_metadata_only_item_that_lands_is_placed(pair_factory):
    prod = pair_factory("producer", placeholders=MetadataOnlyItems())
    cons = pair_factory("consumer", placeholders=MetadataOnlyItems())
    x = torch.randn(NUM_EMBEDS, 8)
    params = produce(prod, request("p", "meta-img"), {"meta-img": x})
    assert params["epd"]["items"]["meta-img"]["metadata"] == {"image_grid_thw": [1, 4, 4]}
    req = request("c", "meta-img", params=params)
    cons.step_until_ready(req)
    _, cache = cons.schedule(req)
    assert torch.equal(cache["meta-img"], x)


def test_a_metadata_only_part_the_item_does_not_fit_fails_alone(pair_factory):
    """The producer published another grid (or the item holds other rows): the request fails
    at once with `embedding_mismatch` (never placed, nothing loaded); a part it fits still
    gets it."""
    prod = pair_factory("producer", placeholders=MetadataOnlyItems())
    cons = pair_factory("consumer", placeholders=MetadataOnlyItems())
    x = torch.randn(NUM_EMBEDS, 8)
    params = produce(prod, request("p", "meta-img"), {"meta-img": x})
    entry = params["epd"]["items"]["meta-img"]
    other = {"epd": {"items": {"meta-img": {**entry, "metadata": {"video_grid_thw": [1, 4, 4]}}}}}
    more = {"epd": {"items": {"meta-img": {**entry, "num_embeds": NUM_EMBEDS + 4,
                                           "shape": [NUM_EMBEDS + 4, 8]}}}}
    for name, bad in (("metadata", other), ("rows", more)):
        assert steps_until_failed(cons, request(f"c-{name}", "meta-img", params=bad)) == 1
        assert not cons.sched.has_cache_item("meta-img"), name
        board = cons.sched.unavailable.reasons
        code, message = board.read(["meta-img"], time.time() - 5)
        assert code == "embedding_mismatch" and "meta-img" in message, (name, message)
    req = request("c", "meta-img", params=params)
    cons.step_until_ready(req)
    _, cache = cons.schedule(req)
    assert torch.equal(cache["meta-img"], x)


def test_producer_describes_every_item_even_one_it_did_not_encode(pair_factory):
    prod = pair_factory("producer", placeholders=MetadataOnlyItems())
    produce(prod, request("p", "a"), {"a": torch.randn(NUM_EMBEDS, 8)})
    wait_until(lambda: prod.sched.has_cache_item("a"))
    req = request("p2", "a", "b")  # a: stored before (not encoded again); b: new
    prod.sched.update_state_after_alloc(req, 1)
    items = prod.sched.request_finished(req)["epd"]["items"]
    assert set(items) == {"a", "b"}
    assert all(e["metadata"] == {"image_grid_thw": [1, 4, 4]} for e in items.values())


def test_an_item_loaded_twice_is_staged_once_and_its_bytes_return_to_zero(pair_factory):
    """Two prefetches of one item raced (both loaded before either was staged): one copy is
    kept, the staging byte account counts it once, and placing it brings the account to 0
    (a leak here once made a consumer 'staging full' for good)."""
    import time as _time

    from ec_connectors.control.messages import Prefetch

    prod, cons = pair_factory("producer"), pair_factory("consumer")
    x = torch.randn(NUM_EMBEDS, 8)
    produce(prod, request("p", "twice"), {"twice": x})
    msg = Prefetch(item_id="twice", timeout_s=5.0)
    cons.worker._prefetch([msg, msg], _time.perf_counter())  # one batch: both load
    assert cons.worker.staged_bytes == x.numel() * 4
    cons.worker._prefetch([msg], _time.perf_counter())  # already staged: not loaded again
    assert cons.worker.staged_bytes == x.numel() * 4
    cache: dict[str, torch.Tensor] = {}
    cons.worker.place(cache, {"twice": NUM_EMBEDS})
    assert torch.equal(cache["twice"], x)
    assert cons.worker.staged_bytes == 0


def test_with_the_secret_a_producer_shares_only_ids_the_gateway_signed(pair_factory, tmp_path):
    """A client that reaches a producer directly chooses its own `uuid`: with the deployment
    secret such an id is encoded for that request only, never stored under a name it picked
    (image A's embedding under image B's id); ids the gateway signed are shared as before."""
    from ec_connectors.protocol.item_ids import IdSigner
    from ec_connectors.protocol.secret_file import read_secret

    secret = tmp_path / "secret"
    secret.write_bytes(b"ids-deployment-secret-0123456789")
    secret.chmod(0o600)
    prod = pair_factory("producer", secret_file=str(secret))
    signed = IdSigner(read_secret(secret)).sign("sha256-of-image-b")
    x = torch.randn(NUM_EMBEDS, 8)
    params = produce(prod, request("p", "sha256-of-image-b", signed),
                     {"sha256-of-image-b": x, signed: x})
    assert set(params["epd"]["items"]) == {signed}  # the client's own id is not offered
    assert prod.worker.transport.exists(signed)
    assert not prod.worker.transport.exists("sha256-of-image-b")
    wait_until(lambda: prod.sched.stats.totals.get("unvouched_ids") == 1)


# -- inline: small items read by the scheduler side, carried in the step's metadata --------

def test_inline_small_item_rides_in_the_metadata_and_never_touches_the_workers(pair_factory):
    prod = pair_factory("producer")
    cons = pair_factory("consumer", inline_max_bytes=64 * 1024)
    x = torch.randn(NUM_EMBEDS, 32).bfloat16()
    req = request("c", "img", params=produce(prod, request("p", "img"), {"img": x}))
    cons.step_until_ready(req)
    assert cons.sched.stats.totals["inline_loads"] == 1
    place, cache = cons.schedule(req)
    assert place == {"img": NUM_EMBEDS}
    assert torch.equal(cache["img"], x) and cache["img"].dtype == torch.bfloat16
    cache["img"].add_(1)  # vLLM owns the tensor: it must be writable, not the sender's bytes
    assert cons.sched.inline.held_bytes == 0 and not cons.sched.inline
    assert cons.worker.get_finished() == (None, {"img"})
    time.sleep(0.1)  # nothing went over the control channel to be staged
    assert cons.worker.staged_bytes == 0 and not cons.worker.stats.totals.get("staged_bytes")
    wait_until(lambda: cons.sched.stats.totals.get("loads") == 1)


def test_inline_an_item_over_the_limit_goes_through_the_workers(pair_factory):
    prod = pair_factory("producer")
    cons = pair_factory("consumer", inline_max_bytes=1024)
    x = torch.randn(NUM_EMBEDS, 64)  # 4 KiB
    req = request("c", "img", params=produce(prod, request("p", "img"), {"img": x}))
    cons.step_until_ready(req)
    for i, f in enumerate(req.mm_features):
        assert cons.sched.has_cache_item(f.identifier)
        cons.sched.update_state_after_alloc(req, i)
    built = cons.sched.build_connector_meta()
    assert built.place == {"img": NUM_EMBEDS} and built.inline == {}
    cache: dict[str, torch.Tensor] = {}
    cons.worker.place(cache, built.place, built.inline)
    assert torch.equal(cache["img"], x)
    assert not cons.sched.stats.totals.get("inline_loads")


def test_inline_an_item_not_written_yet_is_waited_for_by_the_workers(pair_factory):
    """The producer's params can reach the consumer before its writer has finished: the
    inline read misses, the workers' load waits for the file (until the deadline)."""
    prod = pair_factory("producer")
    cons = pair_factory("consumer", inline_max_bytes=64 * 1024)
    x = torch.randn(NUM_EMBEDS, 8)
    req = request("c", "late", params={"epd": {"items": ["late"]}})
    assert not cons.sched.ensure_cache_available(req, 0)
    time.sleep(0.2)
    produce(prod, request("p", "late"), {"late": x})
    cons.step_until_ready(req)
    _, cache = cons.schedule(req)
    assert torch.equal(cache["late"], x)
    assert not cons.sched.stats.totals.get("inline_loads")


def test_inline_copy_nobody_places_is_released(pair_factory):
    prod = pair_factory("producer")
    cons = pair_factory("consumer", inline_max_bytes=64 * 1024)
    params = produce(prod, request("p", "img"), {"img": torch.randn(NUM_EMBEDS, 8)})
    req = request("c", "img", params=params)
    cons.step_until_ready(req)
    assert cons.sched.inline.held_bytes == NUM_EMBEDS * 8 * 4
    cons.sched.request_finished(req)  # aborted before it was scheduled
    cons.sched.build_connector_meta()
    assert cons.sched.inline.held_bytes == 0 and cons.sched.items.get("img") is None


PENDING = {"epd": {"items": {"img": {"pending": True}}}}


@pytest.mark.parametrize("inline", [0, 1 << 20], ids=["workers", "inline"])
def test_a_pending_item_is_waited_for_and_loaded_once_it_lands(pair_factory, inline):
    """The gateway sent the request while its item is encoded (routing.overlap): the consumer
    defers it without asking its workers to poll, and loads the item once its save shows in
    the index (inotify on a local directory)."""
    prod, cons = pair_factory("producer"), pair_factory("consumer", inline_max_bytes=inline)
    assert cons.sched.index.watching
    req = request("c1", "img", params=PENDING)
    for _ in range(3):
        assert not cons.sched.ensure_cache_available(req, 0)
    assert cons.sched.items.get("img") is None  # no load started: nothing to load yet
    assert cons.worker.staged_bytes == 0
    x = torch.randn(NUM_EMBEDS, 32).bfloat16()
    produce(prod, request("p1", "img"), {"img": x})
    cons.step_until_ready(req)
    meta, cache = cons.schedule(req)
    assert meta == {"img": NUM_EMBEDS} and torch.equal(cache["img"], x)
    assert cons.sched.stats.totals.get("local_encode_fallbacks", 0) == 0
    assert not cons.sched.promises  # the promise was kept and forgotten


def test_a_pending_item_that_never_lands_is_encoded_locally_at_its_deadline(pair_factory):
    cons = pair_factory("consumer", load_timeout_s=0.6)
    req = request("c1", "img", params=PENDING)
    assert not cons.sched.ensure_cache_available(req, 0)
    time.sleep(0.1)  # (margin for a loaded CI machine: a sleep may overshoot)
    assert not cons.sched.ensure_cache_available(req, 0)  # still within its deadline
    time.sleep(0.55)
    assert cons.sched.ensure_cache_available(req, 0)  # raw media: vLLM encodes it itself
    assert not cons.sched.has_cache_item("img")
    totals = cons.sched.stats.totals
    assert totals.get("timeouts") == 1 and totals.get("local_encode_fallbacks") == 1


def test_a_metadata_only_pending_item_that_never_lands_fails_its_request_once(pair_factory):
    cons = pair_factory("consumer", placeholders=MetadataOnlyItems(), load_timeout_s=0.2)
    req = request("c1", "meta-img", params={"epd": {"items": {"meta-img": {"pending": True}}}})
    assert not cons.sched.ensure_cache_available(req, 0)
    time.sleep(0.3)
    for _ in range(3):  # vLLM asks again each step until it takes the request out
        assert not cons.sched.ensure_cache_available(req, 0), "scheduled without embedding"
    assert cons.sched.take_unavailable_requests() == {"c1"}
    totals = cons.sched.stats.totals
    assert totals.get("timeouts") == 1 and totals.get("failed_requests") == 1


def test_a_malformed_pending_flag_makes_the_params_ignored(pair_factory):
    cons = pair_factory("consumer")
    req = request("c1", "img", params={"epd": {"items": {"img": {"pending": "yes"}}}})
    assert cons.sched.ensure_cache_available(req, 0)  # bad params: encoded locally, no wait


def test_an_idle_step_waits_for_news_and_no_longer(pair_factory, monkeypatch):
    """A step that scheduled nothing because requests wait on us blocks the engine thread
    until something lands (no empty steps spinning the engine and its workers), bounded by
    _IDLE_WAIT_S; a step that did schedule work never waits."""
    import threading

    import ec_connectors.sched.scheduler as sched_mod

    monkeypatch.setattr(sched_mod, "_IDLE_WAIT_S", 1.0)
    prod, cons = pair_factory("producer"), pair_factory("consumer", inline_max_bytes=1 << 20)
    req = request("c1", "img", params=PENDING)

    def timed(**kw) -> float:
        t = time.monotonic()
        cons.sched.build_connector_meta(**kw)
        return time.monotonic() - t

    assert timed(idle=True) < 0.25  # nobody deferred: nothing to wait for
    assert not cons.sched.ensure_cache_available(req, 0)
    assert timed(idle=False) < 0.25  # work was scheduled: the engine goes on
    assert not cons.sched.ensure_cache_available(req, 0)
    assert timed(idle=True) >= 0.95  # deferred, no news: the whole bound
    assert not cons.sched.ensure_cache_available(req, 0)
    x = torch.randn(NUM_EMBEDS, 32).bfloat16()
    saver = threading.Timer(0.05, produce, (prod, request("p1", "img"), {"img": x}))
    saver.start()
    try:
        assert timed(idle=True) < 0.7  # woken by the save showing in the index
    finally:
        saver.join()
    cons.step_until_ready(req)
    assert torch.equal(cons.schedule(req)[1]["img"], x)


def test_a_producer_holds_at_most_its_save_byte_budget(pair_factory):
    """ENCODED_CPU on a producer: host copies waiting for the transport. Past
    max_pending_save_bytes a save waits (backpressure) and then fails loudly (consumers
    encode the item): memory stays bounded whatever the items' sizes. The held bytes are a
    gauge, back to zero once written."""
    x = torch.randn(NUM_EMBEDS, 64)  # 4 KiB per item at NUM_EMBEDS 16
    prod = pair_factory("producer", max_pending_save_bytes=x.nbytes + 1,
                        save_queue_timeout_s=0.2)
    release = threading.Event()
    put = prod.worker.transport.put

    def slow_put(item_id, tensor):
        release.wait(10)
        return put(item_id, tensor)

    prod.worker.transport.put = slow_put
    prod.worker.save("a", x)  # held by the writer
    t0 = time.monotonic()
    prod.worker.save("b", x.clone())  # no room: waits 0.2 s, then fails
    assert time.monotonic() - t0 >= 0.15
    wait_until(lambda: prod.sched.stats.totals.get("save_failures") == 1)  # reported
    held = prod.sched.stats.take().data["gauges"]["producer_feature_bytes"]
    assert held == {"encoded_cpu": x.nbytes}  # a alone: b never took host memory
    release.set()
    assert prod.worker.flush()
    wait_until(lambda: prod.sched.stats.totals.get("saves") == 1)
    assert prod.sched.stats.take().data["gauges"]["producer_feature_bytes"] == {
        "encoded_cpu": 0}
    wait_until(lambda: prod.sched.has_cache_item("a"))
    assert not prod.sched.has_cache_item("b")


def test_a_producer_asks_for_steps_until_its_saves_are_published(pair_factory):
    """vLLM publishes connector stats only with a step's output, and an idle engine takes no
    steps: while a worker still writes an item encoded in a step already run, or its report
    came after the step took the stats, the scheduler side asks for one more step
    (has_pending_push_work). An item it did not encode (already stored) is not waited for;
    a report that never comes stops counting at its deadline."""
    prod = pair_factory("producer", save_queue_timeout_s=0.2, load_timeout_s=0.2)
    sched = prod.sched

    def publish() -> dict:  # what vLLM does at the end of each step
        stats = sched.stats.take()
        return stats.data["counters"] if stats is not None else {}

    assert not sched.has_pending_push_work()
    assert not sched.has_cache_item("img")
    sched.update_state_after_alloc(request("p1", "img"), 0)
    publish()
    assert sched.has_pending_push_work()  # encoded this step, not written yet
    t = time.monotonic()
    sched.build_connector_meta(idle=True)
    assert time.monotonic() - t < 0.25  # vLLM's own 1 ms sleep paces these steps, not us
    prod.worker.save("img", torch.randn(NUM_EMBEDS, 8))
    wait_until(lambda: sched.stats.totals.get("saves") == 1)  # the worker reported
    assert sched.has_pending_push_work()  # ...after the last step took its stats
    assert publish().get("saves") == 1
    assert not sched.has_pending_push_work()

    wait_until(lambda: sched.has_cache_item("img"))  # stored: vLLM will not encode it
    sched.update_state_after_alloc(request("p2", "img"), 0)
    publish()
    assert not sched.has_pending_push_work()

    assert not sched.has_cache_item("lost")
    sched.update_state_after_alloc(request("p3", "lost"), 0)  # its save never reported
    assert sched.has_pending_push_work()
    wait_until(lambda: not sched.has_pending_push_work(), timeout=2.0)
