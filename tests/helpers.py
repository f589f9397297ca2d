"""Small helpers shared by the tests (test modules never import each other)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import uvicorn

from ec_connectors import child_process
from ec_connectors.testing.peer_process import PeerClient, seeded_tensor
from ec_connectors.transports.base import checksum, tensor_bytes
from encoder_service.local.workdir import work_dir

ROOT = Path(__file__).resolve().parent.parent
WORK = work_dir(ROOT)

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


def free_port(ports: Iterator[int]) -> int:
    """The next port of `ports` that nothing listens on (each test module owns a range)."""
    for p in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port left in this test module's range")


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
           timeout: float = 420.0, interval: float = 0.5, stop_timeout: float = 90.0):
    """`epd up --config <work>/up.json` (`conf`) as a child process, its output in
    <work>/epd-up.log and its work dir `work`; yields (process, gateway URL, log path) once
    the gateway answers /health and `also_ready()` holds; SIGTERM and wait after. An `epd
    up` that exits while starting fails the wait with its log's tail."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "up.json").write_text(json.dumps(conf))
    gw = f"http://{conf.get('host', '127.0.0.1')}:{conf['base_port']}"
    log_path = work / "epd-up.log"
    with open(log_path, "wb") as log:
        up = child_process.popen([sys.executable, "-m", "encoder_service.cli", "up",
                                  "--config", str(work / "up.json")], cwd=ROOT, stdout=log,
                                 stderr=subprocess.STDOUT,
                                 env=dict(os.environ, EPD_WORK_DIR=str(work)))

    def ready() -> bool:
        if up.poll() is not None:
            raise RuntimeError(f"epd up exited: {log_path.read_text()[-3000:]}")
        try:
            r = httpx.get(gw + "/health", timeout=5)
            # this deployment's gateway (it names its decoders), not whatever holds the port
            return also_ready() and r.status_code == 200 and "decoders" in r.json()
        except httpx.HTTPError:
            return False

    try:
        assert wait_for(ready, timeout=timeout, interval=interval), \
            f"epd up not ready in {timeout:.0f} s (log {log_path})"
        yield up, gw, log_path
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=stop_timeout)


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
