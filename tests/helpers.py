"""Small helpers shared by the tests (test modules never import each other)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil
import uvicorn

from ec_connectors.protocol import ports
from ec_connectors.transports.base import checksum, tensor_bytes
from encoder_service.local.processes import UpProcess, default_work_dir
from epd_testkit.peer_process import PeerClient, seeded_tensor

ROOT = Path(__file__).resolve().parent.parent
WORK = default_work_dir(ROOT)

# Environment of processes using Mooncake on one node: traffic stays on loopback.
LOOPBACK = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


def wait_for(pred: Callable[[], object], timeout: float = 5.0, interval: float = 0.005) -> bool:
    """Poll `pred` until it is truthy (True) or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


# --- ports: the one table of the tests' ports ------------------------------------------------
# The fast lane runs modules side by side on two xdist workers (`--dist loadfile`), the e2e
# and deploy lanes one module at a time, maybe beside someone else's fast lane: every module
# that listens, binds, checks or starts a server on a port takes it from its own block here
# (`port_block(__name__)`; tests that only plan, binding nothing, may name any number).
# tests/test_port_blocks.py checks the blocks are disjoint, below the kernel's ephemeral ports,
# and clear of the Mooncake engines' range and of a default `epd up`'s fixed ports (the port
# plan, ec_connectors/protocol/ports.py). New module: take a free block, the check says.
HTTP, MOONCAKE, MASTER = "http", "mooncake", "master"
# what a block of each kind holds beyond itself: a Mooncake side-channel base port also takes
# its announcement (+1000) and data connection (+2000) ports; a store master block holds each
# master's RPC, metadata (+1) and metrics (+2) ports
PLANES = {HTTP: (0,), MASTER: (0,),
          MOONCAKE: (ports.PURPOSE_SERVE, ports.PURPOSE_ANNOUNCE, ports.PURPOSE_STREAM)}
PORT_BLOCKS: dict[tuple[str, str], tuple[int, int]] = {  # (module, kind): (first, count)
    # fast lane: servers, stubs and gateways on this process's threads or children
    ("tests.encoder_service.encoder_pool.test_server", HTTP): (18410, 5),
    ("tests.encoder_service.gateway.test_parsing", HTTP): (18500, 20),
    ("tests.encoder_service.gateway.test_admission", HTTP): (18520, 20),
    ("tests.encoder_service.test_bench", HTTP): (18540, 10),
    ("tests.encoder_service.gateway.test_urls", HTTP): (18560, 10),
    ("tests.encoder_service.gateway.test_backends", HTTP): (18600, 30),
    ("tests.encoder_service.local.test_up", HTTP): (18630, 20),  # `epd up` checks, no start
    ("tests.encoder_service.gateway.test_chat", HTTP): (18720, 40),
    ("tests.encoder_service.gateway.test_relay", HTTP): (18760, 10),
    ("tests.encoder_service.gateway.test_admin", HTTP): (18790, 10),
    ("tests.encoder_service.gateway.test_auth", HTTP): (18860, 30),
    ("tests.encoder_service.gateway.test_decoders", HTTP): (19000, 40),
    ("tests.encoder_service.gateway.test_routing", HTTP): (19100, 30),
    ("tests.encoder_service.gateway.test_kv_handoff", HTTP): (18800, 20),
    ("tests.encoder_service.gateway.test_tracing", HTTP): (19200, 20),
    ("tests.encoder_service.gateway.test_top", HTTP): (19240, 20),
    ("tests.encoder_service.gateway.test_member_cli", HTTP): (19260, 3),
    # fast lane: Mooncake Store masters (5 apart) and Transfer Engine producers (10 apart)
    ("tests.ec_connectors.transports.test_mooncake_store", MASTER): (19500, 300),
    ("tests.encoder_service.local.test_processes", MASTER): (19900, 40),
    ("tests.encoder_service.local.test_up", MASTER): (19960, 3),
    ("tests.ec_connectors.transports.test_mooncake_te_server", MOONCAKE): (21000, 300),
    ("tests.ec_connectors.transports.test_mooncake_te_puller", MOONCAKE): (21300, 300),
    ("tests.ec_connectors.transports.test_mooncake_te_hosts", MOONCAKE): (21600, 300),
    ("tests.encoder_service.local.test_up", MOONCAKE): (21900, 10),
    ("tests.encoder_service.gateway.test_backends", MOONCAKE): (21950, 10),  # announcements
    ("tests.ec_connectors.transports.test_nixl_pull", MOONCAKE): (26000, 50),
    # e2e lane: vLLM servers, pools and `epd up` (gateway, then its servers)
    ("tests.e2e.test_connector_safetensors", HTTP): (18300, 1),  # the encoder pool
    ("tests.e2e.fleets", HTTP): (19300, 30),  # the shared deployments: fleets.py
    ("tests.e2e.fleets", MOONCAKE): (26100, 20),
    ("tests.e2e.fleets", MASTER): (19870, 3),
    ("tests.e2e.test_qwen3_deepstack", HTTP): (18370, 3),
    ("tests.e2e.conftest", HTTP): (18390, 1),  # the session's aggregated reference
    ("tests.prewarm", HTTP): (18395, 1),  # beside the fast lane (run.sh test)
    ("tests.e2e.test_gateway", HTTP): (18570, 27),
    ("tests.e2e.test_up", HTTP): (18660, 13),
    ("tests.e2e.test_qwen_modalities", HTTP): (18680, 5),
    ("tests.e2e.test_elastic", HTTP): (18920, 5),  # gateway, 2 encoders, 2 decode instances
    ("tests.e2e.test_qwen3_deepstack", MOONCAKE): (21920, 10),
    ("tests.e2e.test_up", MOONCAKE): (21960, 30),
    # deploy lane: the `epd up` reference, the compose stack's published gateway and Prometheus;
    # the dashboard's `epd up` (gateway, pool, decode) and Prometheus
    ("tests.deploy.test_compose_stack", HTTP): (18900, 5),
    ("tests.deploy.test_dashboard", HTTP): (18910, 5),
    ("tests.deploy.test_compose_nixl", HTTP): (18930, 2),
}


def port_block(module: str, kind: str = HTTP) -> range:
    """The ports of kind `kind` that test module `module` (its `__name__`) owns."""
    first, count = PORT_BLOCKS[(module, kind)]
    return range(first, first + count)


def block_footprint(kind: str, block: range) -> set[int]:
    """Every port a block of `kind` may hold (its planes included)."""
    return {port + plane for plane in PLANES[kind] for port in block}


def free_port(candidates: Iterator[int]) -> int:
    """The next port of `candidates` that nothing listens on (`iter(port_block(__name__))`)."""
    for p in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port left in this test module's block (tests/helpers.py)")


def expected(seed: int, shape: list[int], dtype: str = "bfloat16") -> str:
    """Checksum of the tensor a peer process stores for `seed` (`peer_process.seeded_tensor`)."""
    return checksum(tensor_bytes(seeded_tensor(seed, shape, dtype)))


def descendants(pid: int) -> set[int]:
    """All live descendants of `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def server_pid(root: int, port: int) -> int:
    """The vLLM server under `root` (`epd up`'s pid) that serves `port` (its API server)."""
    for pid in sorted(descendants(root)):
        with contextlib.suppress(psutil.Error):
            cmd = psutil.Process(pid).cmdline()
            if "serve" in cmd and "--port" in cmd and cmd[cmd.index("--port") + 1] == str(port):
                return pid
    raise AssertionError(f"no server on port {port} under {root}")


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_all(servers: Iterable) -> None:
    """`stop()` every server (`ManagedProcess`) at once: their shutdowns (vLLM's take seconds
    each) overlap instead of adding up."""
    servers = list(servers)
    if servers:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda s: s.stop(), servers))


def run_pool(coro_fn: Callable[[], Awaitable], pool):
    """`coro_fn()` on a new event loop with the encoder pool `pool` started, then stopped."""
    async def main():
        await pool.start()
        try:
            return await coro_fn()
        finally:
            await pool.stop()
    return asyncio.run(main())


@contextlib.contextmanager
def epd_up(conf: dict, work: Path, also_ready: Callable[[], bool] = lambda: True,
           timeout: float = 420.0, interval: float = 0.5, stop_timeout: float = 90.0,
           args: list[str] | None = None):
    """`epd up` of config `conf` (and command-line `args`) in work dir `work` (`UpProcess`:
    its output in <work>/epd-up.log); yields (process, gateway URL, log path) once its
    gateway is healthy and `also_ready()` holds; stopped after (SIGTERM, `stop_timeout`
    before a SIGKILL). An `epd up` that exits while starting fails the wait with its log's
    tail."""
    up = UpProcess(conf, work, args=list(args or [])).start()

    def ready() -> bool:
        if not up.running:
            raise RuntimeError(f"epd up exited: {up.log_tail(60)}")
        return also_ready() and up.healthy()

    try:
        assert wait_for(ready, timeout=timeout, interval=interval), \
            f"epd up not ready in {timeout:.0f} s (log {up.log_path})"
        yield up.proc, up.url, up.log_path
    finally:
        up.stop(stop_timeout)


@dataclass(frozen=True)
class ServerAt:
    """A server a test reaches by its URL alone (one of a shared fleet's: tests/e2e/fleets.py)."""

    url: str


class Served:
    """An ASGI app served by uvicorn on a thread of the test process, for one `with` block."""

    def __init__(self, app, port: int):
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        assert wait_for(lambda: self.server.started, timeout=30), "server did not start"
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=15)


class Peers:
    """Peer processes of one test; all killed at the end, whatever happened."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.all: list[PeerClient] = []

    def start(self, placement: dict, prefix: list[str] | None = None, **config) -> PeerClient:
        log = WORK / "test-mooncake" / f"{self.name}-{len(self.all)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        peer = PeerClient(prefix=prefix, env={"MC_TCP_BIND_ADDRESS": config.get(
            "host", LOOPBACK["MC_TCP_BIND_ADDRESS"])}, log_path=str(log))
        self.all.append(peer)
        peer.info = peer.call({"op": "init", "config": config, "placement": placement})
        return peer

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask every peer to quit at once, then wait for all together (their transports'
        teardowns overlap instead of adding up); a peer that does not quit is killed."""
        for peer in self.all:
            if peer.proc.poll() is None:
                os.killpg(peer.proc.pid, signal.SIGCONT)  # a test may have frozen it
                with contextlib.suppress(OSError, ValueError):
                    peer.send({"op": "quit"})
        deadline = time.monotonic() + timeout_s
        for peer in self.all:
            with contextlib.suppress(subprocess.TimeoutExpired):
                peer.proc.wait(max(0.0, deadline - time.monotonic()))
            peer.close(timeout_s=0)  # kills it if it is still running
