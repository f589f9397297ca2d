"""Position maps and the vectorized merge of text embeddings with media embeddings.

A prompt carries one placeholder token per media item (`expanded=False`, the default), or a
run of `num_tokens` placeholder tokens per item (`expanded=True`, what vLLM's processors
produce). The position map says, for each item in prompt order, which placeholder it fills
and where its rows land in the merged sequence; `merge_embeddings` then fills the merged
sequence with batched embedding lookups written straight into the output (`index_select`
with `out=`, one per run of consecutive text tokens) plus one slice write per item: the
Python loop runs over runs and items, never over tokens. Pass a reused `out` buffer (as a
serving engine's persistent input-embeddings buffer) to skip first-touch page faults.
`merge_loop` is the per-token reference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


class MergeError(ValueError):
    """The prompt, the items and the embeddings disagree; the message names the item."""


@dataclass(frozen=True)
class ItemRef:
    """A media item of a prompt, in prompt order."""

    item_id: str
    modality: str
    num_tokens: int


@dataclass(frozen=True)
class Span:
    """Where one item lands: placeholder `index` (0-based, prompt order), merged rows
    `[start, end)`."""

    index: int
    item_id: str
    modality: str
    num_tokens: int
    start: int
    end: int


@dataclass(frozen=True)
class PositionMap:
    spans: tuple[Span, ...]
    length: int  # rows of the merged sequence
    text_positions: torch.Tensor  # int64 [num_text]: merged row of each text token
    text_token_ids: torch.Tensor  # int64 [num_text]: those tokens' ids, same order

    def text_runs(self) -> list[tuple[int, int, int]]:
        """(merged_start, index into text_token_ids, length) of each run of consecutive text
        rows: at most items + 1 runs."""
        pos = self.text_positions
        if pos.numel() == 0:
            return []
        breaks = torch.nonzero(pos[1:] - pos[:-1] != 1).flatten() + 1
        starts = [0, *breaks.tolist()]
        ends = [*starts[1:], pos.numel()]
        firsts = pos[torch.tensor(starts)].tolist()
        return [(m, a, b - a) for m, a, b in zip(firsts, starts, ends, strict=True)]

    def span(self, item_id: str) -> Span:
        for s in self.spans:
            if s.item_id == item_id:
                return s
        raise KeyError(item_id)


def _as_ids(token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(token_ids)
    if ids.dim() != 1:
        raise MergeError(f"token ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.numel() and (ids.is_floating_point() or ids.is_complex()):
        raise MergeError("token ids must be integers")
    return ids.to(torch.int64)


def build_position_map(
    token_ids: Sequence[int] | torch.Tensor,
    items: Sequence[ItemRef],
    placeholder_ids: Mapping[int, str],
    *,
    expanded: bool = False,
) -> PositionMap:
    """Map `items` (prompt order) onto the placeholders of `token_ids`.

    `placeholder_ids` maps each placeholder token id to its modality. Raises MergeError on
    a count, modality or token-count mismatch, naming the item.
    """
    ids = _as_ids(token_ids)
    for it in items:
        if it.num_tokens <= 0:
            raise MergeError(f"item {it.item_id!r} has {it.num_tokens} tokens; need >= 1")
    ph_tokens = torch.tensor(sorted(placeholder_ids), dtype=torch.int64)
    is_ph = torch.isin(ids, ph_tokens)
    positions = torch.nonzero(is_ph).flatten()
    pos_list = positions.tolist()
    if expanded:
        return _map_expanded(ids, items, placeholder_ids, is_ph, pos_list)
    if len(pos_list) != len(items):
        raise MergeError(f"prompt has {len(pos_list)} placeholder(s) for {len(items)} item(s)")
    spans: list[Span] = []
    shift = 0
    for i, (p, it) in enumerate(zip(pos_list, items, strict=True)):
        modality = placeholder_ids[int(ids[p])]
        if modality != it.modality:
            raise MergeError(f"item {it.item_id!r} is {it.modality} but placeholder {i} "
                             f"(position {p}) is {modality}")
        start = p + shift
        spans.append(Span(i, it.item_id, it.modality, it.num_tokens, start,
                          start + it.num_tokens))
        shift += it.num_tokens - 1
    # merged row of token k = k + sum of (n - 1) over placeholders before k
    growth = torch.zeros(ids.numel() + 1, dtype=torch.int64)
    if items:
        growth[positions + 1] = torch.tensor([it.num_tokens - 1 for it in items])
    offsets = torch.cumsum(growth, 0)[:-1]
    merged = torch.arange(ids.numel(), dtype=torch.int64) + offsets
    text = ~is_ph
    return PositionMap(tuple(spans), ids.numel() + shift, merged[text], ids[text])


def _map_expanded(ids: torch.Tensor, items: Sequence[ItemRef], placeholder_ids: Mapping[int, str],
                  is_ph: torch.Tensor, pos: list[int]) -> PositionMap:
    spans: list[Span] = []
    cursor = 0
    for i, it in enumerate(items):
        if cursor + it.num_tokens > len(pos):
            raise MergeError(f"item {it.item_id!r} expects {it.num_tokens} tokens but only "
                             f"{len(pos) - cursor} placeholder token(s) remain in the prompt")
        start, last = pos[cursor], pos[cursor + it.num_tokens - 1]
        if last - start != it.num_tokens - 1:
            run = 1
            while cursor + run < len(pos) and pos[cursor + run] == start + run:
                run += 1
            raise MergeError(f"item {it.item_id!r} expects {it.num_tokens} tokens but its "
                             f"placeholder run at position {start} has {run}")
        kinds = {placeholder_ids[t] for t in ids[start:last + 1].unique().tolist()}
        if kinds != {it.modality}:
            raise MergeError(f"item {it.item_id!r} is {it.modality} but its placeholder run at "
                             f"position {start} is {'/'.join(sorted(kinds))}")
        spans.append(Span(i, it.item_id, it.modality, it.num_tokens, start, last + 1))
        cursor += it.num_tokens
    if cursor != len(pos):
        raise MergeError(f"prompt has {len(pos) - cursor} placeholder token(s) left over after "
                         f"{len(items)} item(s)")
    text = ~is_ph
    return PositionMap(tuple(spans), ids.numel(),
                       torch.nonzero(text).flatten(), ids[text])


def _checked(pmap: PositionMap, features: Mapping[str, torch.Tensor], dim: int,
             ) -> list[tuple[Span, torch.Tensor]]:
    out = []
    for s in pmap.spans:
        emb = features.get(s.item_id)
        if emb is None:
            raise MergeError(f"no embedding for item {s.item_id!r}")
        if emb.dim() != 2 or emb.shape[0] != s.num_tokens or emb.shape[1] != dim:
            raise MergeError(f"item {s.item_id!r}: embedding has shape {tuple(emb.shape)}, "
                             f"the prompt needs ({s.num_tokens}, {dim})")
        out.append((s, emb))
    return out


def merge_embeddings(pmap: PositionMap, embed_weight: torch.Tensor,
                     features: Mapping[str, torch.Tensor],
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The merged input embeddings `[pmap.length, d]` in `embed_weight`'s dtype/device:
    one batched lookup for the text tokens, one slice write per item."""
    dim = embed_weight.shape[1]
    pairs = _checked(pmap, features, dim)
    if out is None:
        out = torch.empty(pmap.length, dim, dtype=embed_weight.dtype, device=embed_weight.device)
    elif out.shape != (pmap.length, dim) or out.dtype != embed_weight.dtype:
        raise MergeError(f"out is {tuple(out.shape)} {out.dtype}, need ({pmap.length}, {dim}) "
                         f"{embed_weight.dtype}")
    ids = pmap.text_token_ids.to(embed_weight.device)
    for start, src, n in pmap.text_runs():
        torch.index_select(embed_weight, 0, ids[src:src + n], out=out[start:start + n])
    for s, emb in pairs:
        out[s.start:s.end] = emb
    return out


def merge_loop(token_ids: Sequence[int] | torch.Tensor, items: Sequence[ItemRef],
               placeholder_ids: Mapping[int, str], embed_weight: torch.Tensor,
               features: Mapping[str, torch.Tensor], *, expanded: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference merge: a Python loop over tokens, row by row (tests and benchmarks only)."""
    rows: list[torch.Tensor] = []
    item_iter = iter(items)
    current: ItemRef | None = None
    row_in_item = 0
    for tok in _as_ids(token_ids).tolist():
        if tok not in placeholder_ids:
            rows.append(embed_weight[tok])
            continue
        if expanded:
            if current is None or row_in_item == current.num_tokens:
                current, row_in_item = next(item_iter), 0
            rows.append(features[current.item_id][row_in_item].to(embed_weight.dtype))
            row_in_item += 1
        else:
            item = next(item_iter)
            for r in range(item.num_tokens):
                rows.append(features[item.item_id][r].to(embed_weight.dtype))
    if out is None:
        out = torch.empty(len(rows), embed_weight.shape[1], dtype=embed_weight.dtype,
                          device=embed_weight.device)
    for i, row in enumerate(rows):
        out[i] = row
    return out
