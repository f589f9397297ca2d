"""The encoder pool's configuration, validated in one place (pydantic; unknown keys are errors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from epd_common.config_files import InvalidConfig, validate

MiB = 1 << 20
GiB = 1 << 30


class PoolConfigError(InvalidConfig):
    """A bad pool configuration; the message names every offending key."""


class PoolConfig(BaseModel):
    """Settings of the encoder pool and its HTTP server.

    The budget is bytes of embeddings (features) held in memory; a feature's bytes are
    reserved from its estimated token count before it is encoded, so the pool never holds
    more than `cpu_budget_bytes`, queued or finished.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path  # local model directory (LLaVA family)
    served_model_name: str | None = None  # namespace of published items; default: dir name
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # auto = model's dtype
    devices: list[str] = Field(default_factory=lambda: ["cpu"], min_length=1)
    workers_per_device: int = Field(default=1, ge=1, le=16)

    # --- batching and queues ---
    max_batch_size: int = Field(default=8, ge=1, le=256)
    max_batch_tokens: int = Field(default=16384, ge=1, description="estimated embedding rows "
                                  "per batch (a batch holds one modality; a video is many "
                                  "images' worth): the next item that would pass it opens the "
                                  "next batch")
    video_chunk_tokens: int = Field(default=2048, ge=0, description="the most embedding rows "
                                    "of video a batch holds (so a long video's batches take "
                                    "turns with other batches): a longer video is encoded in "
                                    "chunks of whole temporal groups where the model's tower "
                                    "allows it (Qwen2.5-VL/Omni), shorter ones batch together "
                                    "under it; 0 = every video whole, under max_batch_tokens")
    max_wait_ms: float = Field(default=5.0, ge=0, le=10_000)
    max_queue_items: int = Field(default=256, ge=1)  # per modality; beyond it: HTTP 429
    retry_after_s: float = Field(default=1.0, gt=0)

    # --- budget and lifecycle ---
    cpu_budget_bytes: int = Field(default=2 * GiB, gt=0)
    retain: Literal["discard", "keep"] = "discard"  # on release: free it, or keep for reuse

    # --- failure handling ---
    item_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    on_failure: Literal["text_only", "fail"] = "text_only"
    max_media_bytes: int = Field(default=20 * MiB, gt=0)
    max_image_pixels: int = Field(default=4096 * 4096, gt=0)
    max_items_per_request: int = Field(default=64, ge=1)
    media_io_kwargs: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="vLLM's --media-io-kwargs, e.g. {\"video\": "
        "{\"num_frames\": 120}}: must be the decode instances' (the frames kept decide the "
        "embedding)")

    # --- publishing (EPDConnector's ec_connector_extra_config; namespace defaults to the
    # served model name so vLLM consumers of that model find the items) ---
    transport: dict[str, Any] = Field(default_factory=dict)
    engine_id: str = "epd-encoder-pool"

    # --- HTTP ---
    host: str = "127.0.0.1"
    port: int = Field(default=18480, ge=1, le=65535)

    @model_validator(mode="after")
    def _check(self) -> PoolConfig:
        if not (self.model / "config.json").is_file():
            raise ValueError(f"model directory {self.model} has no config.json")
        for dev in self.devices:
            if not (dev == "cpu" or dev.startswith("cuda")):
                raise ValueError(f"device {dev!r} is not 'cpu' or 'cuda[:N]'")
        return self

    @property
    def namespace(self) -> str:
        return self.served_model_name or self.model.name

    @property
    def embedding_dtype(self) -> str:
        """The dtype of the embeddings this pool publishes.

        The dtype of published embeddings (the encoder's: "auto" = the model config's, as
        in models._dtype). Mooncake Store keys carry it, as vLLM consumers' keys carry
        their model dtype: a pool labelling its items "any" would never be found there."""
        if self.dtype != "auto":
            return self.dtype
        try:
            raw = json.loads((self.model / "config.json").read_text())
        except (OSError, ValueError):
            raw = {}
        name = (raw.get("dtype") or raw.get("torch_dtype") or "float32") if isinstance(
            raw, dict) else "float32"
        return str(name).removeprefix("torch.")

    def transport_config(self):
        """The validated EPDConfig for `make_transport` (errors name the bad key)."""
        from ec_connectors.config import EPDConfig

        extra = dict(self.transport)
        extra.setdefault("namespace", self.namespace)
        if "model_fingerprint" not in extra:  # as vLLM servers of these weights compute it
            from ec_connectors.protocol.fingerprint import model_fingerprint

            extra["model_fingerprint"] = model_fingerprint(self.model)
        extra.setdefault("embedding_dtype", self.embedding_dtype)
        return EPDConfig.from_dict(extra)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PoolConfig:
        return validate(cls, values, "invalid encoder pool config", PoolConfigError)
