"""Fork servers: vLLM servers forked from a process that has imported vLLM already.

Most of a `vllm serve` start on CPU is Python importing vLLM, torch and transformers into the
API server (a spawned EngineCore imports its own; on one core the API server forks it,
encoder_service.local.vllm_cli). A fork server is a process that imports
them once (`preload`) and then forks each server from itself, so a start, and above all a
restart after a crash, skips that import (figures: docs/benchmarks.md, "Test suite times").
`VllmServer` forks from one (`fork_server=True`, its default) once its `prepare()` made one
ready (`start_all`, hence `epd up`); `start()` never waits for one's imports: without a ready
one it is a plain start. The server's command line (/proc/PID/cmdline), environment,
working directory, log and exit code are what a plain start would give it:

- One fork server per core and environment (`fork_server_for`): it is started pinned
  (taskset) to its servers' core, with their environment, so what vLLM's modules read while
  they import (thread pools sized to the core, variables read at import) is what a plain
  start reads. Only `PER_START_VARIABLES` may differ between a server and its fork server.
- A forked server leads its own session, gets SIGTERM when its fork server dies (and its
  group guard, `$EPD_PARENT_PID`, watches the fork server), and runs its module as
  `python -m` would (`runpy`), so a spawned EngineCore re-imports the same main module; the
  fork server lets setproctitle find its argument room first, so vLLM's process titles
  (`VLLM::EngineCore`) still work in what the server forks.
- The fork server reaps its children and reports each exit code; `ForkedProcess` gives them
  the `subprocess.Popen` calls the local stack uses (`pid`, `poll`, `wait`, `returncode`,
  `send_signal`). The fork server dies with the thread that keeps it (a daemon thread of the
  process that asked for it, so: with that process), taking its servers along.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from epd_common import child_process

# Variables a forked server may hold differently from its fork server: each is read once the
# server runs, never while vLLM's, torch's or the project's modules import (checked against
# vLLM 0.32: TMPDIR through tempfile, reset in the child; the others read by the project or
# by vLLM's NIXL connector and OpenTelemetry when they start).
PER_START_VARIABLES = frozenset({
    "TMPDIR", child_process.PARENT_PID_ENV, "EPD_START_LEDGER",
    "VLLM_NIXL_SIDE_CHANNEL_PORT", "OTEL_SERVICE_NAME",
})
READY_TIMEOUT_S = 300.0  # a fork server's imports, on a loaded machine
# Room for its children's command lines: a fork server starts with this many bytes of blank
# argument, which each child overwrites with its own command line (`_retitle`)
ARGV_ROOM = 8192


class ForkServerError(RuntimeError):
    pass


class ForkedProcess:
    """A process a fork server forked: the `subprocess.Popen` calls the local stack uses.

    Its exit code comes from the fork server (its parent, which reaps it); should the fork
    server be gone first, the process is taken as ended once its pid is gone, with exit
    code `LOST` (its real code went with its parent)."""

    LOST = -int(signal.SIGKILL)

    def __init__(self, pid: int, args: list[str], server: ForkServer) -> None:
        self.pid, self.args, self._server = pid, args, server
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _set_exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        if self.returncode is None and not self._server.alive and not _exists(self.pid):
            self._set_exit(self.LOST)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._ended.wait(0.1 if left is None else min(0.1, left))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


class ForkServer:
    """One fork server process and the connection to it (the asking side).

    `preload` is "module:function", run once in the fork server before any fork; `env` its
    environment (a server's, `PER_START_VARIABLES` aside); `pin` the command that pins it and
    so its servers to their core (`taskset -c N`; empty: unpinned); its log is `log_path`.
    `launch()` starts it and returns at once: its imports run beside whatever the caller
    starts next; `ready` says whether they are done, `wait_ready()` waits for them."""

    def __init__(self, preload: str, env: dict[str, str], pin: list[str],
                 log_path: Path) -> None:
        self.preload, self.env, self.pin, self.log_path = preload, env, pin, log_path
        ours, self._theirs = socket.socketpair()
        self._sock = ours
        self._lock = threading.Lock()  # one request at a time on the connection
        self._news = threading.Condition()
        self._replies: list[dict] = []
        self._children: dict[int, ForkedProcess] = {}
        self._ready = threading.Event()
        self._proc: subprocess.Popen | None = None
        self._ended = threading.Event()

    @property
    def alive(self) -> bool:
        return not self._ended.is_set()

    @property
    def ready(self) -> bool:
        """Whether it has done its imports and runs: a fork now takes milliseconds."""
        return self._ready.is_set() and self.alive

    @property
    def failed(self) -> bool:
        """Whether it ended before it was ready (its log says why): it is not tried again."""
        return self._ended.is_set() and not self._ready.is_set()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` for `ready`; False when it failed or is still importing."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.is_set() and self.alive and time.monotonic() < deadline:
            self._ready.wait(min(0.2, max(0.0, deadline - time.monotonic())))
        return self.ready

    def launch(self) -> ForkServer:
        """Start the fork server process; its imports go on in the background."""
        # the thread that starts it keeps it: the fork server dies with that thread
        started = threading.Event()
        threading.Thread(target=self._keep, args=(started,), daemon=True,
                         name="epd-forkserver").start()
        started.wait()
        return self

    def _keep(self, started: threading.Event) -> None:
        """Start the fork server, then read what it reports until it is gone."""
        theirs = self._theirs
        cmd = [*self.pin, sys.executable, "-m", __name__, "--preload", self.preload,
               "--fd", str(theirs.fileno()), "--room", " " * ARGV_ROOM]
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as log:
                self._proc = child_process.popen(cmd, env=self.env, stdout=log,
                                                 stderr=subprocess.STDOUT,
                                                 pass_fds=(theirs.fileno(),),
                                                 start_new_session=True)
        except OSError as exc:
            self._finish({"error": f"cannot start a fork server: {exc}"})
            return
        finally:
            theirs.close()
            started.set()
        with contextlib.suppress(OSError), self._sock.makefile("rb") as lines:
            for line in lines:
                self._read(json.loads(line))
        self._proc.wait()
        self._finish({"error": f"the fork server exited with code {self._proc.returncode}; "
                               f"log {self.log_path}"})

    def _read(self, message: dict) -> None:
        """Take one report of the fork server: ready, a child's exit, a reply to a request."""
        if "ready" in message:
            self._ready.set()
            return
        if "exit" in message:
            child = self._children.pop(message["exit"], None)
            if child is not None:
                child._set_exit(message["code"])
            return
        if "pid" in message:  # registered here, before its exit can be read
            child = ForkedProcess(message["pid"], message["args"], self)
            self._children[child.pid] = child
            message["child"] = child
        with self._news:
            self._replies.append(message)
            self._news.notify_all()

    def _finish(self, message: dict) -> None:
        with self._news:
            self._replies.append(message)
            self._ended.set()
            self._news.notify_all()
        for child in list(self._children.values()):
            child.poll()

    def _reply(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        with self._news:
            while not self._replies:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ForkServerError(f"no answer from the fork server in {timeout_s:.0f} "
                                          f"s; log {self.log_path}")
                self._news.wait(left)
            if self._ended.is_set() and "error" in self._replies[0]:
                return self._replies[0]  # kept: every later call gets it too
            return self._replies.pop(0)

    def fork(self, module: str, argv: list[str], env: dict[str, str], log_path: Path,
             timeout_s: float = READY_TIMEOUT_S) -> ForkedProcess:
        """Fork `python -m module *argv` with `env`, its output appended to `log_path`.

        Waits for the fork server's imports first (at most `timeout_s`)."""
        if not self.wait_ready(timeout_s):
            state = ("is not ready" if self.alive else "exited with code "
                     f"{None if self._proc is None else self._proc.returncode}")
            raise ForkServerError(f"the fork server {state}; log {self.log_path}")
        with self._lock:
            args = [sys.executable, "-m", module, *argv]
            _send(self._sock, {"module": module, "argv": argv, "env": env, "args": args,
                               "cwd": os.getcwd(), "log": str(log_path)})
            reply = self._reply(timeout_s)
            if "child" not in reply:
                raise ForkServerError(f"the fork server could not fork: "
                                      f"{reply.get('error', reply)}")
            return reply["child"]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the fork server (its servers get SIGTERM from the kernel as it exits)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        if self._proc is not None:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                child_process.stop_session(self._proc, 1.0)
        self._ended.wait(timeout_s)


_SERVERS: dict[tuple, ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


def fork_server_for(preload: str, env: dict[str, str], pin: list[str], log_dir: Path,
                    launch: bool = True) -> ForkServer | None:
    """This process's fork server for `preload`, pinned by `pin`, with `env`; launched if need be.

    One per (preload, pin, environment without `PER_START_VARIABLES`); one that died after
    it was ready is replaced, one that never got ready is not (its `failed` says so). Its
    TMPDIR is a directory of its own beside `log_dir`; its log is in it. With `launch`
    false, only one that runs already (None if none)."""
    base = {k: v for k, v in env.items() if k not in PER_START_VARIABLES}
    key = (preload, tuple(pin), frozenset(base.items()))
    with _SERVERS_LOCK:
        server = _SERVERS.get(key)
        if not launch:
            return server if server is not None and server.alive else None
        if server is None or not (server.alive or server.failed):
            name = f"forkserver-{os.getpid()}-{len(_SERVERS)}"
            tmp = log_dir.parent / "tmp" / name
            tmp.mkdir(parents=True, exist_ok=True)
            server = ForkServer(preload, {**base, "TMPDIR": str(tmp)}, pin,
                                log_dir / f"{name}.log").launch()
            _SERVERS[key] = server
    return server


@atexit.register
def close_all() -> None:
    """Stop every fork server this process started."""
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values())
        _SERVERS.clear()
    for server in servers:
        server.close()


# -- the fork server process ---------------------------------------------------------------
def _serve(sock: socket.socket) -> None:
    """Fork what `sock` asks for, report each child's exit, until `sock` closes."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    me = os.getpid()
    buf = b""
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _report_exits(sock)
        if sock not in ready:
            continue
        data = sock.recv(65536)
        if not data:
            return
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            try:
                request = json.loads(line)
                pid = os.fork()
            except (ValueError, OSError) as exc:
                _send(sock, {"error": f"{type(exc).__name__}: {exc}"})
                continue
            if pid == 0:
                _child(request, me, [sock.fileno(), wake_r, wake_w])  # never returns
            _send(sock, {"pid": pid, "args": request["args"]})


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _child(request: dict, server_pid: int, fds: list[int]) -> None:
    """In a forked child: become `python -m module argv...` with its environment and log."""
    code = 1
    try:
        os.setsid()
        child_process.die_with_parent_of(server_pid, signal.SIGTERM)()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.chdir(request["cwd"])
        env = dict(request["env"])
        if child_process.PARENT_PID_ENV in env:  # its parent is this fork server
            env[child_process.PARENT_PID_ENV] = str(server_pid)
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # TMPDIR is the server's now
        _retitle(request["args"])
        sys.argv = [request["module"], *request["argv"]]
        # run afresh as __main__, as `python -m` does, though a preload imported it
        sys.modules.pop(request["module"], None)
        import runpy

        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child's own failure, as python would print it
        traceback.print_exc()
    raise SystemExit(code)  # the interpreter's own exit: atexit handlers, stream flushes


def _retitle(args: list[str]) -> None:
    """Make this process's /proc/PID/cmdline read `args`, NUL-separated, as after an exec.

    So that `ps`, an operator and the tools that find a server by its command line
    (`--port N`) see the plain start's command line, not its fork server's. Written over
    this process's own argument area (the fork server's `--room` made it large enough; a
    longer command line is cut short), with NULs after it."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # proc(5): arg_start, arg_end
    except (OSError, IndexError, ValueError):
        return
    room = end - start
    data = b"\0".join(os.fsencode(a) for a in args)[:room - 1]
    ctypes.memmove(start, data.ljust(room, b"\0"), room)


def _find_title_room() -> None:
    """Let setproctitle find this process's argument area while it still holds its argv.

    setproctitle (vLLM's process titles: `VLLM::EngineCore`) finds the area on its first
    call by matching argv's strings; after `_retitle` rewrote them in a child it finds none
    and titles nothing. Found here, its children inherit it."""
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.getproctitle()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preload", required=True, help="module:function to run once")
    parser.add_argument("--fd", type=int, required=True, help="the connection's descriptor")
    parser.add_argument("--room", default="", help="blank room for the children's command "
                        "lines")
    args = parser.parse_args()
    sock = socket.socket(fileno=args.fd)
    module, _, function = args.preload.partition(":")
    loaded = importlib.import_module(module)
    if function:
        getattr(loaded, function)()
    _find_title_room()
    _send(sock, {"ready": os.getpid()})
    _serve(sock)


if __name__ == "__main__":
    main()
