"""The e2e lane's shared deployments: each started once, by its first user, for every module.

A vLLM server costs the lane 40-70 s of its two cores to start (tests/lanes.py counts them),
so modules that need the same servers share one deployment, a session fixture of
tests/e2e/conftest.py. A `Fleet` is one `epd up` and, beside it, servers it does not manage;
`ensure()` is what a module's fixture calls: it starts what is not running (a first user, or
after a test stopped it) and waits until every instance is healthy again (after a test
killed one and `epd up` restarted it). So a test that kills or stops part of a fleet either
waits for `epd up` to restore it or leaves it stopped for `ensure()` to start again, and says
which in its docstring.

The fleets (tiny LLaVA; ports from this module's blocks):
- E_PD: `epd up` (a vLLM encoder writing shared memory and the shared directory, a decode
  instance reading shared memory first, with a four-image encoder cache) and a second decode
  instance on the shared directory alone. The gateway's tests and the connector's
  safetensors and shm tests.
- E_P_D: `epd up --prefill 1 --decode 1` over NIXL (embeddings READ from the encoder's
  registered memory, vLLM's NixlConnector for the KV cache). The E/P/D tests and the
  connector's NIXL test.
- TIERED: `epd up` with tiers mooncake, mooncake_store, safetensors and a deployment secret,
  and beside it a vLLM encoder on the store and the shared directory alone. `epd up`'s tiered
  checks, the store's and the connector's Transfer Engine tests.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ec_connectors.protocol import ports
from ec_connectors.protocol.api_keys import api_key
from ec_connectors.protocol.item_ids import IdSigner
from ec_connectors.protocol.secret_file import read_secret
from encoder_service.local.processes import ManagedProcess, UpProcess, VllmServer
from encoder_service.local.testmodels import SPECS, build
from encoder_service.local.up import DECODE_ARGS, epd_config
from encoder_service.local.up_config import UpConfig, store_master_address, store_metadata_url
from epd_testkit.trace_sink import TraceSink
from tests.helpers import LOOPBACK, MASTER, MOONCAKE, WORK, port_block, stop_all, wait_for

_HTTP = port_block(__name__)
_MC = port_block(__name__, MOONCAKE)
_MASTER = port_block(__name__, MASTER)
# E_PD: gateway, encoder +1, decode +2, the second decode instance +3
E_PD_PORT = _HTTP[0]
# E_P_D: gateway, encoder +1, decode +2, prefill +3, NIXL KV side channels +4 +5
E_P_D_PORT = _HTTP[10]
E_P_D_NIXL = _MC[0]
# TIERED: gateway, encoder +1, decode +2; Transfer Engine side channel; store master
TIERED_PORT = _HTTP[20]
TIERED_MC = _MC[10]
TIERED_MASTER = _MASTER[0]


def llava() -> Path:
    return build(WORK / "models" / "tiny-llava", SPECS["tiny"])


@dataclass
class Fleet:
    """One shared `epd up` (`conf`, `args`) and servers of its own beside it (`beside`)."""

    name: str
    conf: dict
    args: list[str] = field(default_factory=list)
    beside: list[ManagedProcess] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # `epd up`'s, on top of ours
    scratch: list[str] = field(default_factory=list)  # directories removed by close()
    on_close: list[Callable[[], object]] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # what its users read beside it (a trace sink)
    late: list[ManagedProcess] = field(default_factory=list)  # beside, started once...
    late_after: str = ""  # ...`epd up` has logged this (its store master is up)
    up: UpProcess | None = None
    starts: int = 0  # how often ensure() started `epd up`

    @property
    def work(self) -> Path:
        return WORK / "fleets" / self.name

    @property
    def gw(self) -> str:
        return f"http://127.0.0.1:{self.conf['base_port']}"

    def url(self, offset: int) -> str:
        """The URL of the server on the fleet's base port + `offset`."""
        return f"http://127.0.0.1:{self.conf['base_port'] + offset}"

    def ensure(self, timeout_s: float = 420.0) -> Fleet:
        """Start what is not running; return once every instance answers healthy."""
        for server in self.beside:
            if not server.running:
                server.stop()  # what a killed server left behind
                server.start()
        if self.up is None or not self.up.running:
            if self.up is not None:
                self.up.stop(90)
            self.up = UpProcess(self.conf, self.work, env=dict(self.env),
                                args=list(self.args)).start()
            self.starts += 1
            print(f"[fleet {self.name}] epd up started (start {self.starts})", flush=True)
        deadline = time.monotonic() + timeout_s
        if any(not server.running for server in self.late):
            assert wait_for(lambda: self.late_after in self.up_log(), timeout=timeout_s,
                            interval=0.2), f"fleet {self.name}: no {self.late_after!r}"
            for server in self.late:
                if not server.running:
                    server.stop()
                    server.start()
        for server in (*self.beside, *self.late):
            server.wait(max(1.0, deadline - time.monotonic()))
        assert wait_for(self.all_up, timeout=max(1.0, deadline - time.monotonic()),
                        interval=0.25), f"fleet {self.name} not healthy: {self.log_tail()}"
        return self

    def all_up(self) -> bool:
        """Whether the gateway answers and reports every encoder and decode instance up."""
        if self.up is None or not self.up.running:
            raise AssertionError(f"epd up of fleet {self.name} exited: {self.log_tail()}")
        try:
            health = httpx.get(self.gw + "/health", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return False
        states = [*health.get("encoders", {}).values(), *health.get("decoders", {}).values()]
        return bool(states) and all(states)

    def up_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self) -> str:
        return self.up.log_tail(60) if self.up is not None else "(not started)"

    @property
    def log_path(self) -> Path:
        assert self.up is not None
        return self.up.log_path

    def stop(self) -> None:
        """Stop all of it (a later `ensure()` starts it again)."""
        if self.up is not None:
            self.up.stop(90)
        stop_all([*self.beside, *self.late])

    def close(self) -> None:
        """Stop it and remove what it left (its last user's end, then the session's end)."""
        self.stop()
        for path in self.scratch:
            shutil.rmtree(path, ignore_errors=True)
        while self.on_close:
            self.on_close.pop()()


def e_pd() -> Fleet:
    """The E_PD fleet (module docstring); its shared directory in its work dir."""
    model = llava()
    storage = WORK / "fleets" / "e-pd" / "ec-store"
    shm = f"/dev/shm/epd-e2e-{uuid.uuid4().hex[:8]}"
    conf = {"model": str(model), "base_port": E_PD_PORT, "cpu_cores": [0, 1],
            "storage_path": str(storage), "transport": "safetensors",
            # the encoder writes same-host shared memory and the directory; the decode
            # instance reads shared memory first (the second decode instance: the directory)
            "connector_extra": {"transport": ["shm", "safetensors"], "shm_path": shm,
                                "shm_arena_bytes": 64 << 20,
                                "shm_consumer_pool_bytes": 32 << 20},
            # vLLM's encoder cache holds max_num_batched_tokens: 256 = four 64-token images
            "vllm_args": ["--max-num-batched-tokens", "256"],
            # no probes: the tests count the encoder's finished requests
            "gateway": {"timeouts": {"encoder_s": 20}, "routing": {"probe_interval_s": 0}}}
    fleet = Fleet("e-pd", conf, scratch=[shm])
    # the second decode instance starts beside `epd up`: a lone vLLM start leaves a core idle
    fleet.beside.append(VllmServer("decode-2", model, E_PD_PORT + 3, fleet.work,
                                   epd_config("ec_consumer", storage), cpu_core=1,
                                   extra_args=DECODE_ARGS))
    return fleet


def e_p_d() -> Fleet:
    """The E_P_D fleet (module docstring), its spans sent to a trace sink in this process."""
    sink = TraceSink(E_P_D_PORT + 6)
    conf = {"model": str(llava()), "base_port": E_P_D_PORT, "transport": "nixl",
            "mooncake_base_port": E_P_D_NIXL, "cpu_cores": [0, 1, 1],
            "otlp_traces_endpoint": sink.url,
            "connector_extra": {
                # every load goes through the workers (no inline fast path): a request waits
                # on the connector, which adds its span; every item held where it lies (vLLM's
                # own encoder output, registered and read from there)
                "inline_max_bytes": 0, "producer_put": "in_place", "in_place_min_bytes": 0,
                "memory_pool_bytes": 128 << 20, "load_timeout_s": 10},
            # one restart each: a killed server comes back for the tests after it
            "restart": {"max_restarts": 1, "backoff_s": 0.5},
            "gateway": {"tracing": {"export_interval_s": 0.2},
                        "routing": {"probe_interval_s": 0}}}  # no probes' traces
    return Fleet("e-p-d", conf, args=["--prefill", "1", "--decode", "1"],
                 env={"OTEL_BSP_SCHEDULE_DELAY": "200"},  # vLLM's span batches: 5 s
                 on_close=[sink.stop], extra={"sink": sink})


def e_p_d_endpoint() -> str:
    """The E_P_D encoder's side channel: where its NIXL items are read from."""
    return f"127.0.0.1:{ports.encoder_base_port(E_P_D_NIXL, 0)}"


def tiered() -> Fleet:
    """The TIERED fleet (module docstring): its secret in its work dir (extra["secret"]);
    beside it, once its store master is up, a vLLM encoder of its own (extra["producer"])
    on the store and the shared directory alone: an encoder instance the decode instance
    does not subscribe to, whose items it can find only in the store or the directory."""
    fleet = Fleet("tiered", {})
    secret = fleet.work / "secret"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)
    storage = fleet.work / "up" / "ec-cache"  # `epd up`'s default
    fleet.conf = {
        "model": str(llava()), "base_port": TIERED_PORT, "transport": "tiered",
        "mooncake_base_port": TIERED_MC, "master_port": TIERED_MASTER, "cpu_cores": [0, 1],
        "secret_file": str(secret),
        "connector_extra": {"memory_pool_bytes": 128 << 20, "load_timeout_s": 10,
                            "inline_max_bytes": 0},  # tiny items too go through the engine
        # a killed master comes back after a while: the tests see the tiers without it first
        "restart": {"backoff_s": 8},
        "gateway": {"timeouts": {"encoder_s": 30}}}
    up_cfg = UpConfig(**fleet.conf)
    producer = VllmServer("producer-store", llava(), TIERED_PORT + 3, fleet.work, epd_config(
        "ec_producer", storage, {
            "transport": ["mooncake_store", "safetensors"], "host": "127.0.0.1",
            "store_master": store_master_address(up_cfg),
            "store_metadata": store_metadata_url(up_cfg), "store_segment_bytes": 0,
            "store_buffer_bytes": 128 << 20, "load_timeout_s": 10,
            "secret_file": str(secret)}),  # seals what it stores, shares vouched ids only
        cpu_core=0, env=dict(LOOPBACK))
    fleet.late.append(producer)
    fleet.late_after = "mooncake-master healthy"
    fleet.extra.update(secret=secret, producer=producer)
    return fleet


def vouched(secret: Path, content_id: str) -> str:
    """`content_id` signed as the gateway of the deployment whose secret is `secret` signs
    it: an id its producers share (a bare id a client chose is encoded for its request only)."""
    return IdSigner(read_secret(secret)).sign(content_id)


def bearer(secret: Path) -> dict[str, str]:
    """The header that opens a server of the deployment whose secret is `secret`."""
    return {"authorization": f"Bearer {api_key(read_secret(secret))}"}
