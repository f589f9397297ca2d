"""`epd up`'s configuration and the connector wiring it implies.

`epd up`'s configuration and the connector wiring it implies: `UpConfig` (one config file
with embedded defaults; the command line's flags override it: up_cli.py), the transport each
server gets, and the ec_connector_extra_config keys of every encoder and decode instance. The
processes themselves: up.py.

Transports (`transport`):
- `auto` (default): `shm`, since every server runs on this host, where the host has a tmpfs
  at /dev/shm (else `safetensors`); `epd up` says which it picked and why. Opt out with
  `transport = "safetensors"` (or `--transport safetensors`);
- `shm`: same-host shared memory; each encoder writes into its own arena under
  `<shm_path>/up-<base_port>` (`shm_path` default /dev/shm/epd-shm-<uid>), each decode
  instance copies from it; the gateway has no catalog of it (availability "none": a repeated
  item goes to its encoder, which skips the encode of an item stored there);
- `safetensors`: a shared directory (`storage_path`);
- `mooncake`: the Mooncake Transfer Engine, P2P, no master; each encoder serves its items on
  its own side channel `127.0.0.1:mooncake_base_port + 10 * i`, every decode instance pulls
  from all of them, the gateway's availability follows their announcements;
- `mooncake_store`: the Mooncake Store; `epd up` starts its master first (`mooncake_master`:
  RPC on `master_port`, HTTP metadata on +1, metrics on +2), encoders contribute a memory
  segment to it, decode instances only use it (segment 0), so any instance loads what any
  encoder made; the gateway has no catalog of the store (availability "none": every item goes
  to an encoder, which skips the encode when the store already holds it);
- `nixl`: the same wiring as `mooncake` (side channels, announcements, the gateway's
  availability), the bytes moved by NIXL reads (UCX) instead (transports/nixl_pull/);
- `tiered`: tiers ["mooncake", "mooncake_store", "safetensors"] (loads try them in that
  order, saves write all): the Transfer Engine wiring, the master and the shared directory
  together; the gateway's availability follows the Mooncake announcements.
All Mooncake processes bind to 127.0.0.1 (MC_TCP_BIND_ADDRESS; a Mooncake engine's own two
listeners cannot be told an address, docs/trust.md: over TCP with host pools the Transfer
Engine transport starts none, Store clients do) and get MC_MIN_RPC_PORT / MC_MAX_RPC_PORT
from the port plan: a range clear of every fixed port (`fixed_ports`). `connector_extra` adds
ec_connector_extra_config keys and may change sizes (memory_pool_bytes, store_segment_bytes,
store_buffer_bytes, ...), never the wiring (transport, host, ports, producers, store_master,
store_metadata).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ec_connectors.config import default_shm_path
from ec_connectors.protocol import ports
from ec_connectors.protocol.secret_file import SECRET_ENV, read_secret
from ec_connectors.protocol.stored import TIERED, TRANSPORT_NAMES, UpTransport
from encoder_service.gateway.config import RoutingConfig
from encoder_service.local.scale_rules import ScalingConfig
from encoder_service.local.supervise import RestartPolicy
from encoder_service.local.testmodels import SPECS, ModelSpec
from epd_common.config_files import read_config_file, validate

# Ports: ec_connectors/protocol/ports.py (gateway = base_port, then encoders, then decoders)
MOONCAKE_POOL_BYTES = 512 << 20  # registered pool per process (connector_extra overrides)
STORE_SEGMENT_BYTES = 256 << 20  # what each encoder contributes to the store
STORE_BUFFER_BYTES = 512 << 20  # registered buffer per process for puts/gets
SHM_ARENA_BYTES = 512 << 20  # each encoder's shared-memory arena (connector_extra overrides)
SHM_POOL_BYTES = 256 << 20  # each decode instance's warm memory for the items it copies
# `transport` -> EPDConnector's transport tiers, in load order
TIERS: dict[str, list[str]] = {**{name: [name] for name in TRANSPORT_NAMES},
                               "tiered": list(TIERED)}


COALESCE_DEFAULT = RoutingConfig.model_fields["coalesce_items"].default


class UpConfig(BaseModel):
    """Everything `epd up` starts. Ports: gateway = base_port, encoders next, then decoders."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field("tiny", description="a locally built test model (tiny = LLaVA, "
                       "qwen-vl, qwen-omni, ...: testmodels.SPECS) or a model directory")
    served_name: str | None = Field(None, description="default: the test model's name "
                                    "(tiny-llava, tiny-qwen-omni, ...) or the directory's")
    encoders: int = Field(1, ge=0, le=16)
    decoders: int = Field(1, ge=1, le=16)
    prefills: int = Field(0, ge=0, le=16, description="E/P/D: this many prefill instances "
                          "(EC consumer, KV producer) hand each prompt's KV cache to the "
                          "`decoders` (KV consumers) through vLLM's KV connector (kv_transfer);"
                          " 0 = E+PD, the decoders prefill and decode")
    kv_transfer: dict[str, Any] = Field(
        default_factory=dict, description="E/P/D: --kv-transfer-config keys over the default "
        "(NixlConnector, kv_role kv_both, kv_buffer_device cpu; decode instances recompute "
        "a prompt whose KV cache could not be loaded: kv_load_failure_policy recompute)")
    base_port: int = Field(ports.GATEWAY_PORT, ge=1024, le=65000)
    host: str = "127.0.0.1"
    transport: UpTransport = Field(
        "auto", description="auto = shm (same-host shared memory: every server runs on this "
        "host) where /dev/shm is a tmpfs, else safetensors; tiered = mooncake, then "
        "mooncake_store, then safetensors")
    storage_path: str | None = Field(None, description="default: <work dir>/up/ec-cache")
    mooncake_base_port: int = Field(ports.MOONCAKE_BASE_PORT, ge=1024, le=60000,
                                    description="encoder i's side channel: this + 10 * i; "
                                    "its announcements: that + 1000, its data connections: "
                                    "that + 2000")
    master_port: int = Field(ports.MASTER_RPC_PORT, ge=1024, le=65000,
                             description="Mooncake Store master (mooncake_store, tiered): "
                             "RPC here, HTTP metadata on +1, metrics on +2")
    encoder_backend: Literal["vllm", "pool"] = Field(
        "vllm", description="encoders are vLLM ec_producers, or `epd encoder` pools")
    pool: dict[str, Any] = Field(default_factory=dict,
                                 description="more PoolConfig keys for each `epd encoder`")
    connector_extra: dict[str, Any] = Field(default_factory=dict,
                                            description="more ec_connector_extra_config keys")
    cpu_cores: list[int] | None = Field(None, description="one core per server, in order "
                                        "(encoders, then decoders); each server, all its "
                                        "processes, runs on its core; default: spread over "
                                        "this machine's cores")
    vllm_args: list[str] = Field(default_factory=list)
    media_io_kwargs: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="vLLM's --media-io-kwargs for every server and "
        "encoder pool alike (e.g. {\"video\": {\"num_frames\": 120}}: the frames kept "
        "decide the embedding, so encoders and decode instances must agree)")
    startup_timeout_s: float = Field(420.0, gt=0)
    fork_server: bool = Field(True, description="fork vLLM servers from a process that has "
                              "imported vLLM once per core (faster starts and restarts); "
                              "false: each starts as a new interpreter")
    restart: RestartPolicy = Field(default_factory=RestartPolicy, description="restarts of "
                                   "servers (and the store master) that exit unasked: "
                                   "backoff, a cap per window (supervise.py)")
    scaling: ScalingConfig = Field(default_factory=ScalingConfig, description="elastic "
                                   "roles: encoders and decode instances added under load, "
                                   "drained and stopped when idle (scaler.py)")
    clear_cache: bool = Field(True, description="empty the storage directory at start")
    gateway: dict[str, Any] = Field(default_factory=dict,
                                    description="GatewayConfig keys (limits, media, client "
                                    "api_keys / api_keys_file, ...)")
    secret_file: str | None = Field(None, description="the deployment secret (default "
                                    "$EPD_SECRET_FILE): CURVE on the data plane, signed item "
                                    "ids, sealed objects, and the API key of every server")
    otlp_traces_endpoint: str | None = Field(
        None, description="traces on (docs/observability.md): an OTLP/HTTP traces URL "
        "(e.g. http://127.0.0.1:4318/v1/traces) the gateway (its `tracing` key) and every "
        "vLLM server (`--otlp-traces-endpoint`, service name epd-<server>) send spans to; "
        "each request's spans form one trace")

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _otlp(cls, v: str | None) -> str | None:
        if v is not None and (urlsplit(v).scheme not in ("http", "https")
                              or not urlsplit(v).hostname):
            raise ValueError(f"{v!r} is not an http(s) OTLP/HTTP traces URL")
        return v

    @model_validator(mode="after")
    def _kv_instances(self) -> UpConfig:
        if self.prefills and self.planned_decoders + self.prefills > 16:
            raise ValueError("decoders + prefills: at most 16 KV instances")
        sc = self.scaling
        for role, lo, hi in (("encoders", self.encoders, sc.encoders_max),
                             ("decoders", self.decoders, sc.decoders_max)):
            if hi is not None and not 1 <= lo <= hi:
                raise ValueError(f"{role} MIN:MAX is {lo}:{hi}: need 1 <= MIN <= MAX")
        if sc.encoders_max and sc.encoders_max > self.encoders and self.uses_te:
            raise ValueError("elastic encoders need a transport whose consumers find a new "
                             "producer by themselves (shm, safetensors, mooncake_store): "
                             "with the Transfer Engine (mooncake, tiered) every decode "
                             "instance subscribes at start to a fixed list of producers")
        return self

    @property
    def planned_encoders(self) -> int:
        """Encoders planned (ports, cores): the maximum of an elastic role, else `encoders`."""
        return max(self.encoders, self.scaling.encoders_max or 0)

    @property
    def planned_decoders(self) -> int:
        """Decode instances planned: the maximum of an elastic role, else `decoders`."""
        return max(self.decoders, self.scaling.decoders_max or 0)

    @field_validator("secret_file")
    @classmethod
    def _secret(cls, v: str | None) -> str | None:
        read_secret(v)  # a bad file is a config error now, not after minutes of start-up
        return v

    @property
    def secret_path(self) -> str | None:
        """The secret file every process of the deployment reads, None without one."""
        path = self.secret_file or os.environ.get(SECRET_ENV) or None
        return None if path is None else str(Path(path).resolve())

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        if v not in SPECS and not Path(v).is_dir():
            raise ValueError(f"{v!r} is neither a test model ({', '.join(sorted(SPECS))}) nor "
                             "a model directory")
        return v

    @property
    def spec(self) -> ModelSpec | None:
        """The test model `model` names (built locally), None for a model directory."""
        return SPECS.get(self.model)

    @property
    def served_model_name(self) -> str:
        if self.served_name:
            return self.served_name
        return self.spec.model_name if self.spec else Path(self.model).name

    @property
    def transport_choice(self) -> tuple[str, str]:
        """(the transport `transport` stands for, why)."""
        if self.transport != "auto":
            return self.transport, "as configured"
        arena = int(self.connector_extra.get("shm_arena_bytes", SHM_ARENA_BYTES))
        why_not = shm_unusable(max(1, self.planned_encoders) * arena)
        if not why_not:
            return "shm", ("every server runs on this host (transport = \"safetensors\" "
                           "opts out)")
        return "safetensors", why_not

    @property
    def tiers(self) -> list[str]:
        return TIERS[self.transport_choice[0]]

    @property
    def shm_path(self) -> str:
        """This deployment's shared-memory directory.

        This deployment's shared-memory directory (connector_extra's shm_path, else one
        per deployment under the user's default)."""
        return self.connector_extra.get("shm_path") or os.path.join(
            default_shm_path(), f"up-{self.base_port}")

    @property
    def uses_te(self) -> bool:
        """Whether a peer-pull tier (side channels per encoder) is used: mooncake or nixl."""
        return bool({"mooncake", "nixl"} & set(self.tiers))

    @property
    def uses_store(self) -> bool:
        """Whether the Mooncake Store tier (and so a master) is used."""
        return "mooncake_store" in self.tiers

    @property
    def fixed_ports(self) -> dict[int, str]:
        """Every fixed port of the deployment, mapped to what holds it.

        Every fixed port of the deployment -> what holds it (ports.up_fixed_ports): what
        the Mooncake engines' range must stay clear of."""
        fixed = ports.up_fixed_ports(
            self.base_port, self.servers,
            self.mooncake_base_port if self.uses_te else None, self.encoders,
            self.master_port if self.uses_store else None)
        fixed.update({kv_side_channel_port(self, j): f"KV side channel {j}"
                      for j in range(self.kv_instances)})
        return fixed

    @property
    def servers(self) -> int:
        """vLLM servers and encoder pools planned: encoders, decoders, prefill instances.

        Elastic roles count at their maximum: every instance that may join has its port,
        core and side channel from the start."""
        return self.planned_encoders + self.planned_decoders + self.prefills

    @property
    def kv_instances(self) -> int:
        """Servers with a KV connector (E/P/D: decode and prefill instances; else none)."""
        return self.planned_decoders + self.prefills if self.prefills else 0


class UpError(RuntimeError):
    pass


def load_up_config(path: Path | None, overrides: dict[str, Any] | None = None) -> UpConfig:
    data = read_config_file(path, error=UpError) if path else {}
    for key, value in (overrides or {}).items():  # a table's keys over the file's table
        both = isinstance(value, dict) and isinstance(data.get(key), dict)
        data[key] = {**data[key], **value} if both else value
    return validate(UpConfig, data, "invalid epd up configuration", UpError)


def images_per_prompt(vllm_args: list[str]) -> int | None:
    """The per-prompt image limit that `vllm_args` give vLLM.

    The per-prompt image limit `--limit-mm-per-prompt` gives vLLM in `vllm_args` (JSON:
    `{"image": 1}` or `{"image": {"count": 1, ...}}`), None where they set none."""
    flag = "--limit-mm-per-prompt"
    for i, arg in enumerate(vllm_args):
        if arg == flag and i + 1 < len(vllm_args):
            value = vllm_args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
        else:
            continue
        try:
            image = json.loads(value).get("image")
        except (ValueError, AttributeError):
            return None  # vLLM refuses it at start with its own error
        if isinstance(image, dict):
            image = image.get("count")
        return image if isinstance(image, int) and image >= 0 else None
    return None


def gateway_routing(routing: dict[str, Any] | None, vllm_args: list[str]) -> dict[str, Any]:
    """The gateway's `routing` keys for servers started with `vllm_args`.

    The gateway's `routing` keys for servers started with `vllm_args`: `coalesce_items`
    (images per shared encoder call) at most vLLM's per-prompt image limit, unless set (a
    shared call over it would be refused, and split, every time)."""
    out = dict(routing or {})
    limit = images_per_prompt(vllm_args)
    if limit is not None and "coalesce_items" not in out:
        out["coalesce_items"] = max(1, min(limit, COALESCE_DEFAULT))
    return out


def kv_side_channel_port(cfg: UpConfig, j: int) -> int:
    """E/P/D: the NIXL side-channel port of KV instance j.

    E/P/D: KV instance j's (decoders, then prefill instances) NIXL side channel
    (VLLM_NIXL_SIDE_CHANNEL_PORT): the ports after every server's."""
    return cfg.base_port + 1 + cfg.servers + j


def kv_connector_config(prefill: bool, overrides: dict[str, Any] | None = None
                        ) -> dict[str, Any]:
    """E/P/D: the --kv-transfer-config of a prefill or decode instance.

    E/P/D: the --kv-transfer-config of a prefill or decode instance, `overrides` on top:
    NixlConnector, kv_both, CPU buffers; decode instances recompute a prompt whose KV cache
    could not be loaded. The one source of it: `epd up` and deploy/render.py (compose, k8s)."""
    out: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                           "kv_buffer_device": "cpu"}
    if not prefill:
        out["kv_load_failure_policy"] = "recompute"
    return {**out, **(overrides or {})}


def kv_transfer_config(cfg: UpConfig, prefill: bool) -> dict[str, Any]:
    """E/P/D: a decode or prefill instance's --kv-transfer-config (`kv_transfer` on top)."""
    return kv_connector_config(prefill, cfg.kv_transfer)


def mooncake_endpoint(cfg: UpConfig, i: int) -> str:
    """Encoder i's side channel (`host:port`): its rank 0 serves items there."""
    return f"127.0.0.1:{ports.encoder_base_port(cfg.mooncake_base_port, i)}"


def store_master_address(cfg: UpConfig) -> str:
    """The master `epd up` starts: `store_master` of every client."""
    return f"127.0.0.1:{cfg.master_port}"


def store_metadata_url(cfg: UpConfig) -> str:
    """The master's HTTP metadata server: `store_metadata` of every client."""
    return ports.store_metadata_url(store_master_address(cfg))


def shm_unusable(need_bytes: int) -> str:
    """Why the shm transport cannot hold `need_bytes` of arenas here ("" when it can).

    Why the shm transport cannot hold `need_bytes` of arenas here ("" when it can): it
    needs a writable tmpfs at /dev/shm with that much room (a container's is often 64 MiB)."""
    try:
        mounts = Path("/proc/mounts").read_text().split("\n")
    except OSError:
        mounts = []
    if not any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in mounts if line) \
            or not os.access("/dev/shm", os.W_OK):
        return "no writable tmpfs at /dev/shm for the shared-memory transport"
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    if free < need_bytes + (64 << 20):
        return (f"/dev/shm has {free >> 20} MiB free, the shared-memory arenas need "
                f"{need_bytes >> 20} MiB (grow it, e.g. docker --shm-size, or lower "
                "connector_extra.shm_arena_bytes)")
    return ""


def connector_extra(cfg: UpConfig, role: str, i: int = 0) -> dict[str, Any]:
    """ec_connector_extra_config keys for encoder i (role ec_producer) or a decode instance.

    Mooncake on one node: 127.0.0.1 (with MC_TCP_BIND_ADDRESS); Transfer Engine: a base port per
    encoder, every decode instance subscribed to every encoder; Store: the master `epd up`
    starts, a segment contributed by each encoder (none by decode instances). `connector_extra`
    may override the rest (protocol, memory_pool_bytes, store_segment_bytes, store_buffer_bytes,
    ...), not the wiring."""
    tiers = cfg.tiers
    if tiers == ["safetensors"]:
        return dict(cfg.connector_extra)
    defaults: dict[str, Any] = {}
    wiring: dict[str, Any] = {"transport": tiers[0] if len(tiers) == 1 else list(tiers),
                              "host": "127.0.0.1"}
    producer = role == "ec_producer"
    if cfg.uses_te:
        defaults.update(protocol="tcp", memory_pool_bytes=MOONCAKE_POOL_BYTES)
        if producer:
            wiring["base_port"] = ports.encoder_base_port(cfg.mooncake_base_port, i)
        else:
            wiring["producers"] = [mooncake_endpoint(cfg, j) for j in range(cfg.encoders)]
    if "shm" in tiers:  # one directory per deployment; sizes by role
        defaults["shm_path"] = cfg.shm_path
        defaults["shm_arena_bytes" if producer else "shm_consumer_pool_bytes"] = (
            SHM_ARENA_BYTES if producer else SHM_POOL_BYTES)
    if cfg.uses_store:
        defaults.update(store_segment_bytes=STORE_SEGMENT_BYTES if producer else 0,
                        store_buffer_bytes=STORE_BUFFER_BYTES)
        wiring.update(store_master=store_master_address(cfg),
                      store_metadata=store_metadata_url(cfg))
    return {**defaults, **cfg.connector_extra, **wiring}
