"""Vision encoders the pool runs: media items in, embeddings `[num_tokens, lm_hidden]` out.

`LlavaEncoder` reproduces what vLLM's LlavaForConditionalGeneration computes for an image:
the HF image processor from the model directory (what vLLM's multimodal processor uses), the
CLIP vision tower truncated at `vision_feature_layer` (post-layernorm only when every layer is
used, as in vLLM), the `vision_feature_select_strategy`, and the multimodal projector, in the
model's dtype. Other families (Qwen2.5-VL: dynamic resolution, video) implement the same
`MediaEncoder` protocol and register in `ENCODERS` by architecture name.
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

    def estimate_tokens(self, modality: str, width: int, height: int, frames: int = 1) -> int:
        """Embedding rows an item of these dimensions will produce (before encoding)."""
        ...

    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """One embedding per item, same order, each its own contiguous CPU tensor."""
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

    def estimate_tokens(self, modality: str, width: int, height: int, frames: int = 1) -> int:
        if modality != "image":
            raise ValueError(f"LlavaEncoder encodes images, not {modality}")
        return self._tokens  # LLaVA-1.5 resizes and crops every image to one size

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


ENCODERS: dict[str, Callable[..., MediaEncoder]] = {
    "LlavaForConditionalGeneration": LlavaEncoder,
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
