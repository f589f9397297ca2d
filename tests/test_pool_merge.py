"""Position maps and the vectorized merge, against the per-token loop oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from encoder_service.pool.merge import (
    ItemRef,
    MergeError,
    build_position_map,
    merge_embeddings,
    merge_loop,
)

IMG, VID = 90, 91  # placeholder token ids
PH = {IMG: "image", VID: "video"}
VOCAB, DIM = 96, 8


@st.composite
def prompts(draw, expanded: bool):
    """Random prompts: text tokens interleaved with items, each item one placeholder
    (or a run of num_tokens placeholders when expanded), adjacent items allowed."""
    n_items = draw(st.integers(0, 5))
    ids: list[int] = draw(st.lists(st.integers(0, 89), max_size=6))
    items = []
    for i in range(n_items):
        modality = draw(st.sampled_from(["image", "video"]))
        n = draw(st.integers(1, 7))
        items.append(ItemRef(f"item-{i}", modality, n))
        ph = IMG if modality == "image" else VID
        ids += [ph] * (n if expanded else 1)
        ids += draw(st.lists(st.integers(0, 89), max_size=6))
    return ids, items


def tables(items, seed):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(VOCAB, DIM, generator=g)
    feats = {it.item_id: torch.randn(it.num_tokens, DIM, generator=g) for it in items}
    return weight, feats


@settings(max_examples=300, deadline=None)
@given(st.booleans().flatmap(lambda e: st.tuples(st.just(e), prompts(e))), st.integers(0, 99))
def test_vectorized_merge_equals_loop_oracle(case, seed):
    expanded, (ids, items) = case
    weight, feats = tables(items, seed)
    pmap = build_position_map(ids, items, PH, expanded=expanded)
    fast = merge_embeddings(pmap, weight, feats)
    slow = merge_loop(ids, items, PH, weight, feats, expanded=expanded)
    assert torch.equal(fast, slow)
    expected_len = len(ids) if expanded else len(ids) - len(items) + sum(
        it.num_tokens for it in items)
    assert pmap.length == expected_len
    for k, span in enumerate(pmap.spans):  # the map describes each item in prompt order
        assert (span.index, span.item_id, span.num_tokens) == (k, items[k].item_id,
                                                               items[k].num_tokens)
        assert torch.equal(fast[span.start:span.end], feats[span.item_id])


def test_map_fields_for_a_known_prompt():
    ids = [1, IMG, 2, 3, VID, 4]
    items = [ItemRef("cat", "image", 3), ItemRef("clip", "video", 2)]
    pmap = build_position_map(ids, items, PH)
    assert [(s.index, s.item_id, s.modality, s.num_tokens, s.start, s.end)
            for s in pmap.spans] == [(0, "cat", "image", 3, 1, 4), (1, "clip", "video", 2, 6, 8)]
    assert pmap.length == 9
    assert pmap.text_positions.tolist() == [0, 4, 5, 8]
    assert pmap.text_token_ids.tolist() == [1, 2, 3, 4]


def test_wrong_embedding_size_is_rejected_naming_the_item():
    ids = [1, IMG, 2]
    items = [ItemRef("photo-7", "image", 4)]
    weight, feats = tables(items, 0)
    feats["photo-7"] = torch.randn(3, DIM)
    pmap = build_position_map(ids, items, PH)
    with pytest.raises(MergeError, match=r"'photo-7'.*\(3, 8\).*\(4, 8\)"):
        merge_embeddings(pmap, weight, feats)


@pytest.mark.parametrize("ids,items,msg", [
    ([1, IMG, IMG, 2], [ItemRef("a", "image", 3)], r"'a' expects 3 tokens.* 2 placeholder"),
    ([1, IMG, IMG, IMG, IMG], [ItemRef("a", "image", 3)], "1 placeholder token"),
    ([1, VID, VID], [ItemRef("a", "image", 2)], r"'a' is image .* video"),
    ([1, IMG, 2, IMG], [ItemRef("a", "image", 1), ItemRef("b", "image", 2)],
     r"'b' expects 2 tokens"),
])
def test_expanded_prompt_mismatches_name_the_item(ids, items, msg):
    with pytest.raises(MergeError, match=msg):
        build_position_map(ids, items, PH, expanded=True)


def test_unexpanded_prompt_mismatches():
    with pytest.raises(MergeError, match="2 placeholder"):
        build_position_map([IMG, IMG], [ItemRef("a", "image", 2)], PH)
    with pytest.raises(MergeError, match="'a' is video"):
        build_position_map([IMG], [ItemRef("a", "video", 2)], PH)
    with pytest.raises(MergeError, match="'a' has 0 tokens"):
        build_position_map([IMG], [ItemRef("a", "image", 0)], PH)
    with pytest.raises(MergeError, match="1-D"):
        build_position_map([[IMG]], [ItemRef("a", "image", 1)], PH)
    with pytest.raises(MergeError, match="no embedding for item 'a'"):
        pmap = build_position_map([IMG], [ItemRef("a", "image", 1)], PH)
        merge_embeddings(pmap, torch.randn(VOCAB, DIM), {})


def test_merge_writes_into_a_given_buffer_in_the_table_dtype():
    ids = [1, IMG, 2]
    items = [ItemRef("a", "image", 2)]
    weight = torch.randn(VOCAB, DIM).to(torch.bfloat16)
    feats = {"a": torch.randn(2, DIM)}  # float32: converted on write
    out = torch.empty(4, DIM, dtype=torch.bfloat16)
    res = merge_embeddings(build_position_map(ids, items, PH), weight, feats, out=out)
    assert res.data_ptr() == out.data_ptr() and res.dtype == torch.bfloat16
    assert torch.equal(res[1:3], feats["a"].to(torch.bfloat16))
