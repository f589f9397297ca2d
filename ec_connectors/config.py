"""The connector's configuration: `ec_connector_extra_config`, validated in one place."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

GiB = 1 << 30


class ConfigError(ValueError):
    """A bad `ec_connector_extra_config`; the message names every offending key."""


def default_storage_path() -> str:
    return os.path.join(tempfile.gettempdir(), "epd-ec-cache")


class EPDConfig(BaseModel):
    """Settings of EPDConnector. Unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    transport: Literal["safetensors"] = "safetensors"
    # Items from different models must never mix: keys live under this namespace.
    # Default: the served model name.
    namespace: str | None = None

    # --- safetensors transport (shared filesystem) ---
    storage_path: str = Field(default_factory=default_storage_path)
    max_storage_bytes: int = Field(default=16 * GiB, gt=0)
    fsync: bool = False  # rename is atomic for readers; fsync adds crash durability
    verify_checksum: bool = True
    scan_interval_s: float = Field(default=0.25, gt=0, le=60)

    # --- producer side ---
    max_pending_saves: int = Field(default=16, ge=1)
    save_queue_timeout_s: float = Field(default=10.0, gt=0)

    # --- consumer side ---
    load_timeout_s: float = Field(default=10.0, gt=0)
    load_threads: int = Field(default=2, ge=1, le=64)
    max_staged_bytes: int = Field(default=4 * GiB, gt=0)
    staged_ttl_s: float = Field(default=120.0, gt=0)
    on_unavailable: Literal["local_encode", "fail"] = "local_encode"

    # Directory of the scheduler<->worker control sockets (unix domain sockets).
    control_dir: str = Field(default_factory=lambda: os.path.join(tempfile.gettempdir(), "epd-ctl"))

    @classmethod
    def from_dict(cls, extra: dict[str, Any] | None) -> EPDConfig:
        try:
            return cls.model_validate(extra or {})
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
                for err in exc.errors()
            )
            raise ConfigError(
                f"invalid ec_connector_extra_config for EPDConnector: {problems}. "
                f"Known keys: {', '.join(sorted(cls.model_fields))}"
            ) from None

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig) -> EPDConfig:
        ec = vllm_config.ec_transfer_config
        cfg = cls.from_dict(dict(ec.ec_connector_extra_config or {}) if ec else {})
        if cfg.namespace is None:
            model = vllm_config.model_config
            name = (model.served_model_name or model.model) if model else "default"
            if isinstance(name, list | tuple):
                name = name[0]
            cfg = cfg.model_copy(update={"namespace": str(name)})
        return cfg
