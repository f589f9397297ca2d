"""A producer's bookkeeping without a scheduler around it: saves to be reported, their infos,
the entries a finished request returns."""

from __future__ import annotations

from ec_connectors.protocol.items import ItemInfo
from ec_connectors.protocol.keys import item_key
from ec_connectors.protocol.params import ItemEntry
from ec_connectors.sched.producer_book import ProducerBook
from tests.ec_connectors.fakes import NUM_EMBEDS, request


def info(item_id: str) -> ItemInfo:
    return ItemInfo(item_id=item_id, key=item_key(item_id), shape=(NUM_EMBEDS, 8),
                    dtype="bfloat16", nbytes=NUM_EMBEDS * 16, checksum="ab",
                    location="10.0.0.1:1")


def test_a_save_is_awaited_until_every_rank_reported_or_its_deadline():
    book = ProducerBook(lambda _: True)
    book.expect_save("a", {0, 1}, deadline=10.0)
    assert book.saving(now=1.0)
    book.saved("a", 0, info("a"))
    assert book.saving(now=1.0) and book.info("a") == info("a")
    book.saved("a", 1, None)  # a failed save of another rank: no info, no longer awaited
    assert not book.saving(now=1.0)
    book.expect_save("b", {0}, deadline=10.0)
    assert not book.saving(now=10.5)  # a report lost for good stops counting


def test_a_finished_request_returns_its_vouched_items_with_their_metadata():
    book = ProducerBook(lambda item_id: item_id != "client-chosen")
    req = request("r1", "a", "old", "client-chosen")
    book.made("r1", "a", NUM_EMBEDS)
    book.made("r1", "client-chosen", NUM_EMBEDS)
    book.saved("a", 0, info("a"))
    meta = {"a": {"image_grid_thw": [1, 4, 4]}, "old": {"image_grid_thw": [1, 2, 2]}}
    out = book.finish(req, meta, with_location=False)
    assert out == {  # "old" was stored before (deduplicated): described from its metadata
        "a": ItemEntry.describe("a", NUM_EMBEDS, info("a")).with_metadata(meta["a"]),
        "old": ItemEntry.describe("old", NUM_EMBEDS, None).with_metadata(meta["old"])}
    assert book.finish(req, {}, with_location=False) is None  # forgotten: nothing to say


def test_an_item_vllm_took_from_its_own_encoder_cache_is_offered_when_stored():
    """vLLM never asks the connector about an item its encoder cache still holds (the same
    image again within seconds): nothing was `made`, yet the item is stored and offered."""
    book = ProducerBook(lambda _: True)
    req = request("r2", "hot", "gone")
    book.saved("hot", 0, info("hot"))
    out = book.finish(req, {}, with_location=True, stored=lambda item_id: item_id == "hot")
    assert out == {"hot": ItemEntry.describe("hot", NUM_EMBEDS, info("hot"), True)}
    assert book.finish(request("r3", "gone"), {}, with_location=True,
                       stored=lambda _: False) is None  # not stored: nothing offered
