"""Fork servers fork a program as `python -m` would start it: its arguments, environment,
log, session and exit code, the preload done once in the fork server (no vLLM here: a small
program; `vllm serve` through one is what every e2e test's servers are)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from encoder_service.local import forkserver, processes
from encoder_service.local.forkserver import ForkServer, ForkServerError, fork_server_for
from epd_common import child_process
from tests.helpers import alive, wait_for

PROGRAM = "tests.encoder_service.local.forked_program"
PRELOAD = PROGRAM + ":preload"
pytestmark = pytest.mark.skipif(not child_process.supported(),
                                reason="parent-death signals are Linux-only")


@pytest.fixture(autouse=True)
def _no_fork_server_left():
    """Every fork server `fork_server_for` made in a test is stopped after it."""
    yield
    forkserver.close_all()


@pytest.fixture
def server(tmp_path):
    s = ForkServer(PRELOAD, dict(os.environ), [], tmp_path / "forkserver.log").launch()
    yield s
    s.close()


def _said(log, text: str) -> bool:
    return log.exists() and text in log.read_text()


def _env(tmp_path, **more) -> dict[str, str]:
    (tmp_path / "t").mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp_path / "t"), **more}


def test_a_forked_program_gets_its_arguments_environment_log_and_exit_code(server, tmp_path):
    log = tmp_path / "child.log"
    env = _env(tmp_path, EPD_TEST_X="y", **{child_process.PARENT_PID_ENV: "1"})
    child = server.fork(PROGRAM, ["report", "3"], env, log)
    assert child.wait(30) == 3 and child.poll() == 3
    seen = json.loads(log.read_text().splitlines()[-1])
    assert seen["argv"] == ["report", "3"] and seen["cwd"] == os.getcwd()
    assert seen["tmp"] == str(tmp_path / "t") and seen["x"] == "y"
    assert seen["leads_session"]
    # its command line reads as a plain start's (ps, and tools that find a server by it)
    running = server.fork(PROGRAM, ["sleep", "--port", "18999"], env, log)
    assert wait_for(lambda: _said(log, "sleeping"), timeout=30)
    with open(f"/proc/{running.pid}/cmdline", "rb") as f:
        assert f.read().rstrip(b"\0").split(b"\0") == [
            os.fsencode(a) for a in (sys.executable, "-m", PROGRAM, "sleep", "--port", "18999")]
    running.kill()
    # its parent is the fork server, which ran the preload; the group guard watches it
    assert seen["preloaded"] == seen["ppid"] == int(seen["parent_env"]) != os.getpid()
    again = server.fork(PROGRAM, ["report", "0"], env, log)  # the same fork server again
    assert again.wait(30) == 0 and again.pid != child.pid


def test_a_forked_program_can_retitle_itself_as_vllms_processes_do(server, tmp_path):
    """setproctitle (vLLM's `VLLM::EngineCore`) works in a forked program whose command line
    the fork server rewrote: it found its room in the fork server, before the rewrite."""
    log = tmp_path / "child.log"
    child = server.fork(PROGRAM, ["title", "VLLM::EngineCore"], _env(tmp_path), log)
    assert child.wait(30) == 0
    seen = json.loads(log.read_text().splitlines()[-1])
    assert seen["cmdline"].rstrip("\0") == "VLLM::EngineCore"


def test_a_forked_program_is_stopped_and_killed_like_a_child(server, tmp_path):
    log = tmp_path / "child.log"
    child = server.fork(PROGRAM, ["sleep"], _env(tmp_path), log)
    assert wait_for(lambda: _said(log, "sleeping"), timeout=30)
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    child_process.stop_session(child, timeout_s=10)  # as ManagedProcess.stop does
    assert child.returncode == -signal.SIGTERM and not alive(child.pid)
    killed = server.fork(PROGRAM, ["sleep"], _env(tmp_path), log)
    killed.kill()
    assert killed.wait(30) == -signal.SIGKILL


def test_a_closed_fork_server_takes_its_programs_along(tmp_path):
    s = ForkServer(PRELOAD, dict(os.environ), [], tmp_path / "forkserver.log").launch()
    log = tmp_path / "child.log"
    child = s.fork(PROGRAM, ["sleep"], _env(tmp_path), log)
    assert wait_for(lambda: _said(log, "sleeping"), timeout=30)
    s.close()
    assert not s.alive
    assert child.wait(30) is not None and not alive(child.pid)
    with pytest.raises(ForkServerError, match="gone|exited"):
        s.fork(PROGRAM, ["report", "0"], _env(tmp_path), log)


def test_a_sigkilled_fork_server_takes_its_programs_along(tmp_path):
    """Its children get SIGTERM from the kernel; their exit codes went with it (LOST)."""
    s = ForkServer(PRELOAD, dict(os.environ), [], tmp_path / "forkserver.log").launch()
    log = tmp_path / "child.log"
    child = s.fork(PROGRAM, ["sleep"], _env(tmp_path), log)
    assert wait_for(lambda: _said(log, "sleeping"), timeout=30)
    assert s._proc is not None
    os.kill(s._proc.pid, signal.SIGKILL)
    assert child.wait(30) in (forkserver.ForkedProcess.LOST, -signal.SIGTERM)
    assert not alive(child.pid) and not s.alive and not s.ready
    s.close()


def test_a_fork_server_whose_preload_fails_says_so(tmp_path):
    s = ForkServer("no_such_module_here:x", dict(os.environ), [],
                   tmp_path / "forkserver.log").launch()
    try:
        with pytest.raises(ForkServerError, match="exited with code 1"):
            s.fork(PROGRAM, ["report", "0"], _env(tmp_path), tmp_path / "child.log")
        assert "No module named 'no_such_module_here'" in (tmp_path / "forkserver.log") \
            .read_text()
    finally:
        s.close()


def test_one_fork_server_per_core_and_environment(tmp_path):
    """Servers that differ only in variables read once they run share one; any other
    difference (a variable read while modules import) gets its own."""
    a = fork_server_for(PRELOAD, _env(tmp_path, TMPDIR="/a"), [], tmp_path / "logs")
    b = fork_server_for(PRELOAD, _env(tmp_path, TMPDIR="/b", OTEL_SERVICE_NAME="b"),
                        [], tmp_path / "logs")
    c = fork_server_for(PRELOAD, _env(tmp_path, EPD_TEST_X="z"), [], tmp_path / "logs")
    assert a is b and a is not c
    child = c.fork(PROGRAM, ["report", "0"], _env(tmp_path, EPD_TEST_X="z"),
                   tmp_path / "child.log")
    assert child.wait(30) == 0
    assert json.loads((tmp_path / "child.log").read_text().splitlines()[-1])["x"] == "z"


def test_a_vllm_server_forks_once_prepared_and_its_start_never_waits(tmp_path, monkeypatch):
    """`VllmServer.start()` forks only from a fork server `prepare()` made ready, with the
    plain start's command line; before, and without one, it starts a new interpreter at once
    (the program stands in for vLLM's CLI and its preload)."""
    monkeypatch.setattr(processes, "VLLM_CLI", PROGRAM)
    monkeypatch.setattr(processes, "VLLM_PRELOAD", PRELOAD)
    monkeypatch.delenv(processes.LEDGER_ENV, raising=False)  # no vLLM server starts here
    server = processes.VllmServer("s", tmp_path / "model", 18997, tmp_path)
    try:
        assert not server.preparing
        server.start()  # no fork server yet: a plain start, none launched by it
        assert isinstance(server.proc, subprocess.Popen) and not server.preparing
        assert wait_for(lambda: _said(server.log_path, "sleeping"), timeout=30)
        server.stop()
        server.prepare(wait_s=30)
        assert not server.preparing
        server.start()
        assert isinstance(server.proc, forkserver.ForkedProcess)
        assert wait_for(lambda: _said(server.log_path, "sleeping"), timeout=30)
        with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
            assert f.read().rstrip(b"\0").split(b"\0") == [
                os.fsencode(a) for a in server.command()]
        server.stop()
        assert server.proc.returncode == -signal.SIGTERM
    finally:
        server.stop()
