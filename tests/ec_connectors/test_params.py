import pytest

from ec_connectors.protocol.params import BadParams, item_sources, producer_params


def test_producer_params_round_trip():
    params = producer_params("safetensors", "m", "eng", {"a": {"num_embeds": 64}, "b": {}})
    assert set(item_sources(params)) == {"a", "b"}


def test_list_form_and_absent():
    assert set(item_sources({"epd": {"items": ["x"]}})) == {"x"}
    assert item_sources(None) == {}
    assert item_sources({"other_connector": {}}) == {}


@pytest.mark.parametrize("bad", [
    "string", {"epd": "x"}, {"epd": {"items": 5}}, {"epd": {"items": [1]}},
    {"epd": {"items": [""]}}, {"epd": {"items": ["x"] * 5000}},
])
def test_malformed_params_raise(bad):
    with pytest.raises(BadParams):
        item_sources(bad)


def test_pending_items():
    src = item_sources({"epd": {"items": {"a": {"pending": True}, "b": {}}}})
    assert src["a"].pending and not src["b"].pending
    assert not item_sources({"epd": {"items": ["a"]}})["a"].pending
    for bad in ("yes", 1, None, []):
        with pytest.raises(BadParams, match="pending"):
            item_sources({"epd": {"items": {"a": {"pending": bad}}}})
