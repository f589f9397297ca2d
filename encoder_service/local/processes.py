"""Start, health-check and stop the servers of the local stack.

For `epd up`, the demo, tests and benchmarks. `ManagedProcess` is what they share; `VllmServer`
(`vllm serve`, forked from a fork server once one is ready: forkserver.py), `PoolServer`
(`epd encoder`), `UpProcess` (a whole `epd up`); `MasterServer` is in mooncake_master.py.

Every managed process runs in a session of its own (stopped as a whole: SIGTERM, then
SIGKILL, even when the process itself is already gone) and dies with the thread that started
it, even when its parent is SIGKILLed (`epd_common.child_process`: parent-death signal; for
vLLM, whose SIGTERM handling misses a signal that arrives during start-up, a process-group
guard on top; vLLM's EngineCore and workers die with their API server: ec_connectors.plugin).
Start them from a thread that lives as long as they should (the main thread: `epd up`,
`start_all`, test fixtures). `epd up` restarts what exits unasked: supervise.py.

With `$EPD_START_LEDGER` set to a file path, every start appends one JSON line to it (kind,
name, port, pid, time, why: deploy, scale-up or restart), from whichever process starts it
(`epd up`, its supervisor and scaler inherit the variable): what an operator reads to count
the starts and restarts of a fleet, and what the test suite counts vLLM starts by.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import httpx

from encoder_service.local import forkserver, vllm_cli
from epd_common import child_process

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; annotations only


def vllm_env(work_dir: Path, cpu_core: int | None = None) -> dict[str, str]:
    """The environment of a vLLM server started by the local stack.

    Environment that keeps temp files in the server's work dir and vLLM's and torch
    inductor's caches in the project's (`$VLLM_CACHE_ROOT`, `$TORCHINDUCTOR_CACHE_DIR` when
    set), offline. One cache for every server: vLLM inspects a model class in a fresh
    interpreter unless its cache knows it, and compiles its sampler's logprobs kernels at the
    first request that asks for logprobs; a cache per server paid both on every server
    (figures: docs/benchmarks.md, "Figures behind the code's choices")."""
    tmp = work_dir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        TMPDIR=str(tmp),
        VLLM_CACHE_ROOT=env.get("VLLM_CACHE_ROOT") or str(default_work_dir() / "cache" / "vllm"),
        TORCHINDUCTOR_CACHE_DIR=env.get("TORCHINDUCTOR_CACHE_DIR")
        or str(default_work_dir() / "cache" / "inductor"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        PYTHONUNBUFFERED="1",
    )
    if cpu_core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu_core)
    return env


def _pinned(cmd: list[str], cpu_core: int | None) -> list[str]:
    """`cmd` run on `cpu_core` alone, every process and thread of it (taskset), when given.

    vLLM binds only its worker's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND); its API server and
    EngineCore, which busy-poll, otherwise wander onto the other servers' cores: unpinned, the
    same workload's throughput varies several-fold run to run (docs/benchmarks.md, "Figures
    behind the code's choices"). Pinned from its first instruction, not once up: a server
    moved onto one core after it started keeps the thread pools it sized for every core (its
    embeddings were then no longer bit-identical to a pinned server's)."""
    if cpu_core is None or not shutil.which("taskset"):
        return cmd
    return ["taskset", "-c", str(cpu_core), *cmd]


VLLM_CLI = "encoder_service.local.vllm_cli"  # the `vllm` entry point servers run
VLLM_PRELOAD = VLLM_CLI + ":preload"  # what their fork servers import
# vLLM's `--middleware` every server gets: the deployment key on every route, bounds on
# metadata-only items before vLLM allocates anything, a reason on every refusal
SERVER_GUARD = "ec_connectors.server_guard.ServerGuard"
LEDGER_ENV = "EPD_START_LEDGER"


def record_start(process: ManagedProcess) -> None:
    """Append `process`'s start to the ledger file `$EPD_START_LEDGER` names, if any.

    One line per start, written whole under an exclusive lock (several processes append to
    one ledger). A ledger that cannot be written is left alone: it never stops a start."""
    process.times_started += 1
    path = os.environ.get(LEDGER_ENV)
    if not path or process.proc is None:
        return
    reason = process.start_reason if process.times_started == 1 else "restart"
    line = json.dumps({"kind": type(process).__name__, "name": process.name,
                       "port": process.port, "pid": process.proc.pid, "t": time.time(),
                       "by": os.getpid(), "start": process.times_started,
                       "reason": reason}) + "\n"
    try:
        with open(path, "a", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(line)
    except OSError:
        pass


class ServerFailed(RuntimeError):
    pass


class ManagedProcess:
    """One managed server process: `start()`, `wait()` (until `healthy()`), `stop()`, its log.

    A context manager. Subclasses are dataclasses that define `command()` and declare, each
    in its own public order, `name`, `port`, `work_dir` (logs: work_dir/logs/NAME.log), `env`
    (on top of `child_env()`), `proc` (the running process, set by `start()`)."""

    name: str
    port: int
    work_dir: Path
    env: dict[str, str]
    proc: subprocess.Popen | forkserver.ForkedProcess | None

    times_started: int = 0  # start() calls: a second start is a restart (record_start)
    start_reason: str = "deploy"  # why its first start: "deploy", or "scale-up" (scaler.py)
    startup_timeout_s: ClassVar[float] = 300.0  # wait()'s default
    # The child runs `child_process.guard_process_group_from_env()` (it has children of its
    # own and may miss its parent-death signal): start() tells it whose death to watch.
    guards_group: ClassVar[bool] = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.work_dir / "logs" / f"{self.name}.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        raise NotImplementedError

    def child_env(self) -> dict[str, str]:
        """The child's environment before `env` is added."""
        return dict(os.environ)

    def start(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**self.child_env(), **self.env}
        if self.guards_group:
            env[child_process.PARENT_PID_ENV] = str(os.getpid())
        self.proc = self._launch(env)
        record_start(self)
        return self

    def prepare(self, wait_s: float = 0.0) -> None:
        """Get ready to start, waiting at most `wait_s` (`start_all`); nothing here."""

    preparing: ClassVar[bool] = False  # whether `prepare()` is under way (start_all waits)

    def _launch(self, env: dict[str, str]) -> subprocess.Popen | forkserver.ForkedProcess:
        with open(self.log_path, "wb") as log:
            return child_process.popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True)

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

    def wait(self, timeout_s: float | None = None) -> None:
        timeout_s = self.startup_timeout_s if timeout_s is None else timeout_s
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
        """Stop the process and everything in its session.

        SIGTERM to its whole session (process group), SIGKILL after `timeout_s`;
        idempotent. Also once the process itself is gone: what it started may not be (an
        API server SIGKILLed, its EngineCore left), so until no process of the session
        remains (`child_process.stop_session`)."""
        if self.proc is not None:
            child_process.stop_session(self.proc, timeout_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class VllmServer(ManagedProcess):
    """One `vllm serve` process (through the vllm-cpu shim `vllm_cli`)."""

    name: str
    model: Path
    port: int
    work_dir: Path
    ec_config: dict | None = None
    cpu_core: int | None = None
    served_name: str = "tiny-llava"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of vllm_env()
    fork_server: bool = True  # forked from one that imported vLLM already (forkserver.py)
    proc: subprocess.Popen | forkserver.ForkedProcess | None = None

    # Its API server stops EngineCore and the workers on SIGTERM once it serves, but not
    # during start-up: vllm_cli guards the process group (see epd_common.child_process).
    guards_group: ClassVar[bool] = True

    @property
    def model_in_engine_core(self) -> bool:
        """Whether to run the model inside EngineCore rather than a worker process.

        Run the model inside EngineCore (vLLM's `uni` executor), as vLLM does on one GPU,
        instead of in a worker process of its own (what vllm-cpu picks). Only for a server on
        one core: there the worker and EngineCore busy-wait on each other through a shared-
        memory queue (the serving benchmark's figures: docs/benchmarks.md, "Figures behind the
        code's choices"). `--distributed-executor-backend` in `extra_args` overrides it."""
        return self.cpu_core is not None and not any(
            a.split("=")[0] == "--distributed-executor-backend" for a in self.extra_args)

    def command(self) -> list[str]:
        return _pinned([sys.executable, "-m", VLLM_CLI, *self.serve_args()], self.cpu_core)

    def serve_args(self) -> list[str]:  # `vllm serve`'s arguments, after the program
        cmd = ["serve", str(self.model),
               "--served-model-name", self.served_name, "--host", "127.0.0.1",
               "--port", str(self.port), "--enforce-eager", "--max-model-len", "1024",
               "--max-num-seqs", "16", "--runner", "generate", "--middleware", SERVER_GUARD,
               *self.extra_args]
        if self.model_in_engine_core:
            cmd += ["--distributed-executor-backend", "uni"]
        if self.ec_config is not None:
            cmd += ["--ec-transfer-config", json.dumps(self.ec_config)]
        return cmd

    def _fork_server(self, launch: bool = False) -> forkserver.ForkServer | None:
        """Its fork server (launched if none runs and `launch`); None without one."""
        return forkserver.fork_server_for(
            VLLM_PRELOAD, {**self.child_env(), **self.env}, _pinned([], self.cpu_core),
            self.work_dir / "logs", launch=launch) if self.fork_server else None

    def prepare(self, wait_s: float = 0.0) -> None:
        """Launch its fork server if none runs; wait at most `wait_s` for its imports."""
        if (server := self._fork_server(launch=True)) is not None:
            server.wait_ready(wait_s)

    preparing = property(lambda self: (s := self._fork_server()) is not None and not s.ready)

    def _launch(self, env: dict[str, str]) -> subprocess.Popen | forkserver.ForkedProcess:
        server = self._fork_server()  # one `prepare()` launched; start() never waits for it
        if server is not None and server.ready:
            self.log_path.write_bytes(b"")  # a new log, as a plain start's
            try:
                return server.fork(VLLM_CLI, self.serve_args(), env, self.log_path)
            except forkserver.ForkServerError as exc:  # gone just now: a plain start
                logging.getLogger(__name__).warning("%s: %s; a plain start", self.name, exc)
        return super()._launch(env)

    def child_env(self) -> dict[str, str]:
        env = vllm_env(self.work_dir, self.cpu_core)
        if self.model_in_engine_core:  # vllm-cpu turns `uni` back into `mp` without it
            env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", vllm_cli.FORK_ENGINE_CORE_ENV: "1"})
        return env


@dataclass
class PoolServer(ManagedProcess):
    """One `epd encoder` (batching encoder pool) process.

    `pool_config` holds PoolConfig keys (model, port and host are set here)."""

    name: str
    model: Path
    port: int
    work_dir: Path
    cpu_core: int | None = None
    served_name: str = "tiny-llava"
    env: dict[str, str] = field(default_factory=dict)  # on top of vllm_env()
    proc: subprocess.Popen | None = None
    pool_config: dict = field(default_factory=dict)

    @property
    def config_path(self) -> Path:
        return self.work_dir / f"{self.name}.json"

    def command(self) -> list[str]:
        return _pinned([sys.executable, "-m", "encoder_service.encoder_pool.server",
                        "--config", str(self.config_path)], self.cpu_core)

    def child_env(self) -> dict[str, str]:
        env = vllm_env(self.work_dir)
        if self.cpu_core is not None:  # pinned to one core: one torch thread
            env["OMP_NUM_THREADS"] = "1"
        return env

    def write_config(self) -> Path:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(json.dumps({
            "served_model_name": self.served_name, **self.pool_config,
            "model": str(self.model), "host": "127.0.0.1", "port": self.port}))
        return self.config_path

    def start(self) -> Self:
        self.write_config()
        super().start()
        return self


@dataclass
class UpProcess(ManagedProcess):
    """A whole `epd up` run as one child process.

    A whole `epd up` as one child process (tests, benchmarks): `config` is its up.json
    (written to work_dir/up.json), `work_dir` its work dir (EPD_WORK_DIR), its output in
    work_dir/epd-up.log. Healthy once its gateway answers /health naming its decoders: this
    deployment's gateway, not whatever else holds the port. `stop()` is a SIGTERM: `epd up`
    stops what it started."""

    config: dict
    work_dir: Path
    name: str = "epd-up"
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    args: list[str] = field(default_factory=list)  # command-line flags over the config

    startup_timeout_s: ClassVar[float] = 420.0  # vLLM servers on two shared cores

    @property
    def port(self) -> int:  # the gateway's: the config's base_port
        return int(self.config["base_port"])

    @property
    def url(self) -> str:
        return f"http://{self.config.get('host', '127.0.0.1')}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.work_dir / "epd-up.log"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "encoder_service.cli", "up", "--config",
                str(self.work_dir / "up.json"), *self.args]

    def child_env(self) -> dict[str, str]:
        # its servers keep the caller's vLLM and inductor caches (vllm_env), not ones in its
        # own work dir: a cold cache slows every first start and first logprobs request
        env = vllm_env(self.work_dir)
        return dict(os.environ, EPD_WORK_DIR=str(self.work_dir),
                    VLLM_CACHE_ROOT=env["VLLM_CACHE_ROOT"],
                    TORCHINDUCTOR_CACHE_DIR=env["TORCHINDUCTOR_CACHE_DIR"])

    def healthy(self) -> bool:
        try:
            r = httpx.get(self.url + "/health", timeout=5.0)
            return r.status_code == 200 and "decoders" in r.json()
        except (httpx.HTTPError, ValueError):
            return False

    def start(self) -> Self:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        (self.work_dir / "up.json").write_text(json.dumps(self.config))
        return super().start()


def start_all(servers: Sequence[ManagedProcess], timeout_s: float = 420.0,
              progress: Callable[[str], None] = print) -> None:
    """Start servers from this thread (they die with it), wait for all; stop all on failure."""
    t0 = time.monotonic()
    for s in servers:  # fork servers import side by side; what needs none starts now
        s.prepare()
    now = [s for s in servers if not s.preparing]
    later = [s for s in servers if s.preparing]
    if later:
        progress(f"importing vLLM once per core for {', '.join(s.name for s in later)} "
                 "(fork servers: this start and every restart is a fork)")
    for s in [*now, *later]:
        s.prepare(wait_s=max(0.0, timeout_s / 2 - (time.monotonic() - t0)))
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


def default_work_dir(base: Path | None = None) -> Path:
    """`$EPD_WORK_DIR`, else `<base>/.work` (default base: the current directory)."""
    return Path(os.environ.get("EPD_WORK_DIR", (base or Path.cwd()) / ".work")).resolve()
