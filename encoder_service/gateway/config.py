"""Gateway configuration: one validated place, embedded defaults, clear errors.

Build with `GatewayConfig.build(dict)` (raises GatewayConfigError naming each bad key), from
`epd_common.config_files.read_config_file(path)` (JSON or TOML) and/or flags. Unknown keys
are errors, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ec_connectors.protocol.api_keys import admin_token
from ec_connectors.protocol.item_ids import IdSigner
from ec_connectors.protocol.ports import GATEWAY_PORT
from ec_connectors.protocol.secret_file import read_secret
from encoder_service.gateway.auth import client_keys, read_keys_file, upstream_headers
from epd_common.config_files import InvalidConfig, validate
from epd_common.net import EndpointList

MiB = 1 << 20


class GatewayConfigError(InvalidConfig):
    """The gateway configuration is invalid; the message says which key and why."""


def _check_base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s)://host[:port] base URL")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r}: give the server's base URL only (no path, query)")
    return url.rstrip("/")


Policy = Literal["affinity", "least_loaded", "round_robin"]  # routing.py


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LimitsConfig(_Strict):
    """Request and media limits; breaking one is a 413 (sizes) or 400 (counts)."""

    max_request_bytes: int = Field(32 * MiB, gt=0)
    max_media_bytes: int = Field(16 * MiB, gt=0, description="one decoded media item")
    max_media_items: int = Field(16, gt=0, description="media parts per request")
    max_image_pixels: int = Field(4096 * 4096, gt=0, description="an image or a video frame")
    max_video_frames: int = Field(1024, gt=0)
    max_video_seconds: float = Field(600.0, gt=0)
    max_audio_seconds: float = Field(1800.0, gt=0)
    max_concurrent_requests: int = Field(
        256, gt=0, description="chat/completions requests in flight; beyond: 429 + "
                               "Retry-After")
    body_read_timeout_s: float = Field(30.0, gt=0, description="a request body must arrive "
                                       "within this (408 beyond: slow uploads hold nothing)")


class MediaConfig(_Strict):
    """What media the gateway accepts and how it may fetch URLs (SSRF policy)."""

    modalities: list[Literal["image", "audio", "video"]] = ["image", "video", "audio"]
    metadata_only: bool = Field(
        True, description="send decode instances metadata-only parts (`image_embeds` with "
                          "the grid, no pixels) for items whose encoder published their "
                          "placeholder metadata; the gateway keeps the media for one retry")
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

    encoder_s: float = Field(30.0, gt=0, description=(
        "an encode call fails once its encoder answered no call for this long; a call "
        "queued behind others waits while they are answered, at most this long for each "
        "call in flight beside it (upstreams/encoder_progress.py)"))
    connect_s: float = Field(3.0, gt=0)
    decode_s: float = Field(300.0, gt=0,
                        description="non-streamed answer end to end; streamed: first byte "
                                    "and every gap between chunks")
    health_s: float = Field(1.0, gt=0)


class RoutingConfig(_Strict):
    """Which encoder encodes an item and which decode instance serves a request (routing.py).

    `affinity`: rendezvous hashing on the item id (the decode side: on the request's first item)
    with bounded loads, the same on every gateway replica; `least_loaded`, `round_robin` for
    comparison."""

    encoders: Policy = "affinity"
    decoders: Policy = "affinity"
    load_factor: float = Field(1.25, ge=1.0, description="an encoder carrying more than "
                               "this times the average in-flight load is passed over for an "
                               "item no encoder holds yet")
    decoder_load_factor: float = Field(1.1, ge=1.0, description="the same for decode "
                                       "instances (cache affinity weighed against queues)")
    single_flight: bool = Field(True, description="concurrent requests for one item not yet "
                                "encoded share one encode")
    failover: bool = Field(True, description="a decode instance that dies mid-answer: "
                           "another one continues it (failover.py)")
    overlap: Literal["auto", "on", "off"] = Field(
        "auto", description="send the decode request while its new items are being encoded, "
        "marked pending: an EPDConnector consumer preprocesses the prompt meanwhile and waits "
        "for the embeddings to land (the encoder round trip leaves the critical path). "
        "`auto`: when the gateway follows the transport (availability), for modalities whose "
        "encoders (vLLM producers or pools) were seen to publish no placeholder metadata (the "
        "others wait for it and go metadata-only) and items the encoders take (a pool sends "
        "back items with their own processor settings); `on`: every new item. "
        "Needs EPDConnector decode instances: another connector would encode pending items "
        "itself")
    coalesce_items: int = Field(8, ge=1, description="vLLM encoders: new images of "
                                "concurrent requests share one call, up to this many items "
                                "(a vLLM server's cost is per request: docs/benchmarks.md, "
                                "shared calls to vLLM encoders); "
                                "at most vLLM's --limit-mm-per-prompt image limit (epd up sets "
                                "it; a refusal for it lowers it); 1: one call per request")
    encoder_calls: int = Field(2, ge=1, description="coalescing calls in flight per vLLM "
                               "encoder; images that arrive while they all are go together "
                               "in the next")
    probe_interval_s: float = Field(10.0, ge=0, description="every instance gets a real "
                                    "forward (one-token completion) this often; one that "
                                    "fails cools down until a probe passes (0: off)")
    probe_timeout_s: float = Field(10.0, gt=0)
    admin: bool = Field(True, description="serve POST /admin/instances (join/leave at run "
                        "time): with the deployment secret, callers must show its admin "
                        "token; without one, loopback callers only")


class TracingConfig(_Strict):
    """Settings of OpenTelemetry traces of chat requests.

    OpenTelemetry traces of chat requests (tracing.py): off unless `otlp_traces_endpoint`
    is set. Each request gets a trace (or continues the caller's W3C `traceparent`) with a
    span per stage, and `traceparent` goes to the encoders and prefill/decode instances, so
    vLLM servers started with `--otlp-traces-endpoint` add their spans to the same trace."""

    otlp_traces_endpoint: str | None = Field(
        None, description="OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces "
        "(protobuf); unset: tracing off, nothing of OpenTelemetry is loaded")
    service_name: str = Field("epd-gateway", min_length=1, description="the spans' "
                              "service.name")
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0, description="share of new traces "
                                "recorded; a caller's traceparent decides for its own")
    export_interval_s: float = Field(1.0, gt=0, le=60, description="finished spans are "
                                     "sent this often (or sooner, 512 at a time)")
    max_queued_spans: int = Field(20000, ge=512, description="spans waiting for export "
                                  "beyond this are dropped (counted), never held")

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{v!r} is not an http(s) OTLP/HTTP traces URL")
        return v


class AdminChange(_Strict):
    """One membership change (POST /admin/instances)."""

    role: Literal["encoder", "decoder"]
    url: str
    action: Literal["add", "remove"]
    drain_timeout_s: float = Field(60.0, gt=0, le=3600)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _check_base_url(v)


class AvailabilityConfig(_Strict):
    """Where the gateway looks up items that are already encoded (so they skip encoding).

    `safetensors`: the shared directory of the safetensors transport (same `storage_path`
    and `namespace` as the vLLM servers' EPDConnector). `mooncake`: the announcements of the
    Mooncake TE producers in `producers` (their side channels, `host:port`, as in the
    consumers' `producers`). `shm`: the shm transport's records under `shm_path` (same
    `shm_path` and `namespace` as the servers; the gateway on their host, as their user).
    `none`: always encode. (The kinds are transport names,
    ec_connectors.protocol.stored, with a catalog the gateway can follow; the Mooncake Store
    has none.)"""

    kind: Literal["safetensors", "mooncake", "shm", "none"] = "none"
    storage_path: str | None = None
    shm_path: str | None = None
    namespace: str | None = None
    producers: EndpointList = Field(default_factory=list)

    @model_validator(mode="after")
    def _needs(self) -> AvailabilityConfig:
        if self.kind == "safetensors" and not self.storage_path:
            raise ValueError("storage_path is required for kind 'safetensors'")
        if self.kind == "shm" and not self.shm_path:
            raise ValueError("shm_path is required for kind 'shm'")
        if self.kind == "mooncake" and not self.producers:
            raise ValueError("producers (host:port side channels) are required for kind "
                             "'mooncake'")
        return self


@dataclass(frozen=True)
class MediaRules:
    """What parsing a chat body's media needs: the model served, the id namespace, limits."""

    model: str
    namespace: str
    limits: LimitsConfig
    media: MediaConfig


@dataclass(frozen=True)
class ChatSection:
    """What the chat flow needs beyond its collaborators."""

    rules: MediaRules
    encoder_backend: Literal["vllm", "pool"]
    routing: RoutingConfig
    decode_s: float


@dataclass(frozen=True)
class PoolSection:
    """One pool of prefill or decode instances: members, routing, deadlines, credentials."""

    urls: tuple[str, ...]
    role: str  # in its errors: "no <role> instance answered"
    policy: Policy
    load_factor: float
    cooldown_s: float
    connect_s: float
    read_s: float
    headers: dict[str, str]  # the deployment's key (auth.py)


@dataclass(frozen=True)
class AdminSection:
    """What the control plane needs from the config.

    What the control plane needs: its routing (shown, `admin` switch), probe deadline and
    who may read /instances."""

    routing: RoutingConfig
    health_s: float
    client_keys: tuple[str, ...]
    token: str | None  # the admin token (None: no secret, loopback callers only)


class GatewayConfig(_Strict):
    """The whole gateway: where it listens, its upstreams, limits and policies."""

    host: str = "127.0.0.1"
    port: int = Field(GATEWAY_PORT, ge=1, le=65535)
    model: str = Field("tiny-llava", min_length=1,
                       description="served model name; namespace of content-derived item ids")
    encoders: list[str] = Field(default_factory=list,
                                description="encoder base URLs (vLLM ec_producers or "
                                            "`epd encoder` pools, see encoder_backend); "
                                            "empty = decode instances encode locally")
    decoders: list[str] = Field(min_length=1, description="vLLM ec_consumer base URLs")
    prefills: list[str] = Field(
        default_factory=list, description="E/P/D: vLLM prefill instances (ec_consumer and KV "
        "producer); each request is prefilled on one (chosen by routing.decoders on its first "
        "item), its KV cache handed to a decode instance of `decoders` (least loaded) through "
        "vLLM's KV connector (kv_handoff.py); empty = E+PD, `decoders` prefill and decode")
    encoder_backend: Literal["vllm", "pool"] = Field(
        "vllm", description="what `encoders` are: vLLM ec_producers, or `epd encoder` pools")
    cooldown_s: float = Field(5.0, ge=0,
                                      description="try an encoder or decode instance last for "
                                                  "this long after it failed")
    availability: AvailabilityConfig = AvailabilityConfig()
    routing: RoutingConfig = RoutingConfig()
    limits: LimitsConfig = LimitsConfig()
    media: MediaConfig = MediaConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    tracing: TracingConfig = TracingConfig()
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    secret_file: str | None = Field(
        None, description="the deployment secret (default $EPD_SECRET_FILE): item ids are "
                          "signed with it (producers share only signed ids), Mooncake "
                          "announcements are read with it")

    api_keys: list[str] = Field(
        default_factory=list, repr=False,
        description="keys clients must present on /v1 (`Authorization: Bearer <key>`, as "
                    "`vllm serve --api-key`); with api_keys_file and $EPD_GATEWAY_API_KEY: "
                    "none anywhere = no client key (auth.py)")
    api_keys_file: str | None = Field(None, description="client keys, one per line (several "
                                      "clients); `#` comments")

    @field_validator("secret_file")
    @classmethod
    def _secret(cls, value: str | None) -> str | None:
        read_secret(value)  # a bad file is a config error now
        return value

    @field_validator("api_keys_file")
    @classmethod
    def _keys_file(cls, value: str | None) -> str | None:
        if value:
            read_keys_file(value)  # missing or empty: a config error, never an open gateway
        return value

    @property
    def client_api_keys(self) -> list[str]:
        """Every key a client may present (api_keys, the file's, $EPD_GATEWAY_API_KEY)."""
        return client_keys(self.api_keys, self.api_keys_file)

    @property
    def ids(self) -> IdSigner:
        return IdSigner(read_secret(self.secret_file))

    @property
    def upstream_headers(self) -> dict[str, str]:
        """What the gateway presents to every server of its deployment (auth.py)."""
        return upstream_headers(self.secret_file)

    @field_validator("encoders", "decoders", "prefills")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        return [_check_base_url(u) for u in v]

    @property
    def namespace(self) -> str:
        return self.availability.namespace or self.model

    @property
    def media_rules(self) -> MediaRules:
        return MediaRules(self.model, self.namespace, self.limits, self.media)

    @property
    def chat(self) -> ChatSection:
        return ChatSection(self.media_rules, self.encoder_backend, self.routing,
                           self.timeouts.decode_s)

    def pool(self, role: Literal["decode", "prefill"]) -> PoolSection:
        """The decode or prefill instances' pool section.

        The decode instances (`decoders`; under E/P/D they go by load, not by item) or
        the prefill instances (`prefills`, routed by item)."""
        epd = bool(self.prefills)
        urls, name = ((self.prefills, "prefill") if role == "prefill"
                      else (self.decoders, "prefill/decode"))
        policy = "least_loaded" if role == "decode" and epd else self.routing.decoders
        t = self.timeouts
        return PoolSection(tuple(urls), name, policy, self.routing.decoder_load_factor,
                           self.cooldown_s, t.connect_s, t.decode_s, self.upstream_headers)

    @property
    def admin(self) -> AdminSection:
        secret = read_secret(self.secret_file)
        return AdminSection(self.routing, self.timeouts.health_s,
                            tuple(self.client_api_keys),
                            None if secret is None else admin_token(secret))

    @classmethod
    def build(cls, data: dict[str, Any]) -> GatewayConfig:
        """Validate `data`; raise GatewayConfigError naming each bad key."""
        return validate(cls, data, "invalid gateway configuration", GatewayConfigError)
