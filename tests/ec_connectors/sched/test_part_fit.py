"""The consumer's check of a metadata-only part against the stored item it names
(ec_connectors/sched/part_fit.py): what is known of the item comes from the request's params
(its producer's rows and published metadata), a load here, or vLLM's encoder cache."""

from __future__ import annotations

from types import SimpleNamespace

from ec_connectors.sched.hints import RequestHints
from ec_connectors.sched.part_fit import PartFit
from scheduler_hooks.encoder_cache import EncoderCacheView
from scheduler_hooks.item_table import ItemState, ItemTable

ITEM = "stored-item"
ENTRY = {"num_embeds": 16, "shape": [16, 128], "dtype": "bfloat16", "nbytes": 4096,
         "metadata": {"image_grid_thw": [1, 8, 8]}}


class FakePlaceholders:
    def asked(self, feature):
        return feature.data


def request(modality: str, metadata: dict, rows: int, params=None, req_id="r"):
    feature = SimpleNamespace(identifier=ITEM, modality=modality, data=metadata)
    return SimpleNamespace(request_id=req_id, mm_features=[feature], ec_transfer_params=params,
                           get_num_encoder_embeds=lambda i: rows)


def setup():
    hints, cache = RequestHints([], lambda key: None), EncoderCacheView()
    return PartFit(FakePlaceholders(), hints, cache), hints, cache, ItemTable(5.0, 60.0)


def test_the_producers_description_in_the_params():
    fit, hints, _, _ = setup()
    params = {"epd": {"items": {ITEM: ENTRY}}}
    cases = {"smaller": ("image", {"image_grid_thw": [1, 4, 4]}, 4),
             "larger": ("image", {"image_grid_thw": [1, 16, 16]}, 64),
             "video grid": ("video", {"video_grid_thw": [1, 8, 8]}, 16),
             "audio": ("audio", {"audio_feature_lengths": [64]}, 16)}
    for name, (modality, meta, rows) in cases.items():
        req = request(modality, meta, rows, params, req_id=name)
        hints.of(req)
        why = fit.check(req, 0, None)
        assert why.startswith("embedding mismatch") and "image_grid_thw [1, 8, 8]" in why, why
        assert f"{modality} part" in why
    req = request("image", {"image_grid_thw": [1, 8, 8]}, 16, params, req_id="fits")
    hints.of(req)
    assert fit.check(req, 0, None) == ""
    # a gateway's params (no metadata, the producer's rows): the rows are compared
    gateway = {"epd": {"items": {ITEM: {**ENTRY, "metadata": None}}}}
    req = request("image", {"image_grid_thw": [1, 4, 4]}, 4, gateway, req_id="gw")
    hints.of(req)
    assert fit.check(req, 0, None).startswith("token count: the item holds 16")


def test_rows_of_a_load_here_or_of_vllms_cache():
    fit, _, cache, items = setup()
    small = request("image", {"image_grid_thw": [1, 4, 4]}, 4)
    assert fit.check(small, 0, None) == ""  # nothing known
    items.begin(ITEM, 0.0, 10.0)
    items.staged(ITEM, 0, True, 16, "", {0}, 0.1)
    load = items.get(ITEM)
    assert load is not None and load.state is ItemState.STAGED
    assert "as loaded here" in fit.check(small, 0, load)
    assert fit.check(request("image", {"image_grid_thw": [1, 8, 8]}, 16), 0, load) == ""
    cache.allocated(ITEM, 16)
    assert "in vLLM's encoder cache" in fit.check(small, 0, None)


def test_a_load_failed_for_a_token_count_is_checked_again_not_remembered():
    fit, _, _, items = setup()
    items.begin(ITEM, 0.0, 10.0)
    items.staged(ITEM, 0, True, 16, "", {0}, 0.1)
    load = items.get(ITEM)
    items.fail(load, "token count: the item holds 16 embeddings, the request expects 4", 0.2)
    assert PartFit.refits(load)
    assert "token count" in fit.check(request("image", {"image_grid_thw": [1, 4, 4]}, 4), 0,
                                      load)
    assert fit.check(request("image", {"image_grid_thw": [1, 8, 8]}, 16), 0, load) == ""
    items.begin("lost", 0.0, 10.0)
    lost = items.get("lost")
    items.fail(lost, "not available (missing, corrupt or timed out)", 0.1)
    assert not PartFit.refits(lost) and not PartFit.refits(None)
