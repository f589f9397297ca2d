"""A stored item against the metadata-only part naming it (scheduler_hooks/fit.py), and the
plan for a part it does not fit (decisions.plan_item): the request fails with the reason,
whatever holds the item (a load, vLLM's encoder cache)."""

from __future__ import annotations

import pytest

from scheduler_hooks.decisions import (
    Decision,
    ItemAction,
    ItemFacts,
    Lookup,
    Verdict,
    plan_item,
)
from scheduler_hooks.encoder_cache import EncoderCacheView
from scheduler_hooks.fit import Asked, Known, is_mismatch, misfit, same_metadata, show

IMAGE = {"image_grid_thw": [1, 8, 8]}  # 16 embeddings (spatial merge 2)
PUBLISHED = Known(16, "its producer's ec_transfer_params", IMAGE)


def image(grid: list[int]) -> Asked:
    return Asked("image", grid[0] * grid[1] * grid[2] // 4, {"image_grid_thw": grid})


@pytest.mark.parametrize("asked, words", [
    (image([1, 4, 4]), "image part"),  # a smaller grid
    (image([1, 16, 16]), "image part"),  # a larger grid
    (image([1, 4, 16]), "image_grid_thw [1, 4, 16]"),  # another grid, the same rows
    (Asked("video", 16, {"video_grid_thw": [1, 8, 8]}), "video part"),  # a video grid
    (Asked("audio", 16, {"audio_feature_lengths": [64]}), "audio part"),  # audio for an image
], ids=["smaller", "larger", "same rows", "video grid", "audio"])
def test_a_part_the_published_item_does_not_fit(asked, words):
    why = misfit(asked, PUBLISHED)
    assert why and is_mismatch(why) and words in why, why
    assert "image_grid_thw [1, 8, 8]" in why  # what the producer published


@pytest.mark.parametrize("asked", [image([1, 4, 4]), image([1, 16, 16]),
                                   Asked("video", 32, {"video_grid_thw": [2, 8, 8]})])
def test_rows_alone_catch_another_token_count(asked):
    for where in ("as loaded here", "in vLLM's encoder cache"):
        why = misfit(asked, Known(16, where))
        assert why.startswith("token count") and where in why and str(asked.rows) in why


def test_what_fits_or_is_not_known_passes():
    assert misfit(image([1, 8, 8]), PUBLISHED) == ""
    assert misfit(image([1, 8, 8]), Known(16)) == ""
    assert misfit(image([1, 4, 4]), Known()) == ""  # nothing known: vLLM's own checks
    # without the producer's metadata, the same rows as another modality cannot be told
    assert misfit(Asked("video", 16, {"video_grid_thw": [1, 8, 8]}), Known(16)) == ""


def test_metadata_compares_values_not_spelling():
    assert same_metadata({"audio_feature_lengths": 64}, {"audio_feature_lengths": [64]})
    assert same_metadata({"timestamps": [0.5, 1.0000001]}, {"timestamps": [0.5, 1.0]})
    assert not same_metadata({"timestamps": [0.5, 1.1]}, {"timestamps": [0.5, 1.0]})
    assert not same_metadata(IMAGE, {**IMAGE, "extra": 1})
    assert not same_metadata(IMAGE, {"image_grid_thw": [1, 8]})
    assert len(show({"timestamps": list(range(500))})) <= 160


def test_a_misfit_fails_the_request_whatever_holds_the_item():
    why = misfit(image([1, 4, 4]), PUBLISHED)
    for facts in (ItemFacts(metadata_only=True, mismatch=why, lookup=Lookup.YES),
                  ItemFacts(metadata_only=True, mismatch=why, in_engine_cache=True),
                  ItemFacts(metadata_only=True, mismatch=why, staged=True)):
        plan = plan_item(facts)
        assert plan.action is ItemAction.FAIL and plan.why == why, facts
        assert plan.defer and plan.report
    # a part with media is never refused for it: vLLM encodes it or serves its cache
    assert plan_item(ItemFacts(in_engine_cache=True)).action is ItemAction.SKIP


def test_a_token_count_found_on_load_is_not_served_from_vllms_cache():
    wrong = Decision(Verdict.UNAVAILABLE, "token count: the item holds 16 embeddings, "
                     "the request expects 4", just_failed=True)
    facts = ItemFacts(metadata_only=True, in_engine_cache=True, staged=True, decision=wrong)
    assert plan_item(facts).action is ItemAction.FAIL
    lost = Decision(Verdict.UNAVAILABLE, "deadline passed", just_failed=True)
    facts = ItemFacts(metadata_only=True, in_engine_cache=True, staged=True, decision=lost)
    assert plan_item(facts).action is ItemAction.SKIP  # vLLM's cache holds a fitting copy


def test_the_encoder_cache_view_keeps_each_entrys_rows():
    v = EncoderCacheView()
    v.allocated("a", 16)
    v.allocated("b")
    assert v.rows("a") == 16 and v.rows("b") == 0 and v.rows("c") == 0
    v.evicted(["a"])
    assert v.rows("a") == 0 and "a" not in v
