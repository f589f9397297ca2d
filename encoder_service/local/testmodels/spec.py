"""Test model specs: families, sizes and the named specs.

What a test model is made of: `ModelSpec` (family and sizes) and the named specs `SPECS`
(`epd build-model --spec`, `epd up --model tiny|qwen-vl|...`). Standard library only: `epd up`
reads the specs without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

# In every model's `epd_build.json` stamp: raise it when a build's output changes, so built
# models are rebuilt.
BUILDER_VERSION = 5


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of the generated model.

    `tiny` serves on 2 CPU cores; `large` gives realistic embedding sizes and a vision tower
    heavy enough to benchmark batching."""

    name: str = "tiny"
    family: str = "llava"  # llava | qwen2_5_vl | qwen2_5_omni | qwen3_vl
    image_size: int = 112  # 112 px / patch 14 -> 8x8 = 64 image tokens
    patch_size: int = 14
    vision_hidden: int = 64
    vision_layers: int = 2
    vision_heads: int = 2  # CPU attention needs head_dim >= 32
    lm_hidden: int = 128
    lm_layers: int = 2
    lm_heads: int = 4
    vocab_size: int = 512
    max_positions: int = 2048
    seed: int = 1234
    # Qwen3-VL only (its LM reads head_dim from the config): 0 = lm_hidden / lm_heads. A wide
    # LM with narrow attention and MLP gives real embedding sizes (bytes per row) at a
    # prefill cost the CPU can pay for thousands of rows.
    lm_head_dim: int = 0
    lm_intermediate: int = 0  # 0 = 2 * lm_hidden
    max_pixels: int = 224 * 224  # Qwen processors: the largest image or frame, in pixels
    max_video_pixels: int = 0  # Qwen3-VL: a whole video's pixel budget (0 = max_pixels)
    # Qwen3-VL: where its processor samples a container's frames, at this rate, at most this
    # many (vLLM keeps `--media-io-kwargs` num_frames first)
    video_fps: float = 2.0
    max_frames: int = 8

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def model_name(self) -> str:
        """Its directory under the work dir's models/ and its default served name."""
        if self.family == "llava":
            return "tiny-llava" if self.name == "tiny" else f"{self.name}-llava"
        return f"tiny-{self.name}"

    @property
    def modalities(self) -> tuple[str, ...]:
        return {"llava": ("image",), "qwen2_5_vl": ("image", "video"),
                "qwen3_vl": ("image", "video")}.get(
            self.family, ("image", "video", "audio"))


SPECS = {
    "tiny": ModelSpec(),
    # 336 pixels -> 576 tokens x 1024 hidden: a bf16 embedding and a ViT that cost real CPU.
    "large": ModelSpec(
        name="large", image_size=336, vision_hidden=512, vision_layers=6, vision_heads=8,
        lm_hidden=1024, lm_layers=2, lm_heads=16,
    ),
    # ViT-L/32-style tower (1024 wide, 12 layers, 49 tokens per 224 px image): per-image
    # matrices are small, so cross-request batching pays on CPU (benchmarks/encoder/pool.py).
    "vitl32": ModelSpec(
        name="vitl32", image_size=224, patch_size=32, vision_hidden=1024, vision_layers=12,
        vision_heads=16, lm_hidden=2048, lm_layers=1, lm_heads=16,
    ),
    # The regime EPD exists for: a vision tower that costs far more than a decode step (tens
    # of ms per image on one CPU core) in front of the tiny language model.
    "heavy": ModelSpec(
        name="heavy", image_size=224, patch_size=14, vision_hidden=384, vision_layers=8,
        vision_heads=6,
    ),
    # Qwen family: dynamic resolution (a 112 px image -> 16 tokens after the 2x2 merge),
    # video (2-frame temporal patches) and, for the Omni thinker, audio (Whisper mels).
    "qwen-vl": ModelSpec(name="qwen-vl", family="qwen2_5_vl", lm_heads=2),
    "qwen-omni": ModelSpec(name="qwen-omni", family="qwen2_5_omni", lm_heads=2),
    # Qwen2.5-VL with a vision tower that costs what a real one does relative to the tiny
    # language model: on one CPU core a 120-frame 112 px video takes long enough to hold
    # images queued behind it (benchmarks/encoder/video_chunk.py; docs/benchmarks.md)
    "qwen-vl-heavy": ModelSpec(name="qwen-vl-heavy", family="qwen2_5_vl", lm_heads=2,
                               vision_hidden=512, vision_layers=8, vision_heads=8),
    # 16 px patches; a 128 px image -> 16 tokens, each 256 wide (DeepStack) for a 128-wide LM
    "qwen3-vl": ModelSpec(name="qwen3-vl", family="qwen3_vl", lm_heads=2, patch_size=16),
    # Video at real sizes: Qwen3-VL with a 2048-wide LM (one layer, one 64-wide head, a
    # 64-wide MLP) and DeepStack, so a 512-pixel frame pair is 256 rows of 2 x 2048 bf16:
    # the items are as large as the real models' (docs/benchmarks.md, video sizes), at a
    # prefill cost one CPU core pays (benchmarks/serving/video.py)
    "qwen3-vl-video": ModelSpec(
        name="qwen3-vl-video", family="qwen3_vl", patch_size=16, lm_hidden=2048, lm_layers=1,
        lm_heads=1, lm_head_dim=64, lm_intermediate=64, max_positions=32768,
        max_pixels=512 * 512, max_video_pixels=128 * 512 * 512, video_fps=30.0,
        max_frames=128),
}
