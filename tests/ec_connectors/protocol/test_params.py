import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ec_connectors.protocol.keys import item_key
from ec_connectors.protocol.params import (
    MAX_METADATA_BYTES,
    BadParams,
    ItemEntry,
    Source,
    TransferParams,
    valid_metadata,
)
from ec_connectors.protocol.stored import ItemInfo

INFO = ItemInfo(item_id="a", key=item_key("a"), shape=(4, 8), dtype="bfloat16", nbytes=64,
                checksum="0123abcd", location="10.0.0.1:7000")


def sources(params):
    return TransferParams.parse(params).sources()


def test_dict_and_list_items_parse_to_the_same_ids():
    params = TransferParams(transport="safetensors", namespace="m", producer="eng",
                            items={"a": ItemEntry(num_embeds=64), "b": ItemEntry()}).to_dict()
    assert set(sources(params)) == {"a", "b"}
    assert set(sources({"epd": {"items": ["a", "b"]}})) == {"a", "b"}


def test_absent_or_another_connectors_params_have_no_items():
    assert sources(None) == {}
    assert sources({"other_connector": {}}) == {}
    assert sources({"epd": None}) == {}
    assert sources({"epd": {}}) == {}


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
    {"epd": {"items": {"a": {"num_embeds": True}}}}, {"epd": {"items": {"a": {"shape": [True]}}}},
    {"epd": {"items": {"a": {"num_embeds": 1 << 31}}}}, {"epd": {"items": {"a": {"dtype": 5}}}},
    {"epd": {"items": {"a": {"location": 5}}}}, {"epd": {"items": ["a"], "endpoint": "h:99999"}},
])
def test_malformed_params_raise(bad):
    with pytest.raises(BadParams):
        TransferParams.parse(bad)


def test_pending_items():
    src = sources({"epd": {"items": {"a": {"pending": True}, "b": {}}}})
    assert src["a"].pending and not src["b"].pending
    assert not sources({"epd": {"items": ["a"]}})["a"].pending
    for bad in ("yes", 1, None, []):
        with pytest.raises(BadParams, match="pending"):
            sources({"epd": {"items": {"a": {"pending": bad}}}})


def test_a_bool_is_no_number_and_a_number_no_bool():
    for field in ("num_embeds", "nbytes"):
        with pytest.raises(BadParams, match=field):
            TransferParams.parse({"epd": {"items": {"a": {field: False}}}})
    with pytest.raises(BadParams, match="pending"):
        TransferParams.parse({"epd": {"items": {"a": {"pending": 0}}}})


def test_bounds_are_inclusive_where_they_should_be():
    assert TransferParams.parse({"epd": {"items": {"a": {
        "nbytes": (1 << 40) - 1, "shape": [0] * 8, "checksum": "c" * 128}}}}).items["a"].nbytes
    assert len(TransferParams.parse({"epd": {"items": ["x"] * 1024}}).items) == 1
    assert len(TransferParams.parse({"epd": {"items": [str(i) for i in range(1024)]}}).items
               ) == 1024
    with pytest.raises(BadParams, match="too many"):
        TransferParams.parse({"epd": {"items": [str(i) for i in range(1025)]}})


def test_a_peers_bad_entry_fails_that_item_alone_when_asked():
    answer = {"epd": {"items": {"good": {"nbytes": 3}, "bad": {"nbytes": -1}, "worse": 7}}}
    with pytest.raises(BadParams):
        TransferParams.parse(answer)
    bad: list[str] = []
    got = TransferParams.parse(answer, bad_items=bad)
    assert got.items == {"good": ItemEntry(nbytes=3)} and sorted(bad) == ["bad", "worse"]
    with pytest.raises(BadParams):  # a malformed whole is still an error
        TransferParams.parse({"epd": {"items": 5}}, bad_items=[])


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
    assert ItemEntry.describe("a", 4, INFO).to_dict() == {
        k: v for k, v in before["epd"]["items"]["a"].items() if k != "location"}


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
    assert sources({"epd": {"items": {"a": {"location": None}}, "endpoint": None}}) == {
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
    # Qwen3-VL video: a timestamp per temporal group (120 frames at 30 fps; 1024 frames)
    ({"video_grid_thw": [60, 32, 32], "timestamps": [(2 * i + 0.5) / 30 for i in range(60)]},
     True),
    ({"video_grid_thw": [512, 4, 4], "timestamps": [(2 * i + 0.5) / 7 for i in range(512)]},
     True),
    ({}, False), ("x", False), ([1], False), (None, False),
    ({"a": []}, False), ({"a": [[1, 2]]}, False), ({"a": True}, False), ({"a": "1"}, False),
    ({"a": list(range(MAX_METADATA_BYTES))}, False),  # over the bound as JSON
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


_entries = st.builds(
    ItemEntry,
    num_embeds=st.integers(0, (1 << 31) - 1), key=st.text(max_size=256),
    shape=st.lists(st.integers(0, (1 << 31) - 1), max_size=8), dtype=st.text(max_size=32),
    nbytes=st.integers(0, (1 << 40) - 1), checksum=st.text(max_size=128),
    location=st.sampled_from(["", "10.0.0.1:7000", "host.example:1"]),
    pending=st.booleans(),
    metadata=st.none() | st.dictionaries(
        st.text(min_size=1, max_size=20),
        st.integers(-1000, 1000) | st.lists(st.integers(0, 64), min_size=1, max_size=4),
        min_size=1, max_size=4))
_ids = st.text(min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(items=st.dictionaries(_ids, _entries, max_size=6),
       endpoint=st.sampled_from(["", "10.0.0.2:7001"]),
       names=st.tuples(st.text(max_size=30), st.text(max_size=30), st.text(max_size=30)))
def test_whatever_a_writer_builds_parses_back_to_itself(items, endpoint, names):
    sent = TransferParams(transport=names[0], namespace=names[1], producer=names[2],
                          items=items, endpoint=endpoint)
    assert TransferParams.parse(sent.to_dict()) == sent
    assert TransferParams.from_json(sent.to_json()) == sent
