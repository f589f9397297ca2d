"""`epd up`: a whole local EPD deployment from one config file with embedded defaults.

Starts the encoder(s) (vLLM ec_producer) and prefill/decode instance(s) (vLLM ec_consumer)
with EPDConnector over the safetensors transport, waits for health with progress output,
then serves the gateway in-process and prints the endpoint. Ctrl-C or SIGTERM stops
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

from encoder_service.gateway.config import GatewayConfig, GatewayConfigError, read_config_file
from encoder_service.launcher import ServerFailed, VllmServer, start_all

DEFAULT_BASE_PORT = 18100


class UpConfig(BaseModel):
    """Everything `epd up` starts. Ports: gateway = base_port, encoders next, then decoders."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field("tiny", description="'tiny' = the locally built test model, or a path")
    served_name: str = "tiny-llava"
    encoders: int = Field(1, ge=0, le=16)
    decoders: int = Field(1, ge=1, le=16)
    base_port: int = Field(DEFAULT_BASE_PORT, ge=1024, le=65000)
    host: str = "127.0.0.1"
    transport: Literal["safetensors"] = "safetensors"
    storage_path: str | None = Field(None, description="default: <work dir>/up/ec-cache")
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
        for i in range(n):
            role = "ec_producer" if i < cfg.encoders else "ec_consumer"
            name = f"encoder-{i}" if i < cfg.encoders else f"decode-{i - cfg.encoders}"
            core = cores[i] if cores else i % ncpu
            s = VllmServer(name, model, port + i, logs,
                           epd_config(role, storage, cfg.connector_extra), cpu_core=core,
                           served_name=cfg.served_name, extra_args=list(cfg.vllm_args))
            (self.encoders if i < cfg.encoders else self.decoders).append(s)
        try:
            self.gateway_cfg = GatewayConfig.build({
                **cfg.gateway, "host": cfg.host, "port": cfg.base_port,
                "model": cfg.served_name, "encoders": [s.url for s in self.encoders],
                "decoders": [s.url for s in self.decoders],
                "availability": {"kind": "safetensors", "storage_path": str(storage)}})
        except GatewayConfigError as exc:
            raise UpError(str(exc)) from None

    def check_ports(self) -> None:
        """Fail fast (before minutes of vLLM start-up) when a port is taken."""
        ports = [self.cfg.base_port, *(s.port for s in self.servers)]
        for port in ports:
            with socket.socket() as sock:
                try:
                    sock.bind((self.cfg.host, port))
                except OSError as exc:
                    raise UpError(f"port {port} on {self.cfg.host} is not free ({exc}); pick "
                                  "another base_port") from None

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
        say(f"starting {cfg.encoders} encoder(s) and {cfg.decoders} prefill/decode "
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
                                "vLLM encoder(s) + prefill/decode instance(s) + gateway")
    p.add_argument("--config", type=Path, help="deployment config (.json or .toml); "
                   "every key has a default")
    p.add_argument("--base-port", type=int, help=f"gateway port (default {DEFAULT_BASE_PORT});"
                   " vLLM servers take the next ports")
    p.add_argument("--encoders", type=int)
    p.add_argument("--decoders", type=int)
    p.add_argument("--demo", action="store_true",
                   help="send a real image request through the gateway, print it, stop")
    p.add_argument("--prompt", default="describe the image")
    args = p.parse_args(argv)
    overrides = {k: v for k, v in (("base_port", args.base_port), ("encoders", args.encoders),
                                   ("decoders", args.decoders)) if v is not None}
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
