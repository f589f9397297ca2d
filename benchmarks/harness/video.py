"""Video at real sizes: the `qwen3-vl-video` test model and what every server, gateway and
request of a video benchmark gets for it.

Qwen3-VL with a 2048-wide language model of one narrow layer and DeepStack, so a 512 px
frame pair is 256 embedding rows of 2 x 2048 bf16: clips of 6, 30 and 120 frames (512 x 512
JPEG frame lists) are items of 6.3, 31.5 and 125.8 MB, the sizes real Qwen-VL encoders emit
for them. Every vLLM server keeps every frame (`MEDIA_IO`: num_frames 128) and takes
20k-token prompts (`VLLM_ARGS`).
"""

from __future__ import annotations

from encoder_service.local.requests import sample_frames, video_part
from encoder_service.local.testmodels import SPECS

SPEC = SPECS["qwen3-vl-video"]
MODEL = SPEC.model_name
SIDE = 512
# a 120-frame clip of 512 px JPEG frames is above the gateway's default limit per media
# item, so every gateway here takes larger ones
GATEWAY = {"limits": {"max_media_bytes": 64 << 20, "max_request_bytes": 96 << 20}}
VLLM_ARGS = ["--max-model-len", "20000", "--limit-mm-per-prompt", '{"image": 1, "video": 1}']
MEDIA_IO = {"video": {"num_frames": 128}}
ROW_BYTES = 2 * SPEC.lm_hidden * 2  # DeepStack doubles the width; bf16


def clip(seed: int, frames: int) -> dict:
    """The frames a client sampled itself (`data:video/jpeg;base64,...`: every frame is
    kept, as vLLM keeps a frame list)."""
    return video_part(sample_frames(seed, frames, SIDE))


def item_mb(frames: int) -> float:
    """The embedding's size of a clip of `frames` frames, in MB."""
    return (frames // 2) * (SIDE // 32) ** 2 * ROW_BYTES / 1e6
