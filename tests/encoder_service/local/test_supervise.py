"""`epd up`'s supervisor (supervise.py) over real processes (`python -c`, no vLLM): an exit
is logged with its code or signal and log tail, what the dead process left in its session is
stopped, the restart waits an exponential backoff, a crash loop ends (an ERROR naming the
instance and its log, no further start), the cap counts restarts within the window only, and
restarts can be off. Health here is "the process runs" (the servers' /health is not what is
tested); the same supervisor under `epd up` with vLLM: tests/e2e/test_gateway.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from encoder_service.local.processes import ManagedProcess
from encoder_service.local.supervise import RestartPolicy, Supervisor, describe_exit
from epd_common import child_process
from tests.helpers import alive, wait_for

pytestmark = pytest.mark.skipif(not child_process.supported(), reason="Linux only")


@dataclass
class Script(ManagedProcess):
    """`python -c code`; healthy while it runs (or never, with `never_healthy`)."""

    name: str
    port: int
    work_dir: Path
    code: str = "import time; time.sleep(60)"
    never_healthy: bool = False
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    starts: int = 0

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.code]

    def start(self):
        self.starts += 1
        return super().start()

    def healthy(self) -> bool:
        return self.running and not self.never_healthy


class Run:
    """A supervisor over `procs`, its messages and hook calls, polled until `until()`."""

    def __init__(self, procs: list[Script], policy: RestartPolicy, **kw) -> None:
        self.lines: list[str] = []
        self.events: list[tuple[str, str, float]] = []

        def hook(kind: str):
            return lambda p: self.events.append((kind, p.name, time.monotonic()))

        self.procs = procs
        for p in procs:
            p.start()
        self.sup = Supervisor(procs, policy, say=self.lines.append, on_down=hook("down"),
                              on_restart=hook("restart"), on_back=hook("back"), **kw)

    def until(self, pred, timeout: float = 20.0) -> bool:
        def step() -> bool:
            self.sup.poll()
            return bool(pred())
        return wait_for(step, timeout=timeout, interval=0.01)

    def kinds(self, kind: str) -> list[float]:
        return [t for k, _, t in self.events if k == kind]

    def text(self) -> str:
        return "\n".join(self.lines)

    def close(self) -> None:
        for p in self.procs:
            p.stop(timeout_s=2)


@pytest.fixture
def runs():
    made: list[Run] = []

    def make(*a, **kw) -> Run:
        made.append(Run(*a, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


FAST = dict(backoff_s=0.1, max_backoff_s=0.4)


def test_a_crash_loop_ends_with_the_instance_and_its_log_named_and_backoff_between(
        runs, tmp_path):
    p = Script("decode-9", 1, tmp_path, code="import sys; print('boom: bad weights'); "
               "sys.exit(3)", never_healthy=True)
    run = runs([p], RestartPolicy(max_restarts=3, window_s=60, **FAST))
    assert run.until(lambda: run.sup.state("decode-9") == "down")
    assert p.starts == 4  # the first start and three restarts
    downs, restarts = run.kinds("down"), run.kinds("restart")
    assert len(downs) == 4 and len(restarts) == 3 and not run.kinds("back")
    waits = [r - d for d, r in zip(downs[:3], restarts, strict=True)]  # exit seen -> restart
    for wait, want in zip(waits, (0.1, 0.2, 0.4), strict=True):
        # at least the backoff; above it only a bound that a wrong unit (ms for s) would
        # break: a loaded fast lane (three workers on two cores) delays this thread by seconds
        assert want <= wait < want + 8.0, waits
    text = run.text()
    assert text.count("WARNING: decode-9 exited with code 3") == 4
    assert "boom: bad weights" in text
    assert "restarting decode-9 in" in text
    last = run.lines[-1]
    assert last.startswith("ERROR: decode-9 is crash-looping") and str(p.log_path) in last
    # no busy loop, no further start: it stays down
    assert not run.until(lambda: p.starts > 4, timeout=1.0)
    assert run.sup.state("decode-9") == "down" and not p.running


def test_a_killed_server_is_restarted_with_the_same_command_and_its_session_emptied(
        runs, tmp_path):
    """SIGKILL to a leader whose child (as vLLM's EngineCore) ignores SIGTERM: the
    supervisor stops the whole session, then restarts the same command."""
    mark = tmp_path / "ignoring"
    code = ("import signal, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"pathlib.Path({json.dumps(str(mark))}).touch(); time.sleep(60)']); "
            "time.sleep(60)")
    p = Script("encoder-0", 2, tmp_path, code=code)
    other = Script("decode-0", 3, tmp_path)
    run = runs([p, other], RestartPolicy(**FAST))
    assert wait_for(mark.exists, timeout=10)
    assert len(child_process.session_members(p.proc.pid)) == 2
    old, cmd = p.proc.pid, p.command()
    os.kill(old, signal.SIGKILL)
    assert run.until(lambda: run.kinds("back"), timeout=30)
    assert not child_process.session_members(old), "the dead server's child remains"
    assert p.proc.pid != old and p.running and p.command() == cmd and p.starts == 2
    assert [(k, n) for k, n, _ in run.events] == [("down", "encoder-0"),
                                                  ("restart", "encoder-0"),
                                                  ("back", "encoder-0")]
    assert "WARNING: encoder-0 killed by SIGKILL (ran" in run.text()
    assert run.sup.state("encoder-0") == "up" and other.starts == 1


def test_the_cap_counts_restarts_within_the_window_only(runs, tmp_path):
    """One restart per 0.3 s allowed; a server that runs 0.4 s each time is never a crash
    loop. With a long window the second exit ends it."""
    short = Script("a", 4, tmp_path, code="import time; time.sleep(0.4)")
    run = runs([short], RestartPolicy(max_restarts=1, window_s=0.3, **FAST))
    assert run.until(lambda: short.starts >= 3, timeout=20)
    assert run.sup.state("a") != "down" and "crash-looping" not in run.text()
    long = Script("b", 5, tmp_path, code="import time; time.sleep(0.3)")
    run = runs([long], RestartPolicy(max_restarts=1, window_s=60, **FAST))
    assert run.until(lambda: run.sup.state("b") == "down")
    assert long.starts == 2 and "b is crash-looping" in run.text()


def test_restarts_off_leave_it_down(runs, tmp_path):
    p = Script("mooncake-master", 6, tmp_path, code="import sys; sys.exit(1)")
    run = runs([p], RestartPolicy(enabled=False))
    assert run.until(lambda: run.sup.state("mooncake-master") == "down")
    assert not run.until(lambda: p.starts > 1, timeout=0.5)
    assert "restarts are off" in run.text() and len(run.kinds("down")) == 1


def test_a_restart_that_never_gets_healthy_is_stopped_and_counts(runs, tmp_path):
    p = Script("decode-1", 7, tmp_path)
    run = runs([p], RestartPolicy(max_restarts=2, window_s=60, **FAST),
               startup_timeout_s=0.5)
    p.never_healthy = True  # from its restarts on
    os.kill(p.proc.pid, signal.SIGKILL)
    assert run.until(lambda: run.sup.state("decode-1") == "down")
    assert p.starts == 3 and not p.running and not run.kinds("back")
    assert run.text().count("WARNING: decode-1 was not healthy 0.5 s after its restart") == 2


def test_exits_are_described_by_code_or_signal():
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-signal.SIGTERM) == "killed by SIGTERM"
    assert RestartPolicy().delay(0) == 1 and RestartPolicy().delay(3) == 8
    assert RestartPolicy().delay(50) == 60


def test_stop_takes_what_a_dead_leader_left_in_its_session(tmp_path):
    """`ManagedProcess.stop()` once the process itself is gone (SIGKILLed): its child, in
    its session, is stopped too (it was left running before)."""
    p = Script("x", 8, tmp_path, code="import subprocess, time; subprocess.Popen(['sleep', "
               "'60']); time.sleep(60)").start()
    try:
        assert wait_for(lambda: len(child_process.session_members(p.proc.pid)) == 2,
                        timeout=10)
        (child,) = child_process.session_members(p.proc.pid) - {p.proc.pid}
        os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.wait(5)
        assert alive(child)
        p.stop(timeout_s=5)
        assert not alive(child) and not child_process.session_members(p.proc.pid)
    finally:
        p.stop(timeout_s=1)


def test_the_up_config_takes_a_restart_table_and_the_flag_turns_restarts_off(monkeypatch,
                                                                            tmp_path):
    from encoder_service.local import up_cli
    from encoder_service.local.up_config import UpError, load_up_config

    cfg = load_up_config(None, {"restart": {"backoff_s": 2, "max_restarts": 3}})
    assert cfg.restart == RestartPolicy(backoff_s=2, max_restarts=3) and cfg.restart.enabled
    with pytest.raises(UpError, match="max_restarts"):
        load_up_config(None, {"restart": {"max_restarts": 0}})
    with pytest.raises(UpError, match="restart"):
        load_up_config(None, {"restart": {"enable": False}})
    started = []  # what `epd up` would run: the config only, nothing started here
    monkeypatch.setattr(up_cli, "run_up", lambda cfg, work, demo: started.append(cfg) or 0)
    conf = tmp_path / "up.json"
    conf.write_text('{"restart": {"backoff_s": 3}}')
    assert up_cli.main(["--config", str(conf), "--no-restart"]) == 0
    assert up_cli.main(["--config", str(conf)]) == 0
    assert [c.restart for c in started] == [RestartPolicy(enabled=False, backoff_s=3),
                                            RestartPolicy(backoff_s=3)]
