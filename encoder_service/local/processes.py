"""Start, health-check and stop real `vllm serve` processes (demo, tests, benchmarks)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def vllm_env(work_dir: Path, cpu_core: int | None = None) -> dict[str, str]:
    """Environment that keeps vLLM's caches and temp files in our work dir, offline."""
    tmp = work_dir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        TMPDIR=str(tmp),
        VLLM_CACHE_ROOT=str(work_dir / "cache" / "vllm"),
        TORCHINDUCTOR_CACHE_DIR=str(work_dir / "cache" / "inductor"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        PYTHONUNBUFFERED="1",
    )
    if cpu_core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_core)
    return env


class ServerFailed(RuntimeError):
    pass


@dataclass
class VllmServer:
    """One `vllm serve` process. Use as a context manager, or start()/wait()/stop()."""

    name: str
    model: Path
    port: int
    work_dir: Path
    ec_config: dict | None = None
    cpu_core: int | None = None
    served_name: str = "tiny-llava"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of vllm_env()
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.work_dir / "logs" / f"{self.name}.log"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "encoder_service.local.vllm_cli", "serve", str(self.model),
               "--served-model-name", self.served_name, "--host", "127.0.0.1",
               "--port", str(self.port), "--enforce-eager", "--max-model-len", "1024",
               "--max-num-seqs", "16", "--runner", "generate", *self.extra_args]
        if self.ec_config is not None:
            cmd += ["--ec-transfer-config", json.dumps(self.ec_config)]
        return cmd

    def start(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT,
                env={**vllm_env(self.work_dir, self.cpu_core), **self.env},
                start_new_session=True,
            )
        return self

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerFailed(f"{self.name} exited with code {self.proc.returncode}; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise ServerFailed(f"{self.name} not healthy after {timeout_s:.0f} s; log "
                           f"{self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        except ProcessLookupError:
            pass

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class PoolServer(VllmServer):
    """One `epd encoder` (batching encoder pool) process, managed like a VllmServer.
    `pool_config` holds PoolConfig keys (model, port and host are set here)."""

    pool_config: dict = field(default_factory=dict)

    @property
    def config_path(self) -> Path:
        return self.work_dir / f"{self.name}.json"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "encoder_service.encoder_pool.server", "--config",
               str(self.config_path)]
        if self.cpu_core is not None and shutil.which("taskset"):
            cmd = ["taskset", "-c", str(self.cpu_core), *cmd]
        return cmd

    def write_config(self) -> Path:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps({
            "served_model_name": self.served_name, **self.pool_config,
            "model": str(self.model), "host": "127.0.0.1", "port": self.port}))
        return self.config_path

    def start(self) -> PoolServer:
        self.write_config()
        if self.cpu_core is not None:  # pinned to one core: one torch thread
            self.env = {"OMP_NUM_THREADS": "1", **self.env}
        super().start()
        return self


def start_all(servers: list[VllmServer], timeout_s: float = 420.0,
              progress: Callable[[str], None] = print) -> None:
    """Start servers together and wait for all, printing progress; stops all on failure."""
    t0 = time.monotonic()
    for s in servers:
        s.start()
        progress(f"starting {s.name} on :{s.port} (log {s.log_path})")
    pending = list(servers)
    last = 0.0
    try:
        while pending:
            for s in list(pending):
                if s.proc is not None and s.proc.poll() is not None:
                    raise ServerFailed(f"{s.name} exited with code {s.proc.returncode}; log "
                                       f"{s.log_path}:\n{s.log_tail()}")
                if s.healthy():
                    pending.remove(s)
                    progress(f"{s.name} healthy after {time.monotonic() - t0:.0f} s")
            elapsed = time.monotonic() - t0
            if elapsed > timeout_s:
                names = ", ".join(f"{s.name} (log {s.log_path})" for s in pending)
                raise ServerFailed(f"not healthy after {timeout_s:.0f} s: {names}")
            if pending and elapsed - last >= 10:
                last = elapsed
                progress(f"waiting for {', '.join(s.name for s in pending)} "
                         f"({elapsed:.0f} s; vLLM on CPU takes ~40-90 s)")
            time.sleep(0.5)
    except BaseException:
        for s in servers:
            s.stop()
        raise


def metric_value(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets) in a /metrics text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total
