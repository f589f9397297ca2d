"""The fake encoder of the pool's logic tests (test_batching.py, test_chunking.py): the pool
is what they test, not the model. The real encoders run in test_server.py and in
tests/e2e/test_connector_safetensors.py and test_qwen_modalities.py."""

from __future__ import annotations

import threading
import time

import torch

from encoder_service.encoder_pool.media import MediaItem

MERGE = 4  # a video's pixel rows per embedding row (a 2x2 spatial merge)
TOKENS, DIM = 3, 4  # an image's rows (per 64 px of width) and columns, by default


class FakeEncoder:
    """A `MediaEncoder` that records each batch's ids (`batches`) and images' widths.

    Images: `tokens` rows per 64 px of width estimated (wider images count more: batch token
    budgets), `tokens` rows of `len(item_id)` encoded. Videos (`modalities` with "video"):
    row i is the mean of pixel rows [4i, 4i + 4) (first `hidden_size` columns), what a tower
    attending within temporal groups gives whatever the chunking (`chunks_video`).

    Slow or failing on demand: `delay` seconds per batch, `delay_per_row` per embedding row
    (after encoding), ids in `fail` raise, an image wider than `oom_above` or a batch of
    more than `oom_batch_above` items runs out of memory."""

    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, *, modalities: tuple[str, ...] = ("image",), hidden_size: int = DIM,
                 tokens: int = TOKENS, chunks_video: bool = False, delay: float = 0.0,
                 delay_per_row: float = 0.0, fail: set[str] | None = None,
                 oom_above: int | None = None, oom_batch_above: int | None = None) -> None:
        self.modalities, self.hidden_size, self.tokens = modalities, hidden_size, tokens
        self.chunks_video = chunks_video
        self.delay, self.delay_per_row, self.fail = delay, delay_per_row, fail or set()
        self.oom_above, self.oom_batch_above = oom_above, oom_batch_above
        self.batches: list[list[str]] = []
        self.widths: list[int] = []
        self.lock = threading.Lock()

    def estimate_tokens(self, item: MediaItem) -> int:
        if item.modality == "video":
            return item.num_embeds
        return self.tokens * (item.size[0] // 64 or 1)

    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        with self.lock:
            self.batches.append([it.item_id for it in items])
        time.sleep(self.delay)
        if self.oom_batch_above and len(items) > self.oom_batch_above:
            raise torch.OutOfMemoryError("batch too big")
        out = []
        for it in items:
            if it.modality == "image":
                self.widths.append(it.size[0])
            if it.item_id in self.fail:
                raise ValueError(f"cannot encode {it.item_id}")
            if self.oom_above and it.modality == "image" and it.size[0] > self.oom_above:
                raise torch.OutOfMemoryError("image too big")
            out.append(self._embedding(it))
        time.sleep(self.delay_per_row * sum(o.shape[0] for o in out))
        return out

    def _embedding(self, item: MediaItem) -> torch.Tensor:
        if item.modality == "video":
            px = item.prepared["pixel_values_videos"].data
            return px[:, :self.hidden_size].reshape(-1, MERGE, self.hidden_size).mean(1) \
                .contiguous()
        return torch.full((self.tokens, self.hidden_size), float(len(item.item_id)))


def video_tower(**kw) -> FakeEncoder:
    """The fake as a Qwen-style tower: images and videos, 3 columns, an image one row,
    videos split into chunks (test_chunking.py)."""
    return FakeEncoder(**{"modalities": ("image", "video"), "hidden_size": 3, "tokens": 1,
                          "chunks_video": True, **kw})
