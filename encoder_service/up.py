"""`epd up`: a whole local EPD deployment from one config file with embedded defaults.

Starts the encoder(s) (vLLM ec_producer, or `epd encoder` batching pools with
`encoder_backend = "pool"`) and prefill/decode instance(s) (vLLM ec_consumer) with
EPDConnector over the safetensors transport (a shared directory) or the Mooncake Transfer
Engine (`transport = "mooncake"`: P2P, no master; each encoder serves its items on its own
side channel `127.0.0.1:mooncake_base_port + 10 * i`, every decode instance pulls from all of
them, the gateway's availability follows their announcements). Waits for health with
progress output, then serves the gateway in-process and prints the endpoint. Ctrl-C or SIGTERM stops
everything: the gateway, then every vLLM server's whole process group (SIGTERM, then SIGKILL
after a grace period), so no process is left behind. (A SIGKILL of `epd up` itself cannot be
handled; the vLLM servers then keep running in their own sessions.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ec_connectors.config import ConfigError, EPDConfig
from encoder_service.gateway.config import GatewayConfig, GatewayConfigError, read_config_file
from encoder_service.launcher import PoolServer, ServerFailed, VllmServer, start_all

DEFAULT_BASE_PORT = 18100
DEFAULT_MOONCAKE_BASE_PORT = 15500  # EPDConfig.base_port's default
MOONCAKE_PORT_STRIDE = 10  # side-channel ports per encoder (rank offsets stay below it)
MOONCAKE_POOL_BYTES = 512 << 20  # registered pool per process (connector_extra overrides)


class UpConfig(BaseModel):
    """Everything `epd up` starts. Ports: gateway = base_port, encoders next, then decoders."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field("tiny", description="'tiny' = the locally built test model, or a path")
    served_name: str = "tiny-llava"
    encoders: int = Field(1, ge=0, le=16)
    decoders: int = Field(1, ge=1, le=16)
    base_port: int = Field(DEFAULT_BASE_PORT, ge=1024, le=65000)
    host: str = "127.0.0.1"
    transport: Literal["safetensors", "mooncake"] = "safetensors"
    storage_path: str | None = Field(None, description="default: <work dir>/up/ec-cache")
    mooncake_base_port: int = Field(DEFAULT_MOONCAKE_BASE_PORT, ge=1024, le=60000,
                                    description="encoder i's side channel: this + 10 * i; "
                                    "its announcements: that + 1000")
    encoder_backend: Literal["vllm", "pool"] = Field(
        "vllm", description="encoders are vLLM ec_producers, or `epd encoder` pools")
    pool: dict[str, Any] = Field(default_factory=dict,
                                 description="more PoolConfig keys for each `epd encoder`")
    connector_extra: dict[str, Any] = Field(default_factory=dict,
                                            description="more ec_connector_extra_config keys")
    cpu_cores: list[int] | None = Field(None, description="one core per vLLM server, in "
                                        "order (encoders, then decoders); default: spread "
                                        "over this machine's cores")
    vllm_args: list[str] = Field(default_factory=list)
    startup_timeout_s: float = Field(420.0, gt=0)
    clear_cache: bool = Field(True, description="empty the storage directory at start")
    gateway: dict[str, Any] = Field(default_factory=dict,
                                    description="GatewayConfig keys (limits, media, ...)")


class UpError(RuntimeError):
    pass


def load_up_config(path: Path | None, overrides: dict[str, Any] | None = None) -> UpConfig:
    data = read_config_file(path) if path else {}
    data.update(overrides or {})
    try:
        return UpConfig.model_validate(data)
    except ValidationError as exc:
        lines = ["invalid epd up configuration:"]
        lines += [f"  {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise UpError("\n".join(lines)) from None


def epd_config(role: str, storage: Path, extra: dict[str, Any] | None = None) -> dict:
    return {"ec_connector": "EPDConnector", "ec_role": role, "ec_buffer_device": "cpu",
            "ec_connector_extra_config": {"transport": "safetensors",
                                          "storage_path": str(storage), **(extra or {})}}


def mooncake_endpoint(cfg: UpConfig, i: int) -> str:
    """Encoder i's side channel (`host:port`): its rank 0 serves items there."""
    return f"127.0.0.1:{cfg.mooncake_base_port + MOONCAKE_PORT_STRIDE * i}"


def connector_extra(cfg: UpConfig, role: str, i: int = 0) -> dict[str, Any]:
    """ec_connector_extra_config keys for encoder i (role ec_producer) or a decode instance.
    Mooncake on one node: 127.0.0.1 (with MC_TCP_BIND_ADDRESS), a base port per encoder,
    every decode instance subscribed to every encoder; `connector_extra` may override the
    rest (protocol, memory_pool_bytes, ...), not the wiring."""
    if cfg.transport != "mooncake":
        return dict(cfg.connector_extra)
    wiring: dict[str, Any] = {"transport": "mooncake", "host": "127.0.0.1"}
    if role == "ec_producer":
        wiring["base_port"] = cfg.mooncake_base_port + MOONCAKE_PORT_STRIDE * i
    else:
        wiring["producers"] = [mooncake_endpoint(cfg, j) for j in range(cfg.encoders)]
    return {"protocol": "tcp", "memory_pool_bytes": MOONCAKE_POOL_BYTES,
            **cfg.connector_extra, **wiring}


@dataclass
class Deployment:
    """The started servers and gateway; `stop()` is idempotent and safe from any state."""

    cfg: UpConfig
    work_dir: Path
    encoders: list[VllmServer] = field(default_factory=list)
    decoders: list[VllmServer] = field(default_factory=list)
    gateway: Any = None  # GatewayThread
    gateway_cfg: GatewayConfig | None = None

    @property
    def servers(self) -> list[VllmServer]:
        return [*self.encoders, *self.decoders]

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.base_port}"

    def plan(self, model: Path) -> None:
        cfg = self.cfg
        logs = self.work_dir / "up"
        storage = Path(cfg.storage_path or logs / "ec-cache")
        if cfg.clear_cache:
            shutil.rmtree(storage, ignore_errors=True)
        storage.mkdir(parents=True, exist_ok=True)
        ncpu = os.cpu_count() or 1
        cores = list(cfg.cpu_cores or [])
        n = cfg.encoders + cfg.decoders
        if cores and len(cores) < n:
            raise UpError(f"cpu_cores lists {len(cores)} cores for {n} vLLM servers")
        port = cfg.base_port + 1
        env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"} if cfg.transport == "mooncake" else {}
        for i in range(n):
            core = cores[i] if cores else i % ncpu
            if i < cfg.encoders:
                extra = connector_extra(cfg, "ec_producer", i)
                if cfg.encoder_backend == "pool":
                    self.encoders.append(PoolServer(
                        f"encoder-{i}", model, port + i, logs, cpu_core=core,
                        served_name=cfg.served_name, env=dict(env), pool_config={
                            **cfg.pool, "transport": {"storage_path": str(storage), **extra}}))
                    continue
                role, name = "ec_producer", f"encoder-{i}"
            else:
                extra = connector_extra(cfg, "ec_consumer")
                role, name = "ec_consumer", f"decode-{i - cfg.encoders}"
            s = VllmServer(name, model, port + i, logs, epd_config(role, storage, extra),
                           cpu_core=core, served_name=cfg.served_name,
                           extra_args=list(cfg.vllm_args), env=dict(env))
            (self.encoders if i < cfg.encoders else self.decoders).append(s)
        for extra in ({"storage_path": str(storage), **connector_extra(cfg, "ec_producer")},
                      connector_extra(cfg, "ec_consumer")):
            try:  # fail now, not after minutes of vLLM start-up
                EPDConfig.from_dict({"transport": "safetensors", **extra})
            except ConfigError as exc:
                raise UpError(f"connector_extra: {exc}") from None
        if cfg.transport == "mooncake":
            availability = {"kind": "mooncake", "producers": self.mooncake_producers}
        else:
            availability = {"kind": "safetensors", "storage_path": str(storage)}
        try:
            self.gateway_cfg = GatewayConfig.build({
                **cfg.gateway, "host": cfg.host, "port": cfg.base_port,
                "model": cfg.served_name, "encoders": [s.url for s in self.encoders],
                "encoder_backend": cfg.encoder_backend,
                "decoders": [s.url for s in self.decoders], "availability": availability})
        except GatewayConfigError as exc:
            raise UpError(str(exc)) from None

    @property
    def mooncake_producers(self) -> list[str]:
        return [mooncake_endpoint(self.cfg, i) for i in range(self.cfg.encoders)]

    def check_ports(self) -> None:
        """Fail fast (before minutes of vLLM start-up) when a port is taken."""
        ports = [(self.cfg.host, self.cfg.base_port, "base_port"),
                 *(("127.0.0.1", s.port, "base_port") for s in self.servers)]
        if self.cfg.transport == "mooncake":
            for endpoint in self.mooncake_producers:
                port = int(endpoint.rsplit(":", 1)[1])
                ports += [("127.0.0.1", port, "mooncake_base_port"),
                          ("127.0.0.1", port + 1000, "mooncake_base_port")]
        for host, port, key in ports:
            with socket.socket() as sock:
                # as the servers themselves bind (uvicorn, ZMQ): TIME_WAIT leftovers of a
                # previous run are no conflict, a listener is
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind((host, port))
                except OSError as exc:
                    raise UpError(f"port {port} on {host} is not free ({exc}); pick "
                                  f"another {key}") from None

    def start(self, progress=print) -> None:
        from encoder_service.gateway.server import GatewayThread

        start_all(self.servers, timeout_s=self.cfg.startup_timeout_s, progress=progress)
        assert self.gateway_cfg is not None
        self.gateway = GatewayThread(self.gateway_cfg).start()
        progress(f"gateway listening on {self.url}")

    def stop(self, progress=print) -> None:
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        alive = [s for s in self.servers if s.proc is not None and s.proc.poll() is None]
        if alive:
            progress(f"stopping {', '.join(s.name for s in alive)}")
        threads = [threading.Thread(target=s.stop) for s in alive]  # in parallel
        for t in threads:
            t.start()
        for t in threads:
            t.join()


class _Shutdown(BaseException):
    """Raised in the main thread by SIGINT/SIGTERM handlers."""


def _raise_shutdown(signum: int, frame: object) -> None:
    raise _Shutdown(signal.Signals(signum).name)


def _ignore(signum: int, frame: object) -> None:
    print("[up] already stopping; please wait", flush=True)


def run_up(cfg: UpConfig, work_dir: Path, demo: Any = None) -> int:
    """Start everything, then serve until a signal (or run `demo(deployment)` and stop)."""
    from encoder_service.testmodel import SPECS, build

    def say(msg: str) -> None:
        print(f"[up] {msg}", flush=True)

    old = {s: signal.signal(s, _raise_shutdown) for s in (signal.SIGINT, signal.SIGTERM)}
    dep = Deployment(cfg, work_dir)
    try:
        model = (build(work_dir / "models" / "tiny-llava", SPECS["tiny"])
                 if cfg.model == "tiny" else Path(cfg.model))
        dep.plan(model)
        dep.check_ports()
        kind = "epd encoder pool" if cfg.encoder_backend == "pool" else "vLLM"
        say(f"starting {cfg.encoders} encoder(s) ({kind}) and {cfg.decoders} prefill/decode "
            f"instance(s) of {cfg.served_name} (EPDConnector over {cfg.transport})")
        dep.start(progress=say)
        say(f"ready: OpenAI-compatible endpoint {dep.url}/v1 (model {cfg.served_name!r}); "
            f"metrics {dep.url}/metrics; logs {work_dir / 'up'}")
        if demo is not None:
            return demo(dep)
        say("serving; Ctrl-C or SIGTERM stops everything")
        while True:
            for s in dep.servers:
                if s.proc is not None and s.proc.poll() is not None and not getattr(
                        s, "_reported", False):
                    s._reported = True  # type: ignore[attr-defined]
                    say(f"WARNING: {s.name} exited with code {s.proc.returncode}; the "
                        f"gateway routes around it (log {s.log_path})")
            time.sleep(1.0)
    except _Shutdown as exc:
        say(f"{exc} received")
        return 0
    except (ServerFailed, UpError, GatewayConfigError, RuntimeError) as exc:
        say(f"ERROR: {exc}")
        return 1
    finally:
        for s in old:
            signal.signal(s, _ignore)
        dep.stop(progress=say)
        for s, h in old.items():
            signal.signal(s, h)
        say("stopped")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="epd up", description="start a local EPD deployment: "
                                "encoder(s) + vLLM prefill/decode instance(s) + gateway")
    p.add_argument("--config", type=Path, help="deployment config (.json or .toml); "
                   "every key has a default")
    p.add_argument("--base-port", type=int, help=f"gateway port (default {DEFAULT_BASE_PORT});"
                   " vLLM servers take the next ports")
    p.add_argument("--encoders", type=int)
    p.add_argument("--decoders", type=int)
    p.add_argument("--transport", choices=["safetensors", "mooncake"])
    p.add_argument("--encoder-backend", choices=["vllm", "pool"])
    p.add_argument("--demo", action="store_true",
                   help="send a real image request through the gateway, print it, stop")
    p.add_argument("--prompt", default="describe the image")
    args = p.parse_args(argv)
    overrides = {k: v for k, v in (("base_port", args.base_port), ("encoders", args.encoders),
                                   ("decoders", args.decoders), ("transport", args.transport),
                                   ("encoder_backend", args.encoder_backend))
                 if v is not None}
    try:
        cfg = load_up_config(args.config, overrides)
    except (UpError, GatewayConfigError) as exc:
        print(f"epd up: {exc}", file=sys.stderr)
        return 2
    work = Path(os.environ.get("EPD_WORK_DIR", Path.cwd() / ".work")).resolve()
    demo = None
    if args.demo:
        from encoder_service.demo import demo_requests

        def demo(dep: Deployment) -> int:
            return demo_requests(dep, args.prompt)
    return run_up(cfg, work, demo)
