"""A producer's bookkeeping without a scheduler around it: saves to be reported, their infos,
the entries a finished request returns."""

from __future__ import annotations

from ec_connectors.protocol.keys import item_key
from ec_connectors.protocol.params import ItemEntry
from ec_connectors.protocol.stored import ItemInfo
from ec_connectors.sched.producer_saves import ProducerSaves
from tests.ec_connectors.fakes import NUM_EMBEDS, request


def info(item_id: str) -> ItemInfo:
    return ItemInfo(item_id=item_id, key=item_key(item_id), shape=(NUM_EMBEDS, 8),
                    dtype="bfloat16", nbytes=NUM_EMBEDS * 16, checksum="ab",
                    location="10.0.0.1:1")


def test_a_save_is_awaited_until_every_rank_reported_or_its_deadline():
    book = ProducerSaves(lambda _: True)
    book.expect_save("a", {0, 1}, deadline=10.0)
    assert book.saving(now=1.0)
    book.saved("a", 0, info("a"))
    assert book.saving(now=1.0) and book.info("a") == info("a")
    book.saved("a", 1, None)  # a failed save of another rank: no info, no longer awaited
    assert not book.saving(now=1.0)
    book.expect_save("b", {0}, deadline=10.0)
    assert not book.saving(now=10.5)  # a report lost for good stops counting


def test_a_finished_request_returns_its_vouched_items_with_their_metadata():
    book = ProducerSaves(lambda item_id: item_id != "client-chosen")
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
    book = ProducerSaves(lambda _: True)
    req = request("r2", "hot", "gone")
    book.saved("hot", 0, info("hot"))
    out = book.finish(req, {}, with_location=True, stored=lambda item_id: item_id == "hot")
    assert out == {"hot": ItemEntry.describe("hot", NUM_EMBEDS, info("hot"), True)}
    assert book.finish(request("r3", "gone"), {}, with_location=True,
                       stored=lambda _: False) is None  # not stored: nothing offered


class NoScan(dict):
    """A dict that fails a test when iterated: reads and writes by key only."""

    def _scan(self, *_a):
        raise AssertionError("scanned every awaited save")

    __iter__ = keys = values = items = _scan


def test_saving_costs_the_saves_due_not_every_awaited_one():
    """An idle engine asks `saving` again and again while saves are owed: each answer pops
    what fell due since (a heap of deadlines), never a pass over every awaited save."""
    book = ProducerSaves(lambda _: True)
    book._saving = NoScan()
    for k in range(1000):
        book.expect_save(f"i{k}", {0, 1}, deadline=10.0 + k)
    for _ in range(100):
        assert book.saving(now=5.0)
    book.expect_save("i0", {0}, deadline=2000.0)  # expected anew: the old deadline is void
    book.saved("i1", 0, None)
    book.saved("i1", 1, None)  # reported by every rank: no longer awaited
    assert book.saving(now=509.5)  # i2..i499 lapsed; i500.., and i0 anew, still owed
    assert len(book._saving) == 501 and "i0" in book._saving and "i499" not in book._saving
    book.expect_save("nobody", set(), deadline=3000.0)  # no rank to report it: not awaited
    assert "nobody" not in book._saving
    assert book.saving(now=1999.0)  # i0 alone
    assert not book.saving(now=2000.0)
    assert len(book._due) < 200  # stale heap entries were dropped along the way


def test_the_deadline_heap_stays_bounded_while_saves_are_reported():
    """A busy engine never asks `saving` (it has requests): reported saves' heap entries are
    compacted away as new saves come, the heap stays within twice the live saves."""
    book = ProducerSaves(lambda _: True)
    for k in range(10_000):
        book.expect_save(f"i{k}", {0}, deadline=1e9)
        book.saved(f"i{k}", 0, None)
    assert not book._saving and len(book._due) <= 64 + 1
