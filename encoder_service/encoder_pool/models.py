"""The encoder the pool runs: vLLM's own, so its embedding is the one a vLLM encoder computes.

A copy of a model's preprocessing or towers drifts: Hugging Face's Qwen2.5 vision transformer
and vLLM's differ in bf16 rounding (max 1e-3 on the tiny models, 40% of the values), which
was enough to change a greedy answer (a 6-frame video through the pool answered differently
from aggregated vLLM). So every step is vLLM's code, called as a vLLM server calls it:

- preprocessing (`prepare`, at the pool's door): vLLM's multimodal processor for the model
  (`MULTIMODAL_REGISTRY.create_processor`): its data parser (audio resampling and channel
  mix-down, video metadata), the HF processor with vLLM's kwargs, the placeholder length;
- the towers (`encode`, on a worker): the model class vLLM serves, built and loaded by vLLM's
  model loader with `mm_encoder_only` (no language model), run through `embed_multimodal`
  on vLLM's batched kwargs (`group_and_batch_mm_kwargs`), as vLLM's model runner does;
- the placeholder metadata a consumer needs for a metadata-only part: what a vLLM producer
  publishes (`ec_connectors.placeholders`, vLLM's `collect_ec_item_metadata`).

On the same device and dtype the pool's embedding is bit-identical to a vLLM encoder's
(tests/e2e/test_qwen_modalities.py, test_connector_safetensors.py). vLLM keeps its current config
and forward context in process globals, so a process runs one forward at a time
(`_FORWARD_LOCK`); its distributed state is set up once per process (world size 1).
Families register in `ENCODERS` by architecture name: those whose parity is tested.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import torch

from encoder_service.encoder_pool.media import BadMedia, MediaItem


class MediaEncoder(Protocol):
    """One model replica on one device. `encode` is called from one thread at a time."""

    modalities: tuple[str, ...]
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    # the tower attends within a video's temporal patch groups only: a chunk of whole groups
    # encodes to the whole encode's rows (chunking.py)
    chunks_video: bool

    def prepare(self, item: MediaItem) -> MediaItem:
        """The item preprocessed (at the pool's door), or BadMedia."""
        ...

    def estimate_tokens(self, item: MediaItem) -> int:
        """Embedding rows the item will produce (before encoding: admission, batching)."""
        ...

    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        """One embedding per item, same order, each its own contiguous CPU tensor."""
        ...

    def placeholder_metadata(self, item: MediaItem) -> dict[str, list[int]]:
        """The placeholder metadata a consumer needs to take the item metadata-only.

        What a consumer needs besides the embedding to take the item as a metadata-only
        part (vLLM's `embedding_fields`); {} when the model takes raw media only."""
        ...


# Towers that attend within a temporal patch group only (vLLM's model files: `cu_seqlens` per
# group, window and full-attention layers alike; position embeddings spatial, tiled over
# time), so a video may be encoded in chunks of whole groups (chunking.py).
CHUNKS_VIDEO = frozenset({"Qwen2_5_VLForConditionalGeneration", "Qwen2_5OmniModel"})

_INIT_LOCK = threading.Lock()
_FORWARD_LOCK = threading.Lock()  # vLLM's current config / forward context are globals


def _engine_config(model_dir: Path, dtype: str):
    """Build the VllmConfig an encoder-only vLLM server would run with.

    The VllmConfig a `vllm serve <model_dir> --mm-encoder-only` would run with. vLLM's
    platform hooks export settings for the processes it would start (LD_PRELOAD, thread
    counts...); the pool starts none, and its own children must not inherit them."""
    from vllm.engine.arg_utils import EngineArgs

    saved = dict(os.environ)
    try:
        return EngineArgs(model=str(model_dir), dtype=dtype, mm_encoder_only=True,
                          enforce_eager=True).create_engine_config()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _init_runtime(vllm_config) -> None:
    """Set up vLLM's single-process runtime state, once.

    vLLM's distributed state (world size 1) for this process, once, as its worker sets
    it up; on the CPU platform also the CPU model runner's no-op accelerator hooks."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.platforms import current_platform

    with _INIT_LOCK:
        if model_parallel_is_initialized():
            return
        if current_platform.is_cpu():
            from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

            _set_torch_accelerator_to_noop()
        store = Path(tempfile.mkdtemp(prefix="epd-pool-dist-")) / "store"
        with set_current_vllm_config(vllm_config):
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"file://{store}",
                                         backend=current_platform.dist_backend)
            ensure_model_parallel_initialized(1, 1)


def _device(name: str) -> torch.device:
    from vllm.platforms import current_platform

    device = torch.device(name)
    want = "cpu" if current_platform.is_cpu() else "cuda"
    if device.type != want:
        raise ValueError(f"device {name!r}: this vLLM build runs models on {want!r}")
    return device


class VllmEncoder:
    """The multimodal towers of a model vLLM serves, with vLLM's processor and loader."""

    def __init__(self, model_dir: Path | str, device: str = "cpu", dtype: str = "auto") -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model
        from vllm.multimodal import MULTIMODAL_REGISTRY
        from vllm.transformers_utils.processor import get_video_processor_cls_name

        from ec_connectors.placeholders import Placeholders

        self.device = _device(device)
        self.vllm_config = _engine_config(Path(model_dir), dtype)
        _init_runtime(self.vllm_config)
        mc = self.vllm_config.model_config
        with _FORWARD_LOCK, self._on_device(), set_current_vllm_config(self.vllm_config):
            self.model = get_model(vllm_config=self.vllm_config).eval()
        self.processor = MULTIMODAL_REGISTRY.create_processor(mc)
        limits = self.processor.info.get_supported_mm_limits()
        self.modalities = tuple(m for m in ("image", "video", "audio") if m in limits)
        self.dtype = mc.dtype
        self.hidden_size = mc.get_inputs_embeds_size()
        self.chunks_video = bool(set(mc.architectures or ()) & CHUNKS_VIDEO)
        # the loader vLLM's chat front end picks for this model's video processor
        self.video_processor = get_video_processor_cls_name(mc)
        self._placeholders = Placeholders(mc)
        self._prompts = {m: self.processor.dummy_inputs.get_dummy_text({m: 1})
                         for m in self.modalities}
        self._prep_lock = threading.Lock()

    def _on_device(self):
        if self.device.type == "cuda" and self.device.index is not None:
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def prepare(self, item: MediaItem) -> MediaItem:
        """Run vLLM's multimodal processor on a decoded item.

        vLLM's multimodal processor on the decoded item (`item.media`, as vLLM's media
        IO returns it): the processed tensors, the placeholder length, the metadata."""
        from vllm.multimodal.inputs import MultiModalFeatureSpec
        from vllm.utils.torch_utils import set_default_torch_num_threads

        if item.modality not in self.modalities:
            raise BadMedia(item.item_id, f"modality {item.modality!r} is not served "
                                         f"(served: {', '.join(self.modalities)})")
        try:
            with self._prep_lock, set_default_torch_num_threads():
                parsed = self.processor.info.parse_mm_data({item.modality: [item.media]})
                out = self.processor(self._prompts[item.modality], parsed)
            kwargs = out["mm_kwargs"][item.modality][0]
            position = out["mm_placeholders"][item.modality][0]
        except Exception as exc:  # noqa: BLE001 - the item fails alone (sent raw), not the request
            raise BadMedia(item.item_id, f"cannot preprocess {item.modality}: {exc!r}") from None
        feature = MultiModalFeatureSpec(data=kwargs, modality=item.modality,
                                        identifier=item.item_id, mm_position=position)
        metadata = self._placeholders.describe([feature]).get(item.item_id, {})
        return replace(item, prepared=kwargs, num_embeds=position.get_num_embeds(),
                       metadata=metadata)

    def estimate_tokens(self, item: MediaItem) -> int:
        if item.prepared is None:
            raise ValueError(f"item {item.item_id!r} was not prepared")
        return item.num_embeds

    def placeholder_metadata(self, item: MediaItem) -> dict[str, list[int]]:
        return dict(item.metadata)

    def encode(self, items: list[MediaItem]) -> list[torch.Tensor]:
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context
        from vllm.multimodal.utils import group_and_batch_mm_kwargs

        if any(it.prepared is None for it in items):
            raise ValueError("items must be prepared before encoding")
        pairs = [(it.modality, it.prepared) for it in items]
        outs: list[torch.Tensor] = []
        with (_FORWARD_LOCK, self._on_device(), torch.inference_mode(),
              set_current_vllm_config(self.vllm_config),
              set_forward_context(None, self.vllm_config)):
            for _modality, _n, batch in group_and_batch_mm_kwargs(pairs, device=self.device):
                outs.extend(self.model.embed_multimodal(**batch))
        # one private buffer per item: a view would pin the whole batch in memory
        return [o.to("cpu", copy=True) for o in outs]  # exactly one copy, CPU or GPU


# Architectures whose parity with vLLM's encoder is tested (e2e: test_connector_safetensors.py,
# test_qwen_modalities.py).
ENCODERS: dict[str, type[VllmEncoder]] = {
    "LlavaForConditionalGeneration": VllmEncoder,
    "Qwen2_5_VLForConditionalGeneration": VllmEncoder,
    "Qwen2_5OmniModel": VllmEncoder,
}


_LOADED: dict[tuple, MediaEncoder] = {}


def load_encoder(model_dir: Path | str, device: str = "cpu", dtype: str = "auto") -> MediaEncoder:
    """The encoder for the model's architecture; a clear error for unsupported ones.

    Pools of one process (tests, two pools behind one gateway) share a loaded model: it holds no
    per-pool state, and one forward runs at a time anyway."""
    model_dir = Path(model_dir).resolve()
    raw = json.loads((model_dir / "config.json").read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ENCODERS), None)
    if arch is None:
        raise NotImplementedError(f"no pool encoder for architectures {archs}; supported: "
                                  f"{', '.join(sorted(ENCODERS))}")
    files = sorted(model_dir.glob("*.json")) + sorted(model_dir.glob("*.safetensors"))
    key = (str(model_dir), device, dtype, tuple((f.name, f.stat().st_mtime_ns) for f in files))
    with _INIT_LOCK:
        encoder = _LOADED.get(key)
    if encoder is None:
        encoder = ENCODERS[arch](model_dir, device=device, dtype=dtype)
        with _INIT_LOCK:
            encoder = _LOADED.setdefault(key, encoder)
    return encoder
