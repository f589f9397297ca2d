"""Transport peer processes forked from a warm server instead of started as fresh interpreters.

`python -m epd_testkit.peer_process` spends about 1.2 s of CPU importing torch
before it answers; the Mooncake test modules start some 75 peers. Here each peer is a child of
multiprocessing's forkserver (one per test process) that has torch and `peer_process`
imported already: it starts in tens of milliseconds and runs the same `peer_process.main` on
its own stdin/stdout pipes, in its own session (tests signal its process group), with its
environment on top of the forkserver's. A peer ends when its stdin closes (this test process
gone), as a `PeerClient`'s does. The prefix `ip netns exec NAME` becomes the child joining
network namespace NAME (setns) before it starts; other prefixes start `PeerClient`s.

`ForkedPeers.close` kills every peer (SIGKILL) instead of asking it to quit: nothing is asserted
after a test about how its peers end, and a Transfer Engine's orderly teardown costs a second or
more per peer. A test that checks an orderly close calls `PeerClient.close` itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import threading
from multiprocessing import reduction

import pytest

from epd_testkit import peer_process
from epd_testkit.peer_process import PeerClient
from tests.helpers import LOOPBACK, WORK, Peers

_context = multiprocessing.get_context("forkserver")
# what the forkserver imports once (this module brings torch through peer_process); Mooncake
# is not among them: importing it starts threads, and the forkserver must fork without any
_context.set_forkserver_preload([peer_process.__name__, __name__])


class _Fd:
    """A file descriptor that travels to a forkserver child with its Process (as
    multiprocessing sends a Connection's)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(dup) -> int:
    return dup.detach()


_CLONE_NEWNET = 0x40000000  # <sched.h>


def _join_netns(name: str) -> None:
    """Move this process into network namespace `name` (what `ip netns exec` does for
    sockets; Python 3.11 has no os.setns)."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {name}")
    finally:
        os.close(fd)


def _serve(stdin: int, stdout: int, stderr: int, env: dict[str, str], netns: str) -> None:
    """The forkserver child: a `peer_process` on the pipes it was given."""
    os.setsid()
    if netns:
        _join_netns(netns)
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.environ.update(env)
    # multiprocessing pointed sys.stdin at /dev/null; the peer speaks JSON lines on 0 and 1
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 - the process's own
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.exit(peer_process.main())


class ForkedProc:
    """What `PeerClient` and the tests use of a `subprocess.Popen` (pid, stdin, stdout, poll,
    wait, kill, returncode), for a forkserver child."""

    def __init__(self, env: dict[str, str], stderr: int, netns: str = "") -> None:
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        self._process = _context.Process(target=_serve, daemon=True, args=(
            _Fd(in_r), _Fd(out_w), _Fd(stderr), env, netns))
        try:
            self._process.start()
        finally:  # the child has its ends now (or never will)
            os.close(in_r)
            os.close(out_w)
        self.pid = self._process.pid
        self.stdin = open(in_w, "w", buffering=1, encoding="utf-8")  # noqa: SIM115
        self.stdout = open(out_r, encoding="utf-8")  # noqa: SIM115

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked peer {self.pid}", timeout or 0.0)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


class ForkedPeer(PeerClient):
    """A `PeerClient` whose peer is a forkserver child (same calls, same answers)."""

    def __init__(self, env: dict[str, str], log_path: str, netns: str = "",
                 ready_timeout_s: float = 60.0) -> None:
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        self.proc = ForkedProc(env, self._log.fileno(), netns)  # type: ignore[assignment]
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()
        self._next(ready_timeout_s)


class ForkedPeers(Peers):
    """`tests.helpers.Peers` with forked peers, killed at the end."""

    def start(self, placement: dict, prefix: list[str] | None = None, **config) -> PeerClient:
        netns = ""
        if prefix is not None:
            if len(prefix) != 4 or prefix[:3] != ["ip", "netns", "exec"]:
                return super().start(placement, prefix, **config)
            netns = prefix[3]
        log = WORK / "test-mooncake" / f"{self.name}-{len(self.all)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        peer = ForkedPeer({"MC_TCP_BIND_ADDRESS": config.get(
            "host", LOOPBACK["MC_TCP_BIND_ADDRESS"])}, str(log), netns)
        self.all.append(peer)
        peer.info = peer.call({"op": "init", "config": config, "placement": placement})
        return peer

    def close(self, timeout_s: float = 10.0) -> None:
        for peer in self.all:
            if peer.proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(peer.proc.pid, signal.SIGKILL)  # frozen ones too
        for peer in self.all:
            with contextlib.suppress(subprocess.TimeoutExpired):
                peer.proc.wait(timeout_s)
            peer.close(timeout_s=0)


def fixture():
    """A `peers` fixture for a test module: `peers = forked_peers.fixture()`."""

    @pytest.fixture
    def peers(request):
        p = ForkedPeers(request.node.name)
        yield p
        p.close()

    return peers
