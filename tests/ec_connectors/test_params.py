import pytest

from ec_connectors.protocol.params import BadParams, hinted_items, producer_params


def test_producer_params_round_trip():
    params = producer_params("safetensors", "m", "eng", {"a": {"num_embeds": 64}, "b": {}})
    assert hinted_items(params) == {"a", "b"}


def test_list_form_and_absent():
    assert hinted_items({"epd": {"items": ["x"]}}) == {"x"}
    assert hinted_items(None) == set()
    assert hinted_items({"other_connector": {}}) == set()


@pytest.mark.parametrize("bad", [
    "string", {"epd": "x"}, {"epd": {"items": 5}}, {"epd": {"items": [1]}},
    {"epd": {"items": [""]}}, {"epd": {"items": ["x"] * 5000}},
])
def test_malformed_params_raise(bad):
    with pytest.raises(BadParams):
        hinted_items(bad)
