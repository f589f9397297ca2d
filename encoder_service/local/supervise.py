"""Restart what `epd up` started when it exits unasked.

`epd up` supervises what it starts: a server (vLLM encoder or prefill/decode instance, `epd
encoder` pool) or the Mooncake Store master that exits without being asked is restarted, on
the same port with the same command line (`ManagedProcess.start()` again).

`RestartPolicy` (the up config's `restart` table; `epd up --no-restart` sets enabled = false):
- every exit is logged: the exit code or the signal, how long it ran, its log's last lines;
  what the dead process left in its session is stopped (vLLM's EngineCore goes with its API
  server anyway: ec_connectors.plugin);
- backoff: a restart waits `backoff_s` * 2^k, k = the instance's restarts within the last
  `window_s` (1, 2, 4, ... s by default), at most `max_backoff_s`;
- cap: after `max_restarts` restarts within `window_s`, the next exit ends the instance's
  supervision: an ERROR names it and its log, it stays down (the gateway routes around it),
  the rest of the deployment goes on serving. Never a busy loop;
- a restarted server that is not healthy within `startup_timeout_s` is stopped and counts as
  an exit.
The gateway (it runs in the `epd up` process) is told: an instance that exits gets nothing new
at once, a restarted one gets work again once /health and a real forward probe pass
(gateway/outages.py); `epd_restarts_total{instance}` on its /metrics counts the restarts.

`Supervisor.poll()` runs on the main thread (run_up's loop): the restarted servers' parent-
death signal follows the thread that lives as long as `epd up`.
"""

from __future__ import annotations

import signal
import textwrap
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from encoder_service.local.processes import ManagedProcess, ServerFailed


class RestartPolicy(BaseModel):
    """When `epd up` restarts a server that exited unasked (supervise.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="restart what exits unasked (`epd up "
                          "--no-restart`: false)")
    backoff_s: float = Field(1.0, gt=0, description="wait before a first restart; doubled "
                             "for every restart of the instance within window_s")
    max_backoff_s: float = Field(60.0, gt=0)
    max_restarts: int = Field(5, ge=1, description="restarts of one instance within window_s;"
                              " one more exit and it is left down (crash loop)")
    window_s: float = Field(600.0, gt=0)

    def delay(self, earlier: int) -> float:
        """The wait before a restart that follows `earlier` restarts within the window."""
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** min(earlier, 60))


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass
class Watch:
    """One supervised process and its restart state.

    One supervised process. state: up, waiting (to be restarted at `due`), starting
    (restarted; healthy by `due` or stopped), down (left down: crash loop or restarts off)."""

    proc: ManagedProcess
    since: float  # when it (re)started
    state: str = "up"
    due: float = 0.0
    restarts: deque[float] = field(default_factory=deque)  # restart times within the window
    exits: int = 0


Hook = Callable[[ManagedProcess], None]


def _nothing(proc: ManagedProcess) -> None:
    pass


class Supervisor:
    """Restart processes that exit unasked, with hooks for the gateway.

    Call `poll()` every half second or so (from the thread the processes should die
    with). Hooks: `on_down(p)` when p exited, `on_restart(p)` when it was started again,
    `on_back(p)` when it answers /health again. `meanwhile`: what a process's absence means,
    by name (default: the gateway routes around it)."""

    def __init__(self, procs: Sequence[ManagedProcess], policy: RestartPolicy, *,
                 startup_timeout_s: float = 420.0, say: Callable[[str], None] = print,
                 on_down: Hook = _nothing, on_restart: Hook = _nothing,
                 on_back: Hook = _nothing, clock: Callable[[], float] = time.monotonic,
                 log_lines: int = 15, meanwhile: dict[str, str] | None = None) -> None:
        self.policy, self.startup_timeout_s, self.say = policy, startup_timeout_s, say
        self.on_down, self.on_restart, self.on_back = on_down, on_restart, on_back
        self.clock, self.log_lines = clock, log_lines
        self.meanwhile = meanwhile or {}
        now = clock()
        self.watches = {p.name: Watch(p, since=now) for p in procs}

    def state(self, name: str) -> str:
        return self.watches[name].state

    def watch(self, proc: ManagedProcess) -> None:
        """Supervise one more (started) process: an instance an elastic role added."""
        self.watches[proc.name] = Watch(proc, since=self.clock())

    def unwatch(self, name: str) -> None:
        """Stop supervising `name` (it is about to be drained and stopped on purpose)."""
        self.watches.pop(name, None)

    def poll(self) -> None:
        now = self.clock()
        for w in self.watches.values():
            if w.state == "up" and not w.proc.running:
                self._exited(w, now, describe_exit(self._returncode(w)))
            elif w.state == "waiting" and now >= w.due:
                self._restart(w, now)
            elif w.state == "starting":
                self._starting(w, now)

    @staticmethod
    def _returncode(w: Watch) -> int | None:
        return None if w.proc.proc is None else w.proc.proc.returncode

    def _exited(self, w: Watch, now: float, how: str) -> None:
        p, policy = w.proc, self.policy
        meanwhile = self.meanwhile.get(p.name, "the gateway routes around it")
        w.exits += 1
        p.stop(timeout_s=2.0)  # what it left in its session (orphans by now); reaps it
        tail = textwrap.indent(p.log_tail(self.log_lines), "    | ")
        self.say(f"WARNING: {p.name} {how} (ran {now - w.since:.0f} s; log {p.log_path}); "
                 f"its last log lines:\n{tail}")
        self.on_down(p)
        if not policy.enabled:
            w.state = "down"
            self.say(f"{p.name} stays down: restarts are off (restart.enabled = false, "
                     f"--no-restart); {meanwhile}")
            return
        while w.restarts and w.restarts[0] <= now - policy.window_s:
            w.restarts.popleft()
        if len(w.restarts) >= policy.max_restarts:
            w.state = "down"
            self.say(f"ERROR: {p.name} is crash-looping ({how} after {len(w.restarts)} "
                     f"restarts within {policy.window_s:.0f} s, restart.max_restarts); "
                     f"it is not restarted again and stays down ({meanwhile}); see its log "
                     f"{p.log_path}")
            return
        delay = policy.delay(len(w.restarts))
        w.state, w.due = "waiting", now + delay
        self.say(f"restarting {p.name} in {delay:.0f} s (restart {len(w.restarts) + 1} of at "
                 f"most {policy.max_restarts} within {policy.window_s:.0f} s)")

    def _restart(self, w: Watch, now: float) -> None:
        p = w.proc
        w.restarts.append(now)
        w.since = now
        try:
            p.start()
        except (ServerFailed, OSError) as exc:
            self._exited(w, now, f"could not start ({exc})")
            return
        w.state, w.due = "starting", now + self.startup_timeout_s
        self.on_restart(p)
        self.say(f"restarted {p.name} on :{p.port} (log {p.log_path})")

    def _starting(self, w: Watch, now: float) -> None:
        p = w.proc
        if not p.running:
            self._exited(w, now, describe_exit(self._returncode(w)) + " while restarting")
        elif p.healthy():
            w.state = "up"
            self.say(f"{p.name} healthy again {now - w.since:.0f} s after its "
                     "restart")
            self.on_back(p)
        elif now >= w.due:
            self._exited(w, now, f"was not healthy {self.startup_timeout_s:g} s after its "
                         "restart")


def supervise(dep: Any, policy: RestartPolicy, startup_timeout_s: float,
              say: Callable[[str], None]) -> Supervisor:
    """Supervise a started deployment, wired to its gateway.

    The supervisor of a started deployment (up.py's `Deployment`): its master (if any)
    and servers, wired to its gateway (a GatewayThread in this process): instances dropped
    and taken back, restarts counted."""
    gw = dep.gateway  # GatewayThread
    gateway = gw.gateway
    procs: list[ManagedProcess] = [*([dep.master] if dep.master else []), *dep.servers]
    for p in procs:
        gateway.metrics.instance_registered(p.name)  # its restarts at 0

    def down(p: ManagedProcess) -> None:
        if p is not dep.master:  # a server, also one an elastic role added (scaler.py)
            gw.call_soon(lambda: gateway.outages.down(p.url))

    def back(p: ManagedProcess) -> None:
        if p is not dep.master:
            gw.call_soon(lambda: gateway.outages.back(p.url))

    def restarted(p: ManagedProcess) -> None:
        gateway.metrics.restarts.labels(p.name).inc()

    meanwhile = {} if dep.master is None else {
        dep.master.name: "store loads miss: other tiers, else local encodes"}
    return Supervisor(procs, policy, startup_timeout_s=startup_timeout_s, say=say,
                      on_down=down, on_restart=restarted, on_back=back, meanwhile=meanwhile)
