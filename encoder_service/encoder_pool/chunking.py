"""A long video encoded in chunks on temporal-patch boundaries, assembled by position map.

Why: a video encoded as one block holds its worker for the whole encode (seconds for a long
clip on a CPU core), and every image queued behind it waits that long for its first token.
Split into chunks, other batches go between the video's on the worker (batching.py).

Why the result is the whole encode's: in Qwen2-VL and Qwen2.5-VL (window and full-attention
layers alike, and the Qwen2.5-Omni thinker's copy of that tower) attention never crosses a
temporal patch group (`cu_seqlens` per group) and position embeddings are spatial, tiled over
time. So a chunk of whole groups, cut from the pixel rows of a video that was sampled,
resized and patched once as a whole (`prepare`: the processors size frames from a budget
that depends on the total frame count), encodes to exactly the rows the whole video gives
for those groups. Bit for bit on the CPU here (tests/e2e/test_qwen_modalities.py); on GPUs
GEMM kernels may round differently for other row counts, as cross-request batching already
does. Towers that attend across the whole video must not be split: models.py names the
architectures that may (`MediaEncoder.chunks_video`).

The position map is chunk -> rows of the item's embedding. Rows are contiguous per chunk in
the embedding, not in the prompt (Qwen3-VL interleaves timestamp tokens between groups;
Qwen2.5-VL's M-RoPE time index is computed from the whole grid), which is why chunks are
assembled into one embedding before anything downstream sees the item.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import torch

from encoder_service.encoder_pool.media import MediaItem

_GRID, _PIXELS = "video_grid_thw", "pixel_values_videos"


@dataclass(frozen=True)
class Chunk:
    """One chunk of a video and the embedding rows it fills.

    One chunk of a video: its index, the rows [start, stop) of the item's embedding it
    fills, and the item holding only its temporal groups (`item_id`: the video's + `#k`)."""

    index: int
    rows: tuple[int, int]
    item: MediaItem


def _groups_per_chunk(item: MediaItem, max_rows: int) -> int:
    """How many whole temporal groups go in each chunk of a video; 0 when unsplit.

    Whole temporal groups per chunk of `item` (at most `max_rows` rows, at least one
    group); 0 when it is not split (not a prepared video with a temporal grid in the layout
    this split knows, or it fits one chunk)."""
    kwargs = item.prepared
    if item.modality != "video" or max_rows <= 0 or kwargs is None:
        return 0
    grid, pixels = kwargs.get(_GRID), kwargs.get(_PIXELS)
    if grid is None or pixels is None or not isinstance(pixels.data, torch.Tensor):
        return 0
    t, h, w = (int(x) for x in grid.data.reshape(-1).tolist())
    if t <= 1 or item.num_embeds % t or pixels.data.shape[0] != t * h * w:
        return 0  # not the layout this split knows: encode whole
    groups = max(1, max_rows // (item.num_embeds // t))
    return groups if groups < t else 0


def chunk_count(item: MediaItem, max_rows: int) -> int:
    """How many chunks `split_video` cuts `item` into (0: not split), without cutting."""
    groups = _groups_per_chunk(item, max_rows)
    if not groups:
        return 0
    t = int(item.prepared[_GRID].data.reshape(-1)[0])
    return -(-t // groups)


def split_video(item: MediaItem, max_rows: int) -> list[Chunk]:
    """Split a video into chunks of whole temporal groups.

    The video's chunks, each of whole temporal groups and at most `max_rows` embedding
    rows (at least one group); [] when the item is not split (`_groups_per_chunk`)."""
    from vllm.multimodal.inputs import MultiModalFieldElem, MultiModalKwargsItem

    groups = _groups_per_chunk(item, max_rows)
    if not groups:
        return []
    kwargs = item.prepared
    grid, pixels = kwargs[_GRID], kwargs[_PIXELS]
    t, h, w = (int(x) for x in grid.data.reshape(-1).tolist())
    rows_per_group, patches_per_group = item.num_embeds // t, h * w
    chunks = []
    for index, g0 in enumerate(range(0, t, groups)):
        n = min(groups, t - g0)
        part = MultiModalKwargsItem(dict(kwargs))  # other fields (fps, timing) are shared
        part[_PIXELS] = MultiModalFieldElem(
            data=pixels.data[g0 * patches_per_group:(g0 + n) * patches_per_group],
            field=pixels.field)
        part[_GRID] = MultiModalFieldElem(
            data=torch.tensor([n, h, w], dtype=grid.data.dtype).reshape(grid.data.shape),
            field=grid.field)
        rows = (g0 * rows_per_group, (g0 + n) * rows_per_group)
        chunks.append(Chunk(index, rows, replace(
            item, item_id=f"{item.item_id}#{index}", prepared=part,
            num_embeds=rows[1] - rows[0], media=None)))
    return chunks


class Assembly:
    """An item's embedding, assembled in place from its chunks.

    The item's embedding filled in place, chunk by chunk, in any order; `complete` once
    every chunk of the position map has been placed (each exactly once, each the size its
    rows say). Thread-safe."""

    def __init__(self, item_id: str, chunks: list[Chunk]) -> None:
        self.item_id = item_id
        self.position_map = {c.index: c.rows for c in chunks}
        self.rows = max(stop for _, stop in self.position_map.values())
        self._missing = set(self.position_map)
        self._buffer: torch.Tensor | None = None
        self._lock = threading.Lock()

    @property
    def complete(self) -> bool:
        return not self._missing

    def place(self, index: int, tensor: torch.Tensor) -> torch.Tensor | None:
        """Copy chunk `index` into its rows; the whole embedding once it is complete."""
        start, stop = self.position_map[index]
        if tensor.ndim != 2 or tensor.shape[0] != stop - start:
            raise ValueError(f"item {self.item_id!r}: chunk {index} is {tuple(tensor.shape)}; "
                             f"its rows are {start}:{stop}")
        with self._lock:
            if index not in self._missing:
                raise ValueError(f"item {self.item_id!r}: chunk {index} placed twice")
            if self._buffer is None:  # width and dtype: the encoder's, known at first chunk
                self._buffer = torch.empty((self.rows, tensor.shape[1]), dtype=tensor.dtype)
            elif tensor.shape[1:] != self._buffer.shape[1:] or tensor.dtype != self._buffer.dtype:
                raise ValueError(f"item {self.item_id!r}: chunk {index} is "
                                 f"{tuple(tensor.shape)} {tensor.dtype}, the others "
                                 f"{tuple(self._buffer.shape[1:])} {self._buffer.dtype}")
            self._buffer[start:stop].copy_(tensor)
            self._missing.discard(index)
            return self._buffer if not self._missing else None
