import msgspec
import pytest

from ec_connectors.protocol.items import ItemInfo
from ec_connectors.protocol.keys import item_key
from ec_connectors.protocol.params import (
    MAX_METADATA_BYTES,
    BadParams,
    ItemEntry,
    Source,
    TransferParams,
    item_entry,
    item_sources,
    producer_params,
    valid_metadata,
)

INFO = ItemInfo(item_id="a", key=item_key("a"), shape=(4, 8), dtype="bfloat16", nbytes=64,
                checksum="0123abcd", location="10.0.0.1:7000")


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
    {"epd": {"items": {"a": 5}}}, {"epd": {"items": {"a": {"nbytes": -1}}}},
    {"epd": {"items": {"a": {"nbytes": 1.5}}}}, {"epd": {"items": {"a": {"nbytes": True}}}},
    {"epd": {"items": {"a": {"nbytes": 1 << 40}}}}, {"epd": {"items": ["x" * (65 * 1024)]}},
    {"epd": {"items": {"a": {"location": "nohost"}}}}, {"epd": {"items": ["a"], "endpoint": 5}},
    {"epd": {"items": {"a": {"shape": "4x8"}}}}, {"epd": {"items": {"a": {"key": 7}}}},
    {"epd": {"items": {"a": {"shape": [1] * 9}}}}, {"epd": {"items": {"a": {"num_embeds": -2}}}},
    {"epd": {"items": {"a": {"checksum": "x" * 129}}}},
    {"epd": {"items": ["a"], "producer": "p" * 2000}}, {"epd": {"items": [], "transport": 1}},
])
def test_malformed_params_raise(bad):
    with pytest.raises(BadParams):
        TransferParams.parse(bad)


def test_pending_items():
    src = item_sources({"epd": {"items": {"a": {"pending": True}, "b": {}}}})
    assert src["a"].pending and not src["b"].pending
    assert not item_sources({"epd": {"items": ["a"]}})["a"].pending
    for bad in ("yes", 1, None, []):
        with pytest.raises(BadParams, match="pending"):
            item_sources({"epd": {"items": {"a": {"pending": bad}}}})


def test_the_typed_producer_params_are_the_bytes_the_dict_writers_made():
    """Byte-compatible with the dicts of before: older gateways and consumers read them."""
    typed = TransferParams(transport="mooncake", namespace="m", producer="eng",
                           items={"a": ItemEntry.describe("a", 4, INFO, with_location=True),
                                  "b": ItemEntry.describe("b", 2, None)},
                           endpoint="10.0.0.1:7000")
    before = {"epd": {"transport": "mooncake", "namespace": "m", "producer": "eng", "items": {
        "a": {"num_embeds": 4, "key": item_key("a"), "shape": [4, 8], "dtype": "bfloat16",
              "nbytes": 64, "checksum": "0123abcd", "location": "10.0.0.1:7000"},
        "b": {"num_embeds": 2, "key": item_key("b")}}, "endpoint": "10.0.0.1:7000"}}
    assert typed.to_dict() == before
    assert typed.to_json() == msgspec.json.encode(before)  # same keys, same order
    assert item_entry("a", 4, INFO) == {k: v for k, v in before["epd"]["items"]["a"].items()
                                        if k != "location"}


def test_a_gateways_promise_and_hints_encode_as_before():
    assert TransferParams(items={"x": ItemEntry(pending=True)}).to_dict() == {
        "epd": {"items": {"x": {"pending": True}}}}
    assert ItemEntry(location="h:1", nbytes=5).to_dict() == {"nbytes": 5, "location": "h:1"}
    assert TransferParams(items={}).to_dict() == {"epd": {"items": {}}}


def test_parse_round_trips_what_a_producer_writes():
    meta = {"image_grid_thw": [1, 4, 4]}
    sent = TransferParams(transport="mooncake", namespace="m", producer="eng",
                          items={"a": ItemEntry.describe("a", 4, INFO, True).with_metadata(meta)},
                          endpoint="10.0.0.2:7001")
    got = TransferParams.parse(sent.to_dict())
    assert got == sent
    assert TransferParams.from_json(sent.to_json()) == sent
    assert got.items["a"].metadata == meta
    assert got.items["a"].with_metadata(None).to_dict().keys() == INFO_KEYS


INFO_KEYS = {"num_embeds", "key", "shape", "dtype", "nbytes", "checksum", "location"}


def test_sources_take_the_endpoint_as_every_entrys_default_location():
    params = {"epd": {"endpoint": "10.0.0.9:1", "items": {
        "a": {}, "b": {"location": "10.0.0.8:2", "nbytes": 7}, "c": None}}}
    assert TransferParams.parse(params).sources() == {
        "a": Source("10.0.0.9:1"), "b": Source("10.0.0.8:2", 7), "c": Source("10.0.0.9:1")}
    assert item_sources({"epd": {"items": {"a": {"location": None}}, "endpoint": None}}) == {
        "a": Source()}


def test_unknown_keys_are_ignored_and_not_forwarded():
    got = TransferParams.parse({"epd": {"items": {"a": {"by": "x", "nbytes": 3}},
                                        "extra": {"deep": 1}}, "other": 1})
    assert got.to_dict() == {"epd": {"items": {"a": {"nbytes": 3}}}}


def test_not_json_is_bad_params():
    with pytest.raises(BadParams, match="not JSON"):
        TransferParams.from_json(b"{nope")


@pytest.mark.parametrize("meta, ok", [
    ({"image_grid_thw": [1, 4, 4]}, True),
    ({"audio_num_tokens": 32}, True),
    ({"second_per_grid_ts": [0.5, 1.0]}, True),
    ({}, False), ("x", False), ([1], False), (None, False),
    ({"a": []}, False), ({"a": [[1, 2]]}, False), ({"a": True}, False), ({"a": "1"}, False),
    ({"a": list(range(MAX_METADATA_BYTES))}, False),  # over 1 KiB as JSON
])
def test_placeholder_metadata_is_kept_only_when_small_and_numbers_only(meta, ok):
    assert (valid_metadata(meta) is not None) is ok
    entry = TransferParams.parse({"epd": {"items": {"a": {"metadata": meta, "nbytes": 1}}}}
                                 ).items["a"]
    assert entry.nbytes == 1  # bad metadata is dropped, the entry stays usable
    assert entry.metadata == (meta if ok else None)


def test_entries_are_frozen():
    entry = ItemEntry(nbytes=1)
    with pytest.raises(AttributeError):
        entry.nbytes = 2  # type: ignore[misc]
