"""Vision encoders the pool runs: media items in, embeddings `[num_tokens, lm_hidden]` out.

`LlavaEncoder` reproduces what vLLM's LlavaForConditionalGeneration computes for an image:
the HF image processor from the model directory (what vLLM's multimodal processor uses), the
CLIP vision tower truncated at `vision_feature_layer` (post-layernorm only when every layer is
used, as in vLLM), the `vision_feature_select_strategy`, and the multimodal projector, in the
model's dtype. `Qwen25VLEncoder` does the same for Qwen2.5-VL images and videos: the model's
own HF image/video processors (dynamic resolution, 2-frame temporal patches), the vision
transformer with its patch merger, and the placeholder metadata (`image_grid_thw`,
`video_grid_thw`) a consumer needs for a metadata-only request; `QwenOmniEncoder` adds the
Qwen2.5-Omni thinker's audio encoder (Whisper mels, `audio_feature_lengths`). Families register in
`ENCODERS` by architecture name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from encoder_service.encoder_pool.media import MediaItem


class MediaEncoder(Protocol):
    """One model replica on one device. `encode` is called from one thread at a time."""

    modalities: tuple[str, ...]
    hidden_size: int
    dtype: torch.dtype
    device: torch.device

    def estimate_tokens(self, item: MediaItem) -> int:
        """Embedding rows the item will produce (before encoding: admission, batching)."""
        ...

    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """One embedding per item, same order, each its own contiguous CPU tensor."""
        ...

    def placeholder_metadata(self, item: MediaItem) -> dict[str, list[int]]:
        """What a consumer needs besides the embedding to take the item as a metadata-only
        part (vLLM's `embedding_fields`); {} when the model takes raw media only."""
        ...


def _dtype(name: str, config: dict) -> torch.dtype:
    if name == "auto":
        name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _load_weights(model_dir: Path, prefixes: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """Tensors whose names start with one of `prefixes`, grouped by prefix (prefix stripped).
    Reads only those tensors from the model's safetensors files."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    out: dict[str, dict[str, torch.Tensor]] = {p: {} for p in prefixes}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                for p in prefixes:
                    if name.startswith(p):
                        out[p][name[len(p):]] = f.get_tensor(name)
                        break
    return out


def layer_count(feature_layer: int, num_layers: int) -> int:
    """Encoder layers needed to produce hidden state `feature_layer` (vLLM's get_layer_index:
    negative counts from the end, hidden state 0 is the embeddings)."""
    n = feature_layer if feature_layer >= 0 else num_layers + feature_layer + 1
    if not 0 <= n <= num_layers:
        raise ValueError(f"vision_feature_layer {feature_layer} is out of range for "
                         f"{num_layers} layers")
    return n


class LlavaEncoder:
    """CLIP vision tower + LLaVA projector of a local LLaVA(-1.5 style) model directory."""

    modalities = ("image",)

    def __init__(self, model_dir: Path | str, device: str = "cpu", dtype: str = "auto") -> None:
        from transformers import AutoProcessor, CLIPVisionConfig, CLIPVisionModel, LlavaConfig
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        config = LlavaConfig.from_pretrained(model_dir)
        if not isinstance(config.vision_feature_layer, int):
            raise NotImplementedError("LlavaEncoder supports one vision_feature_layer, not "
                                      f"{config.vision_feature_layer!r}")
        vcfg = config.vision_config
        if not isinstance(vcfg, CLIPVisionConfig):
            raise NotImplementedError(f"vision tower {type(vcfg).__name__} is not supported yet")
        self.strategy = config.vision_feature_select_strategy
        if self.strategy not in ("default", "full"):
            raise NotImplementedError(f"feature select strategy {self.strategy!r}")
        self.dtype = _dtype(dtype, raw)
        self.device = torch.device(device)
        self.hidden_size = config.text_config.hidden_size
        total = vcfg.num_hidden_layers
        keep = layer_count(config.vision_feature_layer, total)
        self.post_norm = keep == total  # vLLM: post_layernorm only on a full tower

        tower_cfg = CLIPVisionConfig(**{**vcfg.to_dict(), "num_hidden_layers": keep})
        tower = CLIPVisionModel(tower_cfg)
        projector = LlavaMultiModalProjector(config)
        groups = _load_weights(model_dir, (
            "model.vision_tower.vision_model.", "vision_tower.vision_model.",
            "model.vision_tower.", "vision_tower.",
            "model.multi_modal_projector.", "multi_modal_projector.",
        ))
        vision = {**groups["model.vision_tower."], **groups["vision_tower."],
                  **groups["model.vision_tower.vision_model."],
                  **groups["vision_tower.vision_model."]}
        self._load(tower, vision, drop_layers_from=keep)
        self._load(projector, {**groups["model.multi_modal_projector."],
                               **groups["multi_modal_projector."]})
        self.tower = tower.to(self.device, self.dtype).eval()
        self.projector = projector.to(self.device, self.dtype).eval()
        self.processor = AutoProcessor.from_pretrained(model_dir).image_processor
        inner = getattr(self.tower, "vision_model", self.tower)  # transformers 4.x nests it
        self._post_layernorm = inner.post_layernorm
        grid = vcfg.image_size // vcfg.patch_size
        self._tokens = grid * grid + (1 if self.strategy == "full" else 0)

    @staticmethod
    def _load(module: torch.nn.Module, weights: dict[str, torch.Tensor],
              drop_layers_from: int | None = None) -> None:
        """Load by name (any `vision_model.` prefix ignored); layers past the kept depth are
        dropped; anything else missing or unexpected is an error."""
        def norm(k: str) -> str:
            return k.removeprefix("vision_model.")

        target = {norm(k): k for k in module.state_dict()}
        state, unexpected = {}, []
        for k, v in weights.items():
            nk = norm(k)
            if nk in target:
                state[target[nk]] = v
            elif drop_layers_from is not None and nk.startswith("encoder.layers."):
                if int(nk.split(".")[2]) < drop_layers_from:
                    unexpected.append(k)
            elif not (drop_layers_from is not None and nk.startswith("post_layernorm.")):
                unexpected.append(k)
        missing = sorted(set(target.values()) - set(state))
        if missing or unexpected:
            raise ValueError(f"{type(module).__name__}: weights do not match the config "
                             f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
        module.load_state_dict(state, strict=True)

    def estimate_tokens(self, item: MediaItem) -> int:
        if item.modality != "image":
            raise ValueError(f"LlavaEncoder encodes images, not {item.modality}")
        return self._tokens  # LLaVA-1.5 resizes and crops every image to one size

    def placeholder_metadata(self, item: MediaItem) -> dict[str, list[int]]:
        return {}  # LLaVA takes raw media only

    @torch.inference_mode()
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        images = [it.image for it in items]
        if any(im is None for im in images):
            raise ValueError("LlavaEncoder encodes images only")
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]
        pixels = pixels.to(self.device, self.dtype)
        hidden = self.tower(pixel_values=pixels).last_hidden_state
        if self.strategy == "default":
            hidden = hidden[:, 1:]
        if self.post_norm:
            hidden = self._post_layernorm(hidden)
        embeds = self.projector(hidden)
        # one private buffer per item: a view would pin the whole batch in memory
        return [e.to("cpu", copy=True) for e in embeds]  # exactly one copy, CPU or GPU


class Qwen25VLEncoder:
    """The vision transformer (patch merger included) of a local Qwen2.5-VL model directory,
    for images and videos, preprocessed by the model's own HF processors with the defaults
    its processor class applies (what vLLM's multimodal processor calls). Videos: the frames
    as sent, in order (a model whose video processor samples frames itself is refused at
    load: vLLM samples with the request's metadata, which the pool does not reproduce)."""

    modalities: tuple[str, ...] = ("image", "video")
    _weights = ("model.visual.", "visual.")

    def __init__(self, model_dir: Path | str, device: str = "cpu", dtype: str = "auto") -> None:
        from transformers import AutoConfig, AutoProcessor

        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        self.config = AutoConfig.from_pretrained(model_dir)
        processor = AutoProcessor.from_pretrained(model_dir)
        self.image_processor = processor.image_processor
        self.video_processor = processor.video_processor
        defaults = getattr(getattr(processor, "valid_processor_kwargs", None), "_defaults", {})
        self._sizes = {kind: (defaults.get(f"{kind}s_kwargs") or {}).get("size")
                       for kind in ("image", "video")}  # e.g. Omni: larger video frames
        if getattr(self.video_processor, "do_sample_frames", False):
            raise NotImplementedError(
                "this model's video processor samples frames (vLLM does so with the request's "
                "video metadata); the pool encodes the frames as sent: use a vLLM encoder")
        self.dtype = _dtype(dtype, raw)
        self.device = torch.device(device)
        vcfg = self._vision_config()
        self.hidden_size = vcfg.out_hidden_size
        self.temporal = vcfg.temporal_patch_size
        self.patch, self.merge = vcfg.patch_size, vcfg.spatial_merge_size
        self.unit = self.patch * self.merge  # pixels per side of one merged token
        self.visual = self._load(self._vision_model(vcfg), model_dir, self._weights)
        self._extra(model_dir, processor)

    # -- what differs per family ---------------------------------------------------------
    def _vision_config(self):
        return self.config.vision_config

    def _vision_model(self, vcfg) -> torch.nn.Module:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        return Qwen2_5_VisionTransformerPretrainedModel._from_config(vcfg)

    def _extra(self, model_dir: Path, processor) -> None:
        """More towers (Omni: audio)."""

    # -------------------------------------------------------------------------------------
    def _load(self, module: torch.nn.Module, model_dir: Path,
              prefixes: tuple[str, ...]) -> torch.nn.Module:
        groups = _load_weights(model_dir, prefixes)
        weights = {k: v for p in prefixes for k, v in groups[p].items()}
        missing = sorted(set(module.state_dict()) - set(weights))
        unexpected = sorted(set(weights) - set(module.state_dict()))
        if missing or unexpected:
            raise ValueError(f"{type(module).__name__}: weights do not match the config "
                             f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
        module.load_state_dict(weights, strict=True)
        return module.to(self.device, self.dtype).eval()

    def _size(self, modality: str) -> dict:
        proc = self.image_processor if modality == "image" else self.video_processor
        return self._sizes.get(modality) or dict(getattr(proc, "size", None) or {})

    def _grid(self, item: MediaItem) -> list[int]:
        """[t, h, w] in patches, as the HF processor computes it (smart_resize)."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        size = self._size(item.modality)
        width, height = item.size
        h, w = smart_resize(height, width, factor=self.unit,
                            min_pixels=size.get("shortest_edge"),
                            max_pixels=size.get("longest_edge"))
        t = 1 if item.image is not None else -(-len(item.frames) // self.temporal)
        return [t, h // self.patch, w // self.patch]

    def estimate_tokens(self, item: MediaItem) -> int:
        t, h, w = self._grid(item)
        return t * h * w // self.merge ** 2

    def placeholder_metadata(self, item: MediaItem) -> dict[str, list[int]]:
        return {f"{item.modality}_grid_thw": self._grid(item)}

    def _encode_visual(self, kind: str, media: list) -> list[torch.Tensor]:
        if kind == "image":
            batch = self.image_processor(images=media, size=self._size("image"),
                                         return_tensors="pt")
            pixels, grid = batch["pixel_values"], batch["image_grid_thw"]
        else:
            batch = self.video_processor(videos=media, size=self._size("video"),
                                         return_tensors="pt")
            pixels, grid = batch["pixel_values_videos"], batch["video_grid_thw"]
        merged = self.visual(pixels.to(self.device, self.dtype),
                             grid_thw=grid.to(self.device)).pooler_output
        sizes = (grid.prod(-1) // self.merge ** 2).tolist()
        return [e.to("cpu", copy=True) for e in merged.split(sizes)]

    def _encode_audio(self, clips: list) -> list[torch.Tensor]:
        raise ValueError(f"{type(self).__name__} does not encode audio")

    @torch.inference_mode()
    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        groups: dict[str, list] = {"image": [], "video": [], "audio": []}
        for it in items:
            groups[it.modality].append(it.image if it.modality == "image" else
                                       list(it.frames) if it.modality == "video" else it)
        outs = {kind: iter(self._encode_audio(media) if kind == "audio" else
                           self._encode_visual(kind, media))
                for kind, media in groups.items() if media}
        return [next(outs[it.modality]) for it in items]


class QwenOmniEncoder(Qwen25VLEncoder):
    """The Qwen2.5-Omni thinker's vision transformer (images, videos) and audio encoder
    (Whisper log-mel features, `audio_feature_lengths` published for metadata-only parts)."""

    modalities = ("image", "video", "audio")
    _weights = ("thinker.visual.",)

    def _vision_config(self):
        return self.config.thinker_config.vision_config

    def _vision_model(self, vcfg) -> torch.nn.Module:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniVisionEncoder,
        )

        return Qwen2_5OmniVisionEncoder._from_config(vcfg)

    def _extra(self, model_dir: Path, processor) -> None:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniAudioEncoder,
        )

        acfg = self.config.thinker_config.audio_config
        self.features = processor.feature_extractor
        self.audio_tower = self._load(Qwen2_5OmniAudioEncoder._from_config(acfg), model_dir,
                                      ("thinker.audio_tower.",))

    def _feature_lengths(self, item: MediaItem) -> int:
        """Mel frames of the clip (padded to the extractor's window, as the processor does)."""
        hop = self.features.hop_length
        return min(-(-len(item.audio) // hop), self.features.nb_max_frames)

    def estimate_tokens(self, item: MediaItem) -> int:
        if item.modality != "audio":
            return super().estimate_tokens(item)
        _, out = self.audio_tower._get_feat_extract_output_lengths(
            torch.tensor([self._feature_lengths(item)]))
        return int(out[0])

    def placeholder_metadata(self, item: MediaItem) -> dict[str, list[int]]:
        if item.modality != "audio":
            return super().placeholder_metadata(item)
        return {"audio_feature_lengths": [self._feature_lengths(item)]}

    def _encode_audio(self, clips: list) -> list[torch.Tensor]:
        batch = self.features([c.audio for c in clips], sampling_rate=self.features.sampling_rate,
                              padding="max_length", return_attention_mask=True,
                              return_tensors="pt")
        mask = batch["attention_mask"].bool()
        lengths = mask.sum(-1)
        features = batch["input_features"].permute(0, 2, 1)[mask].permute(1, 0)
        after_cnn, out_lengths = self.audio_tower._get_feat_extract_output_lengths(lengths)
        hidden = self.audio_tower(features.to(self.device, self.dtype), feature_lens=lengths,
                                  aftercnn_lens=after_cnn).last_hidden_state
        return [e.to("cpu", copy=True) for e in hidden.split(out_lengths.tolist())]


ENCODERS: dict[str, Callable[..., MediaEncoder]] = {
    "LlavaForConditionalGeneration": LlavaEncoder,
    "Qwen2_5_VLForConditionalGeneration": Qwen25VLEncoder,
    "Qwen2_5OmniModel": QwenOmniEncoder,
}


def load_encoder(model_dir: Path | str, device: str = "cpu", dtype: str = "auto") -> MediaEncoder:
    """The encoder for the model's architecture; a clear error for unsupported ones."""
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in ENCODERS:
            return ENCODERS[arch](model_dir, device=device, dtype=dtype)
    raise NotImplementedError(f"no pool encoder for architectures {archs}; supported: "
                              f"{', '.join(sorted(ENCODERS))}")
