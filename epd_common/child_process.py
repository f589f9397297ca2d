"""Child processes that die with their parent, even when the parent is SIGKILLed (torch-free).

Everything the project or its tests start as a long-lived child (vLLM servers, encoder pools,
the Mooncake Store master, transport peers, `epd up` under test) goes through `popen()` or
passes `preexec_fn=die_with_parent()` to `subprocess`: the child asks the kernel for a
parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGTERM)`, Linux; a no-op elsewhere) before it
execs its program, so a parent killed by SIGKILL, which can clean up nothing, still takes its
children along.

Caveats:
- The kernel sends the signal when the *thread* that forked the child exits, not the process.
  Spawn only from threads that live as long as the children should (the project does: `epd up`
  and `start_all` spawn from the main thread, pytest fixtures run in the main thread); a child
  started from a short-lived worker thread would be SIGTERMed when that thread ends.
- Only the direct child gets the signal (the setting is cleared in the children of a fork).
  A child with children of its own must take them along itself. A `vllm serve` does so once it
  serves (SIGTERM: its API server stops EngineCore and the workers), but a SIGTERM
  that arrives while it is still starting up is lost (the API server, EngineCore and worker
  all stay; checked with vLLM 0.32 on CPU). So the vLLM entry point (`encoder_service.local.
  vllm_cli`) also runs `guard_process_group_from_env()`: when the parent named in
  `$EPD_PARENT_PID` is gone and the process still runs after a grace period, it SIGTERMs, then
  SIGKILLs, its whole process group (the managed processes lead their own sessions).
- The setting does not survive exec of a set-user-ID or file-capability program; the commands
  started here are plain programs (python, taskset, mooncake_master, `ip netns exec` as root).
- vLLM's own children (EngineCore, workers: multiprocessing, from vLLM's main thread) ask for
  it themselves once started (`die_with_parent_process`, run by ec_connectors.plugin, in a
  spawned child by vLLM's plugin loading and in a forked one by multiprocessing's after-fork
  hook, `in_forked_children`), so an API server killed by SIGKILL takes them along.
- Stopping: `stop_session` signals a child's whole session (it leads one), also once the child
  itself is gone and what it started is not.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

PARENT_PID_ENV = "EPD_PARENT_PID"  # guard_process_group_from_env(): whose death to watch
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl() -> Callable[..., int] | None:
    """Find libc's prctl, once, in the parent.

    libc's prctl, looked up once in the parent (a child between fork and exec must not
    load libraries)."""
    if not sys.platform.startswith("linux"):
        return None
    try:  # the running program's own symbols hold libc's prctl: no ldconfig subprocess
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # (as find_library would start)
    except (OSError, AttributeError):
        try:
            prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6",
                                use_errno=True).prctl
        except (OSError, AttributeError):
            return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_prctl = _load_prctl()


def supported() -> bool:
    """Whether children here can get a parent-death signal (Linux with a usable libc)."""
    return _prctl is not None


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """Make a child process get `sig` when the thread that started it ends.

    A `preexec_fn` for `subprocess`: the child gets `sig` when this thread ends (see the
    module docstring). Call it in the parent: `Popen(cmd, preexec_fn=die_with_parent())`.
    Should the parent die between the fork and the prctl, the child signals itself."""
    return die_with_parent_of(os.getpid(), sig)


def die_with_parent_of(parent: int, sig: int = signal.SIGTERM) -> Callable[[], None]:
    """What a child forked by `parent` runs to get `sig` when the forking thread ends.

    As `die_with_parent`, for a fork the caller makes itself (`parent`: the forking process,
    named before the fork)."""
    prctl = _prctl

    def preexec() -> None:
        if prctl is None:
            return
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # the parent is already gone: nobody would signal us
            os.kill(os.getpid(), sig)

    return preexec


def popen(cmd: list[str], *, death_signal: int = signal.SIGTERM,
          preexec_fn: Callable[[], None] | None = None, **kwargs: Any) -> subprocess.Popen:
    """Start a child process that dies with this thread.

    `subprocess.Popen(cmd, **kwargs)` whose child dies with this thread (`die_with_parent`);
    a caller's own `preexec_fn` runs after it."""
    die = die_with_parent(death_signal)

    def preexec() -> None:
        die()
        if preexec_fn is not None:
            preexec_fn()

    return subprocess.Popen(cmd, preexec_fn=preexec, **kwargs)


def guard_process_group(parent_pid: int, grace_s: float = 5.0, kill_after_s: float = 3.0,
                        interval_s: float = 0.25) -> threading.Thread | None:
    """Watch for the parent's death and stop this process group after it.

    In a child that leads its own process group and has children of its own: a daemon
    thread that waits for `parent_pid` to stop being this process's parent, then gives the
    process `grace_s` to exit by itself (its parent-death signal has reached it), then sends
    SIGTERM to the rest of the group and SIGKILL to the whole group once the rest is gone or
    `kill_after_s` later. Nothing happens (None) off Linux, or when this process does not
    lead its group (the group would be someone else's)."""
    if not sys.platform.startswith("linux") or os.getpgrp() != os.getpid():
        return None

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        time.sleep(grace_s)  # still here: the parent-death signal did not end this process
        me = os.getpid()
        for pid in _group_members(me):  # not this process: its SIGTERM handling may exit it
            with contextlib.suppress(OSError):  # before the SIGKILL below
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + kill_after_s
        while time.monotonic() < deadline and _group_members(me):
            time.sleep(0.1)
        os.killpg(me, signal.SIGKILL)

    thread = threading.Thread(target=watch, name="epd-parent-watch", daemon=True)
    thread.start()
    return thread


def _members(field: int, value: int) -> set[int]:
    """List the live processes whose /proc stat field has a given value.

    Live (not zombie) processes whose /proc stat field `field` (counted after the
    command name: 2 = process group, 3 = session) is `value`."""
    out = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > field and fields[0] != b"Z" and int(fields[field]) == value:
            out.add(int(entry.name))
    return out


def _group_members(pgid: int) -> set[int]:
    """Live (not zombie) processes of process group `pgid`, from /proc, except this one."""
    return _members(2, pgid) - {os.getpid()}


def session_members(sid: int) -> set[int]:
    """List the live processes of a session.

    Live (not zombie) processes of session `sid` (a child started with
    `start_new_session=True` leads the session numbered by its pid), from /proc. Empty off
    Linux. The session outlives its leader: an API server SIGKILLed leaves its engine there."""
    if not sys.platform.startswith("linux"):
        return set()
    return _members(3, sid)


def signal_session(sid: int, sig: int) -> None:
    """Send a signal to every process of a session.

    `sig` to session `sid`'s process group and to every other process of the session (those
    in groups of their own), whether or not its leader still runs; each gets it once (a
    second signal would reach a handler already running for the first)."""
    with contextlib.suppress(OSError):
        os.killpg(sid, sig)
    for pid in session_members(sid):
        with contextlib.suppress(OSError):
            if os.getpgid(pid) != sid:
                os.kill(pid, sig)


def stop_session(proc: subprocess.Popen, timeout_s: float = 20.0,
                 kill_after_s: float = 10.0) -> None:
    """Stop a process and everything in its session, then reap it.

    Stop `proc` (started with `start_new_session=True`) and everything in its session:
    SIGTERM, then SIGKILL to what remains after `timeout_s`; returns once none remains (or
    `kill_after_s` after the SIGKILL) with `proc` reaped. Also when `proc` is already gone
    and its children are not (they lost the signal their parent would have sent)."""
    sid = proc.pid

    def gone(deadline: float) -> bool:
        while time.monotonic() < deadline:
            if proc.poll() is not None and not session_members(sid):
                return True
            time.sleep(0.05)
        return proc.poll() is not None and not session_members(sid)

    if proc.poll() is not None and not session_members(sid):
        return
    signal_session(sid, signal.SIGTERM)
    if gone(time.monotonic() + timeout_s):
        return
    signal_session(sid, signal.SIGKILL)
    gone(time.monotonic() + kill_after_s)


def die_with_parent_process(sig: int = signal.SIGKILL,
                            names: tuple[str, ...] = ()) -> bool:
    """Ask, in a multiprocessing child, for a signal when its parent dies.

    In a `multiprocessing` child (`names`: only in one whose process name starts with one
    of them): ask for `sig` when the parent dies, for a child that the parent would have
    stopped, as vLLM's API server stops its EngineCore and EngineCore its workers, but that
    outlives a parent killed by SIGKILL. Set in the child itself, after the fact: should the
    parent already be gone, the signal comes at once. Call it only in children started from a
    thread that lives as long as the parent (vLLM starts them from its main thread). True when
    set."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if _prctl is None or parent is None:
        return False
    if names and not multiprocessing.current_process().name.startswith(names):
        return False
    _prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    if os.getppid() != parent.pid:  # the parent is already gone: nobody would signal us
        os.kill(os.getpid(), sig)
    return True


class _Hooks:
    """What multiprocessing's after-fork registry holds (weakly) for `in_forked_children`."""


_HOOKS = _Hooks()
_FORK_ACTIONS: list[Callable[[], object]] = []


def in_forked_children(action: Callable[[], object]) -> None:
    """Run `action` in every multiprocessing child this process forks from now on.

    It runs in the child before the child's target, once multiprocessing has set the
    child's name and parent (its after-fork hooks). A forked child inherits the
    registration, so its own forked children run it too; a spawned child starts afresh and
    registers nothing. An action already registered (the same object) is not added again."""
    import multiprocessing.util

    if action in _FORK_ACTIONS:
        return
    if not _FORK_ACTIONS:
        multiprocessing.util.register_after_fork(
            _HOOKS, lambda _hooks: [act() for act in _FORK_ACTIONS])
    _FORK_ACTIONS.append(action)


def guard_process_group_from_env(grace_s: float = 5.0) -> threading.Thread | None:
    """Guard this process group against the death of the parent named in the environment.

    `guard_process_group($EPD_PARENT_PID)` when the variable is set (it is removed, so
    this process's own children do not watch a grandparent)."""
    value = os.environ.pop(PARENT_PID_ENV, "")
    if not value.isdigit():
        return None
    return guard_process_group(int(value), grace_s)
