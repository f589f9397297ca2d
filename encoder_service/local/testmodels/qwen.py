"""Tiny Qwen-family test models with random weights.

Tiny Qwen-family test models: Qwen2.5-VL (image + video), the Qwen2.5-Omni thinker (image,
video and audio in one model) and Qwen3-VL (images and video; its DeepStack encoder output is
wider than the language model's hidden size). Random weights, local tokenizer, no downloads.

They take metadata-only parts on an EC consumer (vLLM's `embedding_fields`), which the tiny
LLaVA cannot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from encoder_service.local.testmodels.spec import ModelSpec
from encoder_service.local.testmodels.tokenizer import train_tokenizer

# One chat template serves raw media and metadata-only parts: vLLM hands `*_embeds` parts to
# the template as {"type": "image"|"video"|"audio"}.
_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url', 'image_embeds') %}"
    "{{ '<|vision_start|>IMAGE<|vision_end|>' }}"
    "{% elif part['type'] in ('video', 'video_url', 'video_embeds') %}"
    "{{ '<|vision_start|>VIDEO<|vision_end|>' }}"
    "{% elif part['type'] in ('audio', 'audio_url', 'input_audio', 'audio_embeds') %}"
    "{{ '<|audio_bos|>AUDIO<|audio_eos|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Placeholder token of each modality, per family (vLLM's Qwen code names them).
_TOKENS = {
    "qwen2_5_vl": {"image": "<|image_pad|>", "video": "<|video_pad|>"},
    "qwen2_5_omni": {"image": "<|IMAGE|>", "video": "<|VIDEO|>", "audio": "<|AUDIO|>"},
    "qwen3_vl": {"image": "<|image_pad|>", "video": "<|video_pad|>"},
}
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
             "<|vision_end|>", "<|audio_bos|>", "<|audio_eos|>"]
# the Omni processor reads these names from the tokenizer
_BOUNDARIES = {"vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
               "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
_MIN_PIXELS = 56 * 56
_MAX_PIXELS = 224 * 224


def _template(family: str) -> str:
    tokens = _TOKENS[family]
    out = _TEMPLATE
    for modality in ("image", "video", "audio"):
        out = out.replace(modality.upper(), tokens.get(modality, ""))
    return out


def _tokenizer(family: str, vocab_size: int, out: Path):
    tokens = _TOKENS[family]
    return train_tokenizer(
        out, vocab_size, _SPECIALS + list(tokens.values()), _template(family),
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={**{f"{m}_token": t for m, t in tokens.items()}, **_BOUNDARIES})


def _vocab(tokenizer) -> int:
    return (len(tokenizer) + 63) // 64 * 64


def _text_kwargs(spec: ModelSpec, tokenizer) -> dict:
    return dict(
        hidden_size=spec.lm_hidden, intermediate_size=spec.lm_intermediate or spec.lm_hidden * 2,
        num_hidden_layers=spec.lm_layers, num_attention_heads=spec.lm_heads,
        num_key_value_heads=spec.lm_heads, vocab_size=_vocab(tokenizer),
        max_position_embeddings=spec.max_positions, tie_word_embeddings=False,
        # mrope sections sum to head_dim / 2
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": _mrope(_head_dim(spec))},
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _head_dim(spec: ModelSpec) -> int:
    if spec.lm_head_dim and spec.family != "qwen3_vl":
        raise ValueError("lm_head_dim: only Qwen3-VL's LM reads head_dim from its config")
    return spec.lm_head_dim or spec.lm_hidden // spec.lm_heads


def _mrope(head_dim: int) -> list[int]:
    half = head_dim // 2
    t = half // 4
    hw = (half - t) // 2
    return [t, hw, half - t - hw]


def _vision_kwargs(spec: ModelSpec) -> dict:
    return dict(
        depth=spec.vision_layers, hidden_size=spec.vision_hidden,
        intermediate_size=spec.vision_hidden * 2, num_heads=spec.vision_heads,
        patch_size=spec.patch_size, spatial_merge_size=2, temporal_patch_size=2,
        window_size=112, out_hidden_size=spec.lm_hidden,
        fullatt_block_indexes=[spec.vision_layers - 1],
    )


def _image_processors(patch_size: int = 14, max_pixels: int = _MAX_PIXELS):
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    size = {"shortest_edge": _MIN_PIXELS, "longest_edge": max_pixels}
    image = Qwen2VLImageProcessor(size=size, min_pixels=_MIN_PIXELS, max_pixels=max_pixels,
                                  patch_size=patch_size)
    video = Qwen2VLVideoProcessor(size=size, min_pixels=_MIN_PIXELS, max_pixels=max_pixels,
                                  min_frames=2, max_frames=8, fps=2.0, do_sample_frames=False,
                                  patch_size=patch_size)
    return image, video


class _Parts(NamedTuple):
    """What a family's builder hands back.

    What a family's builder hands back: the config to save, the model (its LM head is
    scaled before saving), the prefix of its weights' names, and the processor to save."""

    config: Any
    model: Any
    prefix: str
    processor: Any


def _qwen3_vl(spec: ModelSpec, tokenizer, ids: dict[str, int], image_proc) -> _Parts:
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    text = _text_kwargs(spec, tokenizer)
    text["head_dim"] = _head_dim(spec)
    text["rope_parameters"]["mrope_interleaved"] = True
    vision = {k: v for k, v in _vision_kwargs(spec).items()
              if k not in ("window_size", "fullatt_block_indexes")}
    # DeepStack: features of these vision layers ride along the last one's, so the
    # encoder output is (1 + len) * out_hidden_size wide
    vision.update(deepstack_visual_indexes=[0], num_position_embeddings=256,
                  hidden_act="gelu_pytorch_tanh")
    config = Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["image"],
        video_token_id=ids["video"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"], tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    model = Qwen3VLForConditionalGeneration(config)
    video_proc = Qwen3VLVideoProcessor(
        size={"shortest_edge": _MIN_PIXELS,
              "longest_edge": spec.max_video_pixels or spec.max_pixels},
        patch_size=spec.patch_size, min_frames=2, max_frames=spec.max_frames,
        fps=spec.video_fps, do_sample_frames=False)
    processor = Qwen3VLProcessor(image_processor=image_proc, video_processor=video_proc,
                                 tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    return _Parts(config, model, "", processor)


def _qwen2_5_vl(spec: ModelSpec, tokenizer, ids: dict[str, int], image_proc, video_proc
                ) -> _Parts:
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
    )

    config = Qwen2_5_VLConfig(
        text_config=_text_kwargs(spec, tokenizer), vision_config=_vision_kwargs(spec),
        image_token_id=ids["image"], video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    model = Qwen2_5_VLForConditionalGeneration(config)
    processor = Qwen2_5_VLProcessor(image_processor=image_proc, video_processor=video_proc,
                                    tokenizer=tokenizer, chat_template=tokenizer.chat_template)
    return _Parts(config, model, "", processor)


def _qwen2_5_omni(spec: ModelSpec, tokenizer, ids: dict[str, int], image_proc, video_proc
                  ) -> _Parts:
    from transformers import (
        Qwen2_5OmniConfig,
        Qwen2_5OmniProcessor,
        Qwen2_5OmniThinkerConfig,
        Qwen2_5OmniThinkerForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    thinker = Qwen2_5OmniThinkerConfig(
        text_config=_text_kwargs(spec, tokenizer), vision_config=_vision_kwargs(spec),
        audio_config=dict(
            num_mel_bins=128, encoder_layers=spec.vision_layers, encoder_attention_heads=2,
            encoder_ffn_dim=spec.vision_hidden * 2, d_model=spec.vision_hidden,
            max_source_positions=1500, n_window=100, output_dim=spec.lm_hidden,
        ),
        audio_token_index=ids["audio"], image_token_index=ids["image"],
        video_token_index=ids["video"],
        audio_start_token_id=tokenizer.convert_tokens_to_ids("<|audio_bos|>"),
        audio_end_token_id=tokenizer.convert_tokens_to_ids("<|audio_eos|>"),
        vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
        user_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        tie_word_embeddings=False,
    )
    model = Qwen2_5OmniThinkerForConditionalGeneration(thinker)
    config = Qwen2_5OmniConfig(thinker_config=thinker.to_dict(), enable_audio_output=False)
    config.architectures = ["Qwen2_5OmniModel"]
    processor = Qwen2_5OmniProcessor(
        image_processor=image_proc, video_processor=video_proc,
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=16000),
        tokenizer=tokenizer, chat_template=tokenizer.chat_template,
    )
    return _Parts(config, model, "thinker.", processor)


def build_qwen(tmp: Path, spec: ModelSpec) -> None:
    """Write a tiny model of `spec.family` into `tmp` (the caller stamps and moves it)."""
    import torch
    from safetensors.torch import save_file

    if spec.family not in _TOKENS:
        raise ValueError(f"unknown model family {spec.family!r}")
    tokenizer = _tokenizer(spec.family, spec.vocab_size, tmp)
    ids = {m: tokenizer.convert_tokens_to_ids(t) for m, t in _TOKENS[spec.family].items()}
    ids["vision_start"] = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    ids["vision_end"] = tokenizer.convert_tokens_to_ids("<|vision_end|>")
    torch.manual_seed(spec.seed)  # the weights: same seed, same model
    image_proc, video_proc = _image_processors(spec.patch_size, spec.max_pixels)
    if spec.family == "qwen3_vl":
        parts = _qwen3_vl(spec, tokenizer, ids, image_proc)
    elif spec.family == "qwen2_5_vl":
        parts = _qwen2_5_vl(spec, tokenizer, ids, image_proc, video_proc)
    else:
        parts = _qwen2_5_omni(spec, tokenizer, ids, image_proc, video_proc)
    model = parts.model.to(torch.bfloat16)
    parts.config.dtype = "bfloat16"
    with torch.no_grad():  # well separated greedy tokens (see llava.build_llava)
        model.lm_head.weight.mul_(8.0)
    parts.config.save_pretrained(tmp)
    state = {parts.prefix + k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    parts.processor.save_pretrained(tmp)
