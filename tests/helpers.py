"""Small helpers shared by the tests."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Iterator

from ec_connectors.transports.peer_process import PeerClient

from .conftest import WORK

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

    def close(self) -> None:
        for peer in self.all:
            if peer.proc.poll() is None:
                os.killpg(peer.proc.pid, signal.SIGCONT)
            peer.close()
