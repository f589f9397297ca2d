"""Gateway configuration: one validated place, embedded defaults, clear errors.

Load with `GatewayConfig.model_validate(dict)` or `load_gateway_config(path)` (JSON or TOML).
Unknown keys are errors, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ec_connectors.protocol.net import EndpointList

MiB = 1 << 20


class GatewayConfigError(ValueError):
    """The gateway configuration is invalid; the message says which key and why."""


def _check_base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s)://host[:port] base URL")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r}: give the server's base URL only (no path, query)")
    return url.rstrip("/")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitsConfig(_Strict):
    """Request and media limits; breaking one is a 413 (sizes) or 400 (counts)."""

    max_request_bytes: int = Field(32 * MiB, gt=0)
    max_media_bytes: int = Field(16 * MiB, gt=0, description="one decoded media item")
    max_media_items: int = Field(16, gt=0, description="media parts per request")
    max_image_pixels: int = Field(4096 * 4096, gt=0)


class MediaConfig(_Strict):
    """What media the gateway accepts and how it may fetch URLs (SSRF policy)."""

    modalities: list[Literal["image", "audio", "video"]] = ["image"]
    allow_http_urls: bool = False
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="host names or CIDRs a URL may reach even when they resolve to "
                    "loopback, link-local or private addresses")
    url_fetch_timeout_s: float = Field(10.0, gt=0)
    max_redirects: int = Field(3, ge=0, le=10)

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        for h in v:
            if "/" in h:
                ipaddress.ip_network(h, strict=False)  # raises ValueError with a clear message
        return [h.lower() for h in v]


class TimeoutConfig(_Strict):
    """Every upstream call has a deadline."""

    encoder_s: float = Field(30.0, gt=0, description="one encode call, end to end")
    connect_s: float = Field(3.0, gt=0)
    decode_s: float = Field(300.0, gt=0,
                        description="non-streamed answer end to end; streamed: first byte "
                                    "and every gap between chunks")
    health_s: float = Field(1.0, gt=0)


class AvailabilityConfig(_Strict):
    """Where the gateway looks up items that are already encoded (so they skip encoding).

    `safetensors`: the shared directory of the safetensors transport (same `storage_path`
    and `namespace` as the vLLM servers' EPDConnector). `mooncake`: the announcements of the
    Mooncake TE producers in `producers` (their side channels, `host:port`, as in the
    consumers' `producers`). `none`: always encode."""

    kind: Literal["safetensors", "mooncake", "none"] = "none"
    storage_path: str | None = None
    namespace: str | None = None
    producers: EndpointList = Field(default_factory=list)

    @model_validator(mode="after")
    def _needs(self) -> AvailabilityConfig:
        if self.kind == "safetensors" and not self.storage_path:
            raise ValueError("storage_path is required for kind 'safetensors'")
        if self.kind == "mooncake" and not self.producers:
            raise ValueError("producers (host:port side channels) are required for kind "
                             "'mooncake'")
        return self


class GatewayConfig(_Strict):
    """The whole gateway: where it listens, its upstreams, limits and policies."""

    host: str = "127.0.0.1"
    port: int = Field(18000, ge=1, le=65535)
    model: str = Field("tiny-llava", min_length=1,
                       description="served model name; namespace of content-derived item ids")
    encoders: list[str] = Field(default_factory=list,
                                description="encoder base URLs (vLLM ec_producers or "
                                            "`epd encoder` pools, see encoder_backend); "
                                            "empty = decode instances encode locally")
    decoders: list[str] = Field(min_length=1, description="vLLM ec_consumer base URLs")
    encoder_backend: Literal["vllm", "pool"] = Field(
        "vllm", validation_alias=AliasChoices("encoder_backend", "encoder_transport"),
        description="what `encoders` are: vLLM ec_producers, or `epd encoder` pools")
    cooldown_s: float = Field(5.0, ge=0,
                                      description="try an encoder or decode instance last for "
                                                  "this long after it failed")
    availability: AvailabilityConfig = AvailabilityConfig()
    limits: LimitsConfig = LimitsConfig()
    media: MediaConfig = MediaConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("encoders", "decoders")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        return [_check_base_url(u) for u in v]

    @property
    def namespace(self) -> str:
        return self.availability.namespace or self.model

    @classmethod
    def build(cls, data: dict[str, Any]) -> GatewayConfig:
        """Validate `data`; raise GatewayConfigError naming each bad key."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise GatewayConfigError(_explain(exc, "gateway")) from None


def _explain(exc: ValidationError, where: str) -> str:
    lines = [f"invalid {where} configuration:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)


def read_config_file(path: Path) -> dict[str, Any]:
    """A JSON (.json) or TOML (.toml) file as a dict; errors name the file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise GatewayConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        if path.suffix == ".toml":
            import tomllib

            return tomllib.loads(text)
        data = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - any parse error becomes one clear message
        raise GatewayConfigError(f"cannot parse config file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise GatewayConfigError(f"config file {path} must hold an object")
    return data


def load_gateway_config(path: Path) -> GatewayConfig:
    return GatewayConfig.build(read_config_file(path))
