"""The connector's configuration: `ec_connector_extra_config`, validated in one place.

Users write flat keys (`{"transport": "mooncake", "memory_pool_bytes": ...}`) and code reads
flat attributes (`config.memory_pool_bytes`); the keys are declared in groups by what uses
them (CommonSettings, SafetensorsSettings, MooncakeSettings, StoreSettings, ShmSettings,
ProducerSettings, ConsumerSettings), which EPDConfig combines.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ec_connectors.protocol import ports
from ec_connectors.protocol.curve import CurveKeys, curve_keys
from ec_connectors.protocol.fingerprint import model_fingerprint
from ec_connectors.protocol.item_ids import IdSigner
from ec_connectors.protocol.seal import Seal
from ec_connectors.protocol.secret_file import read_secret
from ec_connectors.protocol.stored import TransportName
from epd_common.config_files import InvalidConfig, validate
from epd_common.net import Endpoint, EndpointList

if TYPE_CHECKING:
    from vllm.config import VllmConfig

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


class ConfigError(InvalidConfig):
    """A bad `ec_connector_extra_config`; the message names every offending key."""


def default_storage_path() -> str:
    return os.path.join(tempfile.gettempdir(), "epd-ec-cache")


class _Settings(BaseModel):
    """Unknown keys are errors, not silently ignored; a config never changes once made."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class CommonSettings(_Settings):
    """Every role and transport: which transport (or tiers), and the items' namespace."""

    # One transport, or tiers tried in order on load and all written on save, e.g.
    # ["mooncake", "mooncake_store", "safetensors"]: the producer's pool first, then the
    # store (items another instance made), then the shared directory; a local encode last.
    transport: TransportName | list[TransportName] = "safetensors"
    # Items from different models must never mix: keys live under this namespace.
    # Default: the served model name.
    namespace: str | None = None
    # Which weights and config made the items (protocol/fingerprint.py; default: computed
    # from the served model's directory at start). Producers and consumers of another model
    # under the same namespace refuse each other's items; "" turns the check off.
    model_fingerprint: str | None = Field(None, pattern=r"^[0-9A-Za-z._-]{0,64}$")
    # The deployment secret (protocol/secret_file.py), default $EPD_SECRET_FILE: the Mooncake TE
    # side channels and announcements run CURVE with keys derived from it; without one they
    # serve loopback only.
    secret_file: str | None = None
    # Items up to this size ride inline (0: never). A consumer's scheduler reads such an item
    # itself, where its transport allows (safetensors), and hands it to the workers in the
    # step's metadata: no deferral, no worker round trip. A Mooncake producer answers a pull
    # of one in its reply (no engine write).
    inline_max_bytes: int = Field(default=256 * KiB, ge=0, le=16 * MiB)
    # How long a vLLM worker running this connector spins (sched_yield) for its engine's next
    # step after one arrived, before it sleeps until told (vLLM's own is longer). While a request
    # waits for an item, the engine sends a step every few ms: a worker spinning between them
    # keeps a core busy for as long as the wait lasts, a core the encoder being waited for
    # needs (plugin.py, docs/configuration.md). Steps of running requests come back to back
    # and still find it spinning.
    worker_spin_s: float = Field(default=0.002, ge=0, le=10)

    @field_validator("secret_file")
    @classmethod
    def _secret_readable(cls, value: str | None) -> str | None:
        read_secret(value)  # a bad file is a config error now, not a failed handshake later
        return value

    @property
    def scope(self) -> str:
        """The scope an item's identity is checked against: namespace and model.

        What an item's identity is checked against: the namespace and the model's
        fingerprint (peer pulls, store objects, sealed files)."""
        ns = self.namespace or "default"
        return f"{ns}#{self.model_fingerprint}" if self.model_fingerprint else ns

    @property
    def ids(self) -> IdSigner:
        """The signer that decides which item ids may be shared.

        Which item ids may be shared (signed by a gateway holding the secret; all without
        one)."""
        return IdSigner(read_secret(self.secret_file))

    @property
    def seal(self) -> Seal:
        """Authenticates stored objects with the deployment secret (inactive without one)."""
        return Seal(read_secret(self.secret_file))

    @property
    def curve(self) -> CurveKeys | None:
        """The deployment's CURVE keys (from `secret_file` or $EPD_SECRET_FILE), or None."""
        return curve_keys(read_secret(self.secret_file))

    @field_validator("transport")
    @classmethod
    def _tiers_unique(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and (not value or len(set(value)) != len(value)):
            raise ValueError("transport tiers must be a non-empty list without repeats")
        if isinstance(value, list) and {"mooncake", "nixl"} <= set(value):
            raise ValueError("tiers 'mooncake' and 'nixl' would serve on the same ports: "
                             "pick one of them")
        return value

    @property
    def tiers(self) -> list[str]:
        """The transports in load order (one element for a single transport)."""
        return [self.transport] if isinstance(self.transport, str) else list(self.transport)


class SafetensorsSettings(_Settings):
    """The `safetensors` transport: one file per item in a shared directory."""

    storage_path: str = Field(default_factory=default_storage_path)
    max_storage_bytes: int = Field(default=16 * GiB, gt=0)
    fsync: bool = False  # rename is atomic for readers; fsync adds crash durability
    verify_checksum: bool = True
    scan_interval_s: float = Field(default=0.25, gt=0, le=60)


class MooncakeSettings(_Settings):
    """Settings of the `mooncake` transport (Mooncake Transfer Engine, P2P pulls).

    The `mooncake` transport: the Mooncake Transfer Engine; consumers pull items P2P from
    the producer's registered pool into their own."""

    protocol: Literal["tcp", "rdma"] = "tcp"
    host: str = "auto"  # this node's address for peers: "auto" = probe, hostname, 127.0.0.1
    device_name: str | None = None  # RDMA device(s); default $RDMA_DEVICE_NAME, else all
    # Producer side-channel port = base_port + stage_offset + dp_rank * world + rank;
    # announcements on that + 1000, data connections (te_data_path socket) on that + 2000
    # (the port scheme: ec_connectors/protocol/ports.py).
    base_port: int = Field(default=ports.MOONCAKE_BASE_PORT, ge=1024,
                           le=65535 - ports.PURPOSE_STREAM - ports.MAX_RANKS_PER_NODE + 1)
    stage_offset: int = Field(default=0, ge=0, le=999)
    # Producer side channels ("host:port") a consumer subscribes to and pulls from when a
    # request carries no location; with a list, params may only name these producers.
    producers: EndpointList = Field(default_factory=list)
    memory_pool_device: Literal["cpu", "cuda"] = "cpu"
    # How an item's bytes move: "engine" = the transfer engine writes them into the
    # consumer's pool (RDMA: the network card, no socket copy on either host); "socket" = the
    # producer streams them over a TCP connection the consumer opened with a one-time ticket
    # (mooncake_te/stream.py; faster than the engine over TCP: docs/transports.md);
    # "auto" = socket when protocol is tcp and the pool on the host, else engine. Only a
    # process off the socket path starts a transfer engine (mooncake_te/engine.py): set it
    # alike on every process (a socket consumer and an engine-only producer exchange nothing).
    te_data_path: Literal["auto", "engine", "socket"] = "auto"
    # Producer: the byte budget of held items (transports/leases.py: unleased items first, then
    # backpressure). Consumer: room for pulls in flight.
    memory_pool_bytes: int = Field(default=2 * GiB, ge=1 * MiB)
    # Large items are written in chunks of this size, each announced as it lands, so the
    # consumer verifies chunk k while chunk k+1 is on the wire (0: one write, verify after).
    # Chunk sizes from a quarter of the default to four times it measured the same over TCP
    # (docs/benchmarks.md, transfer chunks); the default keeps the verification overlapped.
    transfer_chunk_bytes: int = Field(default=8 * MiB, ge=0)
    # nixl: a large read is split across this many threads, each with its own UCX worker (on
    # one host UCX's get is a kernel copy in the posting thread: two copy on two cores);
    # at most the cores this process may run on
    nixl_read_lanes: int = Field(default=2, ge=1, le=16)
    # Producer (nixl; mooncake on its socket data path): a large host item is held where it
    # lies, sent or read from there (in_place: no copy into the pool, which still counts its
    # bytes), or copied into the pool (copy). auto: in place, except nixl on a host with RDMA
    # devices (registration pins every page; keys change for memory at a reused address) and
    # mooncake's engine path (the engine writes from registered memory only)
    producer_put: Literal["auto", "in_place", "copy"] = "auto"
    # smaller items are copied: for nixl a registration, its metadata and the consumer's load
    # of it cost more than copying a few MiB (docs/transports.md, "Items where they lie")
    in_place_min_bytes: int = Field(default=4 * MiB, ge=0)
    lease_ttl_s: float = Field(default=60.0, gt=0)  # unpressed, promised items stay this long
    # A pool full of leased items evicts the one promised longest ago once that was this long
    # ago, rather than fail new saves for the rest of the lease (shm_lease_min_s likewise)
    lease_min_s: float = Field(default=10.0, gt=0)
    announce_interval_s: float = Field(default=2.0, gt=0, le=60)
    # Size-scaled pull timeout: base + nbytes / rate, capped by the load deadline.
    transfer_timeout_base_s: float = Field(default=2.0, gt=0)
    min_transfer_bytes_per_s: float = Field(default=100e6, gt=0)
    serve_threads: int = Field(default=4, ge=1, le=64)
    # Producer: pulls waiting for a serve thread beyond this are answered "busy" at once.
    max_queued_pulls: int = Field(default=256, ge=1)
    progress_timeout_s: int = Field(default=10, ge=1)  # MC_TCP_PROGRESS_TIMEOUT_SEC if unset
    # A pull that timed out may still be written by a frozen producer: its buffer is held
    # until the producer answers or disconnects, at most this long.
    quarantine_ttl_s: float = Field(default=300.0, gt=0)

    @model_validator(mode="after")
    def _socket_needs_a_host_pool(self) -> MooncakeSettings:
        if self.te_data_path == "socket" and self.memory_pool_device != "cpu":
            raise ValueError("te_data_path 'socket' receives into host memory: it needs "
                             "memory_pool_device 'cpu' (use 'engine' or 'auto' with 'cuda')")
        return self

    @property
    def te_socket(self) -> bool:
        """Whether items move over the socket data path (te_data_path, resolved)."""
        if self.te_data_path == "auto":
            return self.protocol == "tcp" and self.memory_pool_device == "cpu"
        return self.te_data_path == "socket"


class StoreSettings(_Settings):
    """Settings of the `mooncake_store` transport (the Mooncake Store).

    The `mooncake_store` transport: the Mooncake Store, a master plus the memory segments
    its clients contribute."""

    store_master: Endpoint = f"127.0.0.1:{ports.MASTER_RPC_PORT}"  # the master's RPC address
    # The master's HTTP metadata server; default http://<master host>:<its port + 1>/metadata.
    store_metadata: str | None = None
    # Memory this instance contributes to the store (0: contribute none, only use it).
    store_segment_bytes: int = Field(default=512 * MiB, ge=0)
    # Registered buffer for zero-copy puts/gets (a loaded item keeps its block until vLLM
    # drops it: size it like memory_pool_bytes).
    store_buffer_bytes: int = Field(default=1 * GiB, ge=1 * MiB)
    # Embedding dtype in store keys (default: the model's dtype), with model and item id.
    embedding_dtype: str | None = None
    store_retries: int = Field(default=3, ge=0, le=20)  # transient errors, with backoff
    store_retry_backoff_s: float = Field(default=0.02, gt=0, le=5)
    store_setup_timeout_s: float = Field(default=15.0, gt=0)
    # The master is checked this often; a dead one is reported and its tier skipped.
    store_health_interval_s: float = Field(default=1.0, gt=0, le=60)
    # Scheduler: how long a request may wait for "is it in the store?" before encoding.
    store_probe_timeout_s: float = Field(default=0.5, gt=0, le=30)
    store_probe_ttl_s: float = Field(default=2.0, gt=0, le=600)


def default_shm_path() -> str:
    """/dev/shm/epd-shm-<uid> (one directory per user: its owner alone may use it)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"epd-shm-{os.getuid()}")


class ShmSettings(_Settings):
    """The `shm` transport (transports/shm/): one host.

    Each producer process writes items into its own pre-faulted shared-memory arena (a tmpfs
    file), consumers map it read-only and copy each item once into warm memory, verifying it
    while they copy."""

    shm_path: str = Field(default_factory=default_shm_path)  # a tmpfs directory, made 0700
    # Producer: the arena, its byte budget (transports/leases.py: unleased, unread items, then
    # backpressure for at most shm_put_timeout_s).
    shm_arena_bytes: int = Field(default=1 * GiB, ge=1 * MiB, le=1 << 40)
    shm_lease_ttl_s: float = Field(default=60.0, gt=0)  # unpressed, stored items stay this long
    # An arena full of leased items evicts the one promised longest ago once it was promised
    # this long ago (a consumer loads an item within load_timeout_s of its promise), rather
    # than fail new saves for the rest of the lease (a heavy-video burst did, every 4th item)
    shm_lease_min_s: float = Field(default=10.0, gt=0)
    shm_put_timeout_s: float = Field(default=5.0, gt=0, le=600)
    # Consumer: pre-faulted memory the items are copied into (a fresh allocation page-faults
    # on every item); an item that does not fit gets a fresh allocation.
    shm_consumer_pool_bytes: int = Field(default=512 * MiB, ge=0)
    # Keyed under the deployment secret when there is one: xxh3 (fast checksum) or blake3
    # (a MAC); "none": no byte is hashed, readers check the record's keyed seal and the
    # block's header only (every reader of the deployment must say "none" too).
    shm_verify: Literal["xxh3", "blake3", "none"] = "xxh3"
    # Consumer workers use a large item in the producer's block, without a copy (pinned
    # until vLLM drops the tensor; at most half an arena pinned per consumer, the rest is
    # copied into the pool).
    shm_zero_copy: bool = True
    # "seal": the reader checks the producer's keyed seal of the record and the block's
    # header, trusting the producer's hash of the bytes it wrote; "bytes": it also hashes
    # every byte once where it lies (damage is a miss). Seal by default: only a process of
    # this user can write the arena, and such a process can read the secret and forge the
    # digest too, so a second hash catches accidents, not attacks (docs/trust.md).
    shm_read_verify: Literal["bytes", "seal"] = "seal"
    # copy + hash in parallel; at most the cores this process may run on (sched_getaffinity)
    shm_copy_threads: int = Field(default=2, ge=1, le=64)
    shm_chunk_bytes: int = Field(default=1 * MiB, ge=64 * KiB, le=64 * MiB)

    @field_validator("shm_path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not os.path.isabs(value):
            raise ValueError("shm_path must be an absolute path")
        return value


class ProducerSettings(_Settings):
    """ec_producer instances (encoders): the queue of saves to the transport."""

    max_pending_saves: int = Field(default=16, ge=1)
    # host copies queued for the transport, in bytes (room for several long videos' items)
    max_pending_save_bytes: int = Field(default=1 * GiB, gt=0)
    save_queue_timeout_s: float = Field(default=10.0, gt=0)


class ConsumerSettings(_Settings):
    """Settings of consumer instances: loads, staging and unavailable items.

    ec_consumer instances (prefill/decode): loads, staged items, and what happens to a
    request whose item cannot be loaded."""

    load_timeout_s: float = Field(default=10.0, gt=0)
    load_threads: int = Field(default=2, ge=1, le=64)
    max_staged_bytes: int = Field(default=4 * GiB, gt=0)
    staged_ttl_s: float = Field(default=120.0, gt=0)
    on_unavailable: Literal["local_encode", "fail"] = "local_encode"


class GuardSettings(_Settings):
    """Settings of the API server's guard: what a request may hold.

    Every role: what the API server's guard (`server_guard.py`, vLLM's `--middleware`)
    lets a request hold before vLLM parses it; beyond, 413 or 400 with a reason."""

    guard_max_body_bytes: int = Field(default=512 * MiB, gt=0)
    guard_max_items: int = Field(default=64, ge=1, le=1024)  # multimodal items per request
    guard_max_params_bytes: int = Field(default=256 * KiB, ge=1 * KiB)  # ec_transfer_params


class EPDConfig(GuardSettings, ConsumerSettings, ProducerSettings, ShmSettings,
                StoreSettings, MooncakeSettings, SafetensorsSettings, CommonSettings):
    """All settings of EPDConnector, flat, in one pydantic model.

    Settings of EPDConnector: the keys of every group, flat, and the connector's own
    wiring. (pydantic orders fields from the last base to the first: CommonSettings' keys
    come first, then each group in turn, then this class's own.)"""

    # Directory of the scheduler<->worker control sockets (unix domain sockets).
    control_dir: str = Field(default_factory=lambda: os.path.join(tempfile.gettempdir(), "epd-ctl"))

    @property
    def store_metadata_url(self) -> str:
        """`store_metadata`, else the master's metadata server: its RPC port + 1."""
        return self.store_metadata or ports.store_metadata_url(self.store_master)

    @classmethod
    def from_dict(cls, extra: dict[str, Any] | None) -> EPDConfig:
        return validate(cls, extra or {}, "invalid ec_connector_extra_config for EPDConnector",
                        ConfigError)

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig) -> EPDConfig:
        ec = vllm_config.ec_transfer_config
        cfg = cls.from_dict(dict(ec.ec_connector_extra_config or {}) if ec else {})
        model = vllm_config.model_config
        update: dict[str, str] = {}
        if cfg.namespace is None:
            name = (model.served_model_name or model.model) if model else "default"
            if isinstance(name, list | tuple):
                name = name[0]
            update["namespace"] = str(name)
        if cfg.model_fingerprint is None and model is not None:
            extra = "" if os.path.isdir(model.model) else \
                f"{model.revision}\0{model.hf_config.to_json_string()}"
            update["model_fingerprint"] = model_fingerprint(model.model, extra)
        if cfg.embedding_dtype is None and model is not None:
            update["embedding_dtype"] = str(model.dtype).removeprefix("torch.")
        return cfg.model_copy(update=update) if update else cfg
