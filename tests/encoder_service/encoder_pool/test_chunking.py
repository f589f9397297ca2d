"""Chunked video encoding: the split on temporal-patch boundaries, the assembly by position
map, and the pool queueing chunks as jobs of their own. The encoder is the fake of fakes.py
as a tower (`video_tower`): each pixel row group maps to an embedding row (a tower that
attends within temporal groups only); the
real Qwen towers are checked bit for bit against vLLM in tests/e2e/test_qwen_modalities.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFieldElem,
    MultiModalFlatField,
    MultiModalKwargsItem,
)

from encoder_service.encoder_pool.batching import EncoderPool
from encoder_service.encoder_pool.chunking import Assembly, chunk_count, split_video
from encoder_service.encoder_pool.jobs import ItemFailed, Overloaded, Worker
from encoder_service.encoder_pool.lifecycle import FeatureStore, PoolItemState
from encoder_service.encoder_pool.media import MediaItem
from tests.encoder_service.encoder_pool.fakes import MERGE, video_tower
from tests.helpers import run_pool

DIM = video_tower().hidden_size


def video(item_id: str, t: int, h: int = 4, w: int = 4, seed: int = 0) -> MediaItem:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(t * h * w, 6, generator=gen)
    kwargs = MultiModalKwargsItem({
        "pixel_values_videos": MultiModalFieldElem(data=pixels, field=MultiModalFlatField(
            slices=[[slice(0, t * h * w)]], dim=0)),
        "video_grid_thw": MultiModalFieldElem(data=torch.tensor([t, h, w]),
                                              field=MultiModalBatchedField()),
        "second_per_grid_ts": MultiModalFieldElem(data=torch.tensor(1.0),
                                                  field=MultiModalBatchedField()),
    })
    return MediaItem(item_id, "video", prepared=kwargs, num_embeds=t * h * w // MERGE)


def whole_embedding(item: MediaItem) -> torch.Tensor:
    return video_tower().encode([item])[0]


@settings(max_examples=60, deadline=None)
@given(t=st.integers(1, 40), hw=st.sampled_from([(2, 2), (4, 4), (2, 6), (8, 4)]),
       max_rows=st.integers(0, 200))
def test_chunks_cover_the_video_in_whole_groups(t, hw, max_rows):
    h, w = hw
    item = video("v", t, h, w)
    per_group = h * w // MERGE
    chunks = split_video(item, max_rows)
    assert chunk_count(item, max_rows) == len(chunks)  # counted without cutting, the same
    if max_rows == 0 or t == 1 or max_rows // per_group >= t:
        assert chunks == []
        return
    assert chunks, "a video over the chunk size is split"
    start = 0
    for i, c in enumerate(chunks):
        assert c.index == i and c.rows[0] == start and c.item.item_id == f"v#{i}"
        n = int(c.item.prepared["video_grid_thw"].data[0])
        assert c.rows[1] - c.rows[0] == n * per_group == c.item.num_embeds
        assert n * per_group <= max(max_rows, per_group)  # at most max_rows, at least 1 group
        start = c.rows[1]
    assert start == item.num_embeds
    pixels = torch.cat([c.item.prepared["pixel_values_videos"].data for c in chunks])
    assert torch.equal(pixels, item.prepared["pixel_values_videos"].data)


@pytest.mark.parametrize("kind", ["image", "no-grid", "one-group", "odd-rows"])
def test_items_that_are_not_split(kind):
    if kind == "image":
        item = MediaItem("i", "image", media=Image.new("RGB", (8, 8)), num_embeds=4)
    elif kind == "no-grid":
        item = video("v", 8)
        item.prepared.pop("video_grid_thw")
    elif kind == "one-group":
        item = video("v", 1)
    else:  # the rows do not divide into the groups: a layout the split does not know
        item = video("v", 8)
        item = MediaItem("v", "video", prepared=item.prepared, num_embeds=item.num_embeds + 1)
    assert split_video(item, 4) == []


def test_assembly_in_any_order_is_the_whole_embedding():
    item = video("v", 9, seed=3)
    chunks = split_video(item, 8)
    parts = {c.index: whole_embedding(c.item) for c in chunks}
    a = Assembly("v", chunks)
    out = None
    for index in reversed(range(len(chunks))):
        assert not a.complete
        out = a.place(index, parts[index])
    assert a.complete and torch.equal(out, whole_embedding(item))
    with pytest.raises(ValueError, match="placed twice"):
        a.place(0, parts[0])
    b = Assembly("v", chunks)
    with pytest.raises(ValueError, match="rows are"):
        b.place(0, torch.zeros(parts[0].shape[0] + 1, DIM))


def pool_of(tower, **kw) -> EncoderPool:
    kw.setdefault("max_wait_ms", 1)
    return EncoderPool([Worker(tower)], FeatureStore(1 << 24), **kw)


def test_pool_encodes_a_long_video_in_chunks_equal_to_the_whole():
    tower = video_tower()
    pool = pool_of(tower, video_chunk_tokens=8, max_batch_tokens=8)
    item = video("v", 12, seed=5)

    async def go():
        return await pool.encode(item, 10)

    out = run_pool(go, pool)
    assert torch.equal(out, whole_embedding(item))
    assert [b for b in tower.batches] == [[f"v#{i}"] for i in range(6)]  # 2 groups = 8 rows each
    assert pool.stats.chunked_items == 1 and pool.stats.chunks == 6
    assert pool.store.state("v") is PoolItemState.ENCODED_CPU
    assert pool.store.lookup("v") is out


def test_a_video_batch_holds_at_most_the_chunk_rows():
    """Chunks of one video, all queued at once, still go one batch each (else the long video
    is one batch again); short videos batch together under the same rows."""
    tower = video_tower()
    pool = pool_of(tower, video_chunk_tokens=8, max_batch_tokens=1 << 14, max_wait_ms=20)

    async def go():
        await asyncio.gather(pool.encode(video("v", 6), 10), pool.encode(video("a", 1), 10),
                             pool.encode(video("b", 1), 10))

    run_pool(go, pool)
    assert [b for b in tower.batches if b[0].startswith("v")] == [["v#0"], ["v#1"], ["v#2"]]
    assert ["a", "b"] in tower.batches


def test_images_run_between_a_videos_chunks():
    """The point of chunking: an image queued while a long video encodes waits one chunk,
    not the whole video. Whole (chunking off), it waits for all of it."""
    def order(chunk_tokens):
        tower = video_tower(delay_per_row=0.004)
        pool = pool_of(tower, video_chunk_tokens=chunk_tokens, max_batch_tokens=8)

        async def go():
            vid = asyncio.ensure_future(pool.encode(video("v", 16), 30))
            await asyncio.sleep(0.02)  # the video's first batch is running
            img = MediaItem("img", "image", media=Image.new("RGB", (8, 8)), num_embeds=1)
            await pool.encode(img, 30)
            done_when_image_done = vid.done()
            await vid
            return done_when_image_done, tower.batches

        return run_pool(go, pool)

    video_done, log = order(8)
    assert not video_done
    flat = [i for batch in log for i in batch]
    assert 0 < flat.index("img") < len(flat) - 1, flat
    video_done, log = order(0)
    assert video_done and log == [["v"], ["img"]]


def _images(n: int, prefix: str = "img") -> list[MediaItem]:
    return [MediaItem(f"{prefix}{i}", "image", media=Image.new("RGB", (8, 8)), num_embeds=1)
            for i in range(n)]


def test_batches_of_images_all_run_before_a_long_videos_next_chunk():
    """Shortest remaining work first: two image batches formed while a video encodes both
    go before the video's next chunk (ticket order put a chunk between them)."""
    tower = video_tower(delay_per_row=0.004)
    pool = pool_of(tower, video_chunk_tokens=8, max_batch_tokens=8, max_batch_size=2)

    async def go():
        vid = asyncio.ensure_future(pool.encode(video("v", 32), 30))
        await asyncio.sleep(0.02)  # the video's first chunk is running
        await asyncio.gather(*(pool.encode(img, 30) for img in _images(4)))
        await vid
        return tower.batches

    log = run_pool(go, pool)
    image_batches = [i for i, batch in enumerate(log) if batch[0].startswith("img")]
    assert len(image_batches) == 2 and image_batches[1] == image_batches[0] + 1, log
    assert image_batches[0] > 0 and image_batches[1] < len(log) - 1, log


@pytest.mark.parametrize("aging_s, progresses", [(0.1, True), (100.0, False)])
def test_a_passed_over_video_chunk_goes_first_once_aged(monkeypatch, aging_s, progresses):
    """Images queued without pause would hold a long video back for ever (shortest work
    first); a chunk passed over for AGING_S goes first, so the video progresses."""
    from encoder_service.encoder_pool import jobs

    monkeypatch.setattr(jobs, "AGING_S", aging_s)
    tower = video_tower(delay_per_row=0.01)  # a chunk 80 ms, an image 10 ms
    pool = pool_of(tower, video_chunk_tokens=8, max_batch_tokens=8, max_batch_size=1)

    async def go():
        vid = asyncio.ensure_future(pool.encode(video("v", 16), 30))  # 8 chunks
        await asyncio.sleep(0.005)
        loop = asyncio.get_running_loop()
        stop, n = loop.time() + 1.5, 0

        async def flood() -> None:  # an image is always queued until `stop`
            nonlocal n
            while loop.time() < stop:
                n += 1
                await pool.encode(MediaItem(f"i{n}", "image", media=Image.new("RGB", (8, 8)),
                                            num_embeds=1), 30)

        await asyncio.gather(*(flood() for _ in range(3)))
        await vid
        return tower.batches

    log = run_pool(go, pool)
    last_image = max(i for i, batch in enumerate(log) if batch[0].startswith("i"))
    before = sum(1 for batch in log[:last_image] if batch[0].startswith("v"))
    if progresses:
        assert before >= 5, log  # chunks ran while images kept coming
    else:
        assert before <= 2, log  # without aging: the one running, at most one more


def test_a_failing_chunk_fails_the_item_once_and_skips_the_rest():
    tower = video_tower(fail={"v#1"})
    pool = pool_of(tower, video_chunk_tokens=4, max_batch_tokens=4)

    async def go():
        with pytest.raises(ItemFailed) as err:
            await pool.encode(video("v", 8), 10)
        await asyncio.sleep(0.05)
        return err.value

    err = run_pool(go, pool)
    assert err.item_id == "v" and err.code == "encode_error" and "chunk 1" in err.reason
    encoded = [i for batch in tower.batches for i in batch]
    assert "v#7" not in encoded  # queued chunks of a failed item are not encoded
    assert pool.stats.items_failed == {"encode_error": 1}
    assert pool.store.state("v") is PoolItemState.DISCARDED


def test_a_chunked_video_takes_a_queue_slot_per_chunk():
    pool = pool_of(video_tower(delay_per_row=0.01), video_chunk_tokens=4, max_queue_items=5)

    async def go():
        assert pool.slots(video("v", 8)) == 8 and pool.slots(video("s", 2)) == 2
        with pytest.raises(Overloaded):
            pool.submit(video("v", 8), 10)
        assert pool.store.get("v") is None  # refused before anything was reserved
        return await pool.encode(video("s", 2), 10)

    assert run_pool(go, pool).shape == (8, DIM)
