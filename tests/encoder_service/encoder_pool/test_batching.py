"""The async pool's logic: batching, max wait, backpressure, dispatch, deadlines, failure
isolation and OOM retry. The encoder is the fake of fakes.py (this tests the logic around
it); the real LLaVA encoder runs in test_server.py and tests/e2e/test_connector_safetensors.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from PIL import Image

from encoder_service.encoder_pool.batching import EncoderPool
from encoder_service.encoder_pool.jobs import ItemFailed, Overloaded, Worker
from encoder_service.encoder_pool.lifecycle import BudgetExceeded, FeatureStore, PoolItemState
from encoder_service.encoder_pool.media import MediaItem
from tests.encoder_service.encoder_pool.fakes import DIM, TOKENS, FakeEncoder
from tests.helpers import run_pool as run

ITEM_BYTES = TOKENS * DIM * 4


def image(item_id: str, side: int = 64) -> MediaItem:
    return MediaItem(item_id, "image", media=Image.new("RGB", (side, side)))


def make_pool(*encoders, budget=1 << 20, **kw) -> EncoderPool:
    workers = [Worker(e, name=f"w{i}") for i, e in enumerate(encoders)]
    return EncoderPool(workers, FeatureStore(budget), **kw)


def test_concurrent_items_form_full_batches():
    enc = FakeEncoder(delay=0.05)
    pool = make_pool(enc, max_batch_size=8, max_wait_ms=50)

    async def go():
        return await asyncio.gather(*(pool.encode(image(f"i{n}"), 10) for n in range(32)))

    out = run(go, pool)
    assert len(out) == 32 and all(t.shape == (TOKENS, DIM) for t in out)
    assert sorted(len(b) for b in enc.batches) == [8, 8, 8, 8]
    assert pool.store.counts()[PoolItemState.ENCODED_CPU] == 32


def test_batching_off_runs_one_item_per_batch():
    enc = FakeEncoder()
    pool = make_pool(enc, max_batch_size=1, max_wait_ms=50)

    async def go():
        await asyncio.gather(*(pool.encode(image(f"i{n}"), 10) for n in range(6)))

    run(go, pool)
    assert [len(b) for b in enc.batches] == [1] * 6


def test_a_lone_item_waits_max_wait_not_for_a_full_batch():
    enc = FakeEncoder()
    pool = make_pool(enc, max_batch_size=8, max_wait_ms=100)

    async def go():
        t0 = time.monotonic()
        await pool.encode(image("lone"), 10)
        return time.monotonic() - t0

    elapsed = run(go, pool)
    assert 0.09 <= elapsed < 1.0, elapsed
    assert enc.batches == [["lone"]]


def test_items_arriving_within_max_wait_share_a_batch():
    enc = FakeEncoder()
    pool = make_pool(enc, max_batch_size=8, max_wait_ms=300)

    async def go():
        first = asyncio.ensure_future(pool.encode(image("a"), 10))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(pool.encode(image("b"), 10))
        await asyncio.gather(first, second)

    run(go, pool)
    assert enc.batches == [["a", "b"]]


def test_full_queue_refuses_at_once_and_budget_full_refuses():
    enc = FakeEncoder(delay=0.3)
    pool = make_pool(enc, max_batch_size=1, max_wait_ms=0, max_queue_items=2)

    async def go():
        running = pool.submit(image("r"), 10)
        await asyncio.sleep(0.05)  # "r" is now on the worker, the queue is empty
        queued = [pool.submit(image(f"q{n}"), 10) for n in range(2)]
        t0 = time.monotonic()
        with pytest.raises(Overloaded, match="queue is full") as exc:
            pool.submit(image("x"), 10)
        assert time.monotonic() - t0 < 0.2 and exc.value.retry_after_s > 0
        await asyncio.gather(running, *queued)

    run(go, pool)
    assert pool.stats.rejected == {"queue_full": 1, "budget": 0}
    assert pool.store.get("x") is None

    small = make_pool(FakeEncoder(delay=0.3), budget=ITEM_BYTES * 2, max_queue_items=100)

    async def go2():
        futs = [small.submit(image(f"b{n}"), 10) for n in range(2)]
        with pytest.raises(BudgetExceeded):
            small.submit(image("b2"), 10)  # two ENCODING reservations fill the budget
        await asyncio.gather(*futs)
        # finished features are evictable: a new item now fits by evicting the oldest
        await small.encode(image("b3"), 10)
        assert small.store.get("b0") is None and small.store.evictions == 1

    run(go2, small)
    assert small.store.peak <= ITEM_BYTES * 2


def test_least_loaded_dispatch_sends_more_work_to_the_faster_worker():
    slow, fast = FakeEncoder(delay=0.2), FakeEncoder(delay=0.01)
    pool = make_pool(slow, fast, max_batch_size=1, max_wait_ms=0)

    async def go():
        await asyncio.gather(*(pool.encode(image(f"i{n}"), 10) for n in range(12)))

    run(go, pool)
    assert len(slow.batches) + len(fast.batches) == 12
    assert len(fast.batches) >= 3 * len(slow.batches) >= 3


def test_deadline_passing_in_the_queue_fails_the_item_without_encoding_it():
    enc = FakeEncoder(delay=0.4)
    pool = make_pool(enc, max_batch_size=1, max_wait_ms=0)

    async def go():
        busy = asyncio.ensure_future(pool.encode(image("busy"), 10))
        await asyncio.sleep(0.05)
        with pytest.raises(ItemFailed) as exc:
            await pool.encode(image("late"), 0.1)
        assert exc.value.code == "timeout"
        await busy
        await asyncio.sleep(0.05)

    run(go, pool)
    assert ["late"] not in enc.batches
    assert pool.store.get("late") is None and pool.stats.items_failed == {"timeout": 1}


def test_an_encoder_exception_fails_only_that_item():
    enc = FakeEncoder(fail={"bad"})
    pool = make_pool(enc, max_batch_size=4, max_wait_ms=100)

    async def go():
        return await asyncio.gather(*(pool.encode(image(i), 10) for i in ["a", "bad", "c"]),
                                    return_exceptions=True)

    a, bad, c = run(go, pool)
    assert isinstance(a, torch.Tensor) and isinstance(c, torch.Tensor)
    assert isinstance(bad, ItemFailed) and bad.code == "encode_error" and "bad" in str(bad)
    assert enc.batches[0] == ["a", "bad", "c"]  # tried together, then alone
    assert pool.store.get("bad") is None and pool.store.state("a") is PoolItemState.ENCODED_CPU


def test_oom_splits_the_batch_and_never_publishes_a_reduced_item():
    enc = FakeEncoder(oom_above=40, oom_batch_above=2)
    pool = make_pool(enc, max_batch_size=4, max_wait_ms=100)

    async def go():
        return await asyncio.gather(
            pool.encode(image("small1", 32), 10), pool.encode(image("small2", 32), 10),
            pool.encode(image("big", 128), 10), return_exceptions=True)

    s1, s2, big = run(go, pool)
    assert all(isinstance(t, torch.Tensor) for t in (s1, s2))  # the split batch fits
    assert isinstance(big, ItemFailed) and big.code == "oom" and "raw media" in str(big)
    # only full-resolution attempts: a smaller image's embedding would have fewer tokens
    # than the item id the consumer's prompt was built for
    assert set(enc.widths) == {32, 128}
    assert pool.stats.oom_failures == 1
    assert pool.store.get("big") is None


def test_duplicate_ids_share_one_encode_and_cached_features_are_reused():
    enc = FakeEncoder(delay=0.05)
    pool = make_pool(enc, max_batch_size=8, max_wait_ms=20)

    async def go():
        a, b = await asyncio.gather(pool.encode(image("same"), 10), pool.encode(image("same"), 10))
        c = await pool.encode(image("same"), 10)
        return a, b, c

    a, b, c = run(go, pool)
    assert a is b and b is c
    assert enc.batches == [["same"]] and pool.stats.reuse_hits == 1


def test_unknown_modality_is_a_clear_error():
    pool = make_pool(FakeEncoder())

    async def go():
        with pytest.raises(ValueError, match="modality 'video' is not served"):
            pool.submit(MediaItem("v", "video"), 1)

    run(go, pool)


def test_a_batch_stops_at_its_token_budget_and_the_next_item_opens_the_next():
    enc = FakeEncoder(delay=0.05)
    # budget: 3 small images' worth; a 128 px image counts double, a 512 px one 8x
    pool = make_pool(enc, max_batch_size=8, max_batch_tokens=3 * TOKENS, max_wait_ms=50,
                     budget=1 << 22)

    async def go():
        jobs = [pool.encode(image(name, side), 10) for name, side in
                (("a", 64), ("b", 64), ("c", 128), ("d", 64), ("huge", 512), ("e", 64))]
        return await asyncio.gather(*jobs)

    run(go, pool)
    # a+b fit (2 of 3); c (2) would pass the budget: it opens the next batch with d;
    # huge is over the budget alone: a batch of one; e follows
    assert enc.batches == [["a", "b"], ["c", "d"], ["huge"], ["e"]]
