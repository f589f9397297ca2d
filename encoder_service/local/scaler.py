"""`epd up`'s elastic roles: start, add, drain and stop instances as scaling.py decides.

With `scaling.encoders_max` / `scaling.decoders_max` above `encoders` / `decoders` (`epd up
--encoders 1:2 --decoders 1:2`), `epd up` plans every instance up to the maximum (its port,
core and side channel are fixed from the start: up.py's `Deployment.spare`) and starts the
minimum. `Scaler.poll()`, on the main thread beside the supervisor (a started server dies with
that thread), every `scaling.interval_s`:

- samples each elastic role's load: the in-process gateway's `Fleet.load()` (encode calls in
  flight and images waiting for a shared call; decode requests in flight, streams included),
  plus what the servers' own /metrics say: `epd_pool_queue_depth` of encoder pools,
  `vllm:num_requests_waiting` of decode instances;
- feeds it to the role's `Decider` and carries out what it decides, logging each decision
  with its reason:
  - up: the next planned instance starts; once /health answers it joins the gateway's pool
    (`EncoderRouter.add`, `DecodePool.add`) and the supervisor (restarted if it dies);
  - down: the newest instance (the oldest keep the warmest caches) leaves the supervisor and
    is drained through the gateway (`Members.drain`: nothing new, its requests in flight,
    streams included, finish within `drain_timeout_s`), then its whole process session is
    stopped;
- exports `epd_scale_events_total{role,direction,reason}` and `epd_instances{role,state}`
  on the gateway's /metrics, and its roles and last decisions under "scaling" in GET
  /instances (`epd top` prints them).
An instance not healthy within `startup_timeout_s` is stopped and the role waits a new window.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from ec_connectors.protocol.api_keys import api_key
from ec_connectors.protocol.secret_file import read_secret
from encoder_service.local.processes import ManagedProcess, metric_value
from encoder_service.local.scaling import UP, Decider, Decision, RoleScaling
from encoder_service.local.supervise import Supervisor

STATES = ("wanted", "starting", "serving", "draining")  # epd_instances{state}
QUEUES = {"encoder": "epd_pool_queue_depth", "decode": "vllm:num_requests_waiting"}


@dataclass
class Role:
    """One elastic role: its running instances (the deployment's own list) and changes."""

    name: str  # "encoder" or "decode"
    active: list[ManagedProcess]  # Deployment.encoders / .decoders: serving
    decider: Decider
    starting: dict[str, tuple[ManagedProcess, float]] = field(default_factory=dict)
    draining: dict[str, tuple[ManagedProcess, Any]] = field(default_factory=dict)
    stopping: dict[str, threading.Thread] = field(default_factory=dict)
    load: float = 0.0


class Scaler:
    """Carry out the elastic roles' decisions on a started deployment (up.py's)."""

    def __init__(self, dep: Any, supervisor: Supervisor, say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        cfg = dep.cfg
        sc = cfg.scaling
        self.dep, self.supervisor, self.say, self.clock = dep, supervisor, say, clock
        self.sc = sc
        self.gw = dep.gateway  # GatewayThread: the gateway runs in this process
        self.gateway = self.gw.gateway
        self.metrics = self.gateway.metrics
        self.roles: dict[str, Role] = {}
        for name, active, lo, hi, policy in (
                ("encoder", dep.encoders, cfg.encoders, sc.encoders_max, sc.encoder),
                ("decode", dep.decoders, cfg.decoders, sc.decoders_max, sc.decode)):
            if hi is not None and hi > lo:
                self.roles[name] = Role(name, active, Decider(name, lo, hi, policy, clock))
                self.metrics.scaling_registered(name)
                say(f"elastic {name} instances: {lo} to {hi} ({_policy(policy)}; "
                    f"scaling.{name} in the config)")
        self.events: deque[dict[str, Any]] = deque(maxlen=20)
        secret = read_secret(cfg.secret_path)
        self.http = httpx.Client(timeout=1.0, trust_env=False, headers={} if secret is None
                                 else {"authorization": f"Bearer {api_key(secret)}"})
        self._asks = ThreadPoolExecutor(8, thread_name_prefix="epd-scaler-metrics")
        self.next_at = 0.0
        self.view: dict[str, Any] = {}
        self.gateway.admin.scaling = lambda: self.view
        self._publish()

    @classmethod
    def of(cls, dep: Any, supervisor: Supervisor, say: Callable[[str], None]
           ) -> Scaler | None:
        """The scaler of a deployment with an elastic role, else None."""
        sc = dep.cfg.scaling
        if (sc.encoders_max or 0) > dep.cfg.encoders or (sc.decoders_max or 0) > \
                dep.cfg.decoders:
            return cls(dep, supervisor, say)
        return None

    # -- the loop ----------------------------------------------------------------------------
    def poll(self) -> None:
        now = self.clock()
        for role in self.roles.values():
            self._progress(role, now)
        if now < self.next_at:
            return
        self.next_at = now + self.sc.interval_s
        loads = self._gateway_call(self.gateway.fleet.load) or {}
        for role in self.roles.values():
            role.load = loads.get(role.name, 0.0) + self._queued(role)
            decision = role.decider.observe(role.load, len(role.active), len(role.starting),
                                            len(role.draining) + len(role.stopping))
            if decision is not None:
                self._carry_out(role, decision)
        self._publish()

    def _queued(self, role: Role) -> float:
        """What the role's servers queue themselves (pool queue depth, vLLM's waiting)."""
        if role.name == "encoder" and self.dep.cfg.encoder_backend != "pool":
            return 0.0
        def queued(proc: ManagedProcess) -> float:
            try:
                return metric_value(self.http.get(proc.url + "/metrics").text,
                                    QUEUES[role.name])
            except httpx.HTTPError:
                return 0.0  # a dying instance: the supervisor's business

        # all at once: a hung instance costs one timeout per poll, not one per instance
        return sum(self._asks.map(queued, list(role.active)))

    def _gateway_call(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the gateway's event loop (its pools live there); None if it is gone."""
        loop = self.gw.loop
        if loop is None or loop.is_closed():
            return None

        async def call() -> Any:
            return fn()

        try:
            return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=5)
        except (RuntimeError, TimeoutError, asyncio.TimeoutError):
            return None

    # -- changes -----------------------------------------------------------------------------
    def _carry_out(self, role: Role, d: Decision) -> None:
        self.metrics.scale_events.labels(role.name, d.direction, d.reason).inc()
        if d.direction == UP:
            spare = [p for p in self.dep.spare if p.name.startswith(role.name + "-")
                     and p.name not in role.starting and not p.running]
            proc = min(spare, key=lambda p: p.port)
            proc.start_reason = "scale-up"
            proc.start()
            role.starting[proc.name] = (proc, self.clock())
            self._event(role, d, proc, f"{proc.name} starting on :{proc.port} (log "
                        f"{proc.log_path})")
            return
        proc = role.active[-1]
        self.supervisor.unwatch(proc.name)
        role.active.remove(proc)
        self.dep.spare.append(proc)
        inflight = (self._gateway_call(lambda: self._pool(role).inflight.get(proc.url, 0))
                    or 0)
        future = asyncio.run_coroutine_threadsafe(
            self._pool(role).drain(proc.url, self.sc.drain_timeout_s), self.gw.loop)
        role.draining[proc.name] = (proc, future)
        self._event(role, d, proc, f"{proc.name} draining: nothing new from the gateway, "
                    f"{inflight} request(s) in flight finish first (at most "
                    f"{self.sc.drain_timeout_s:g} s), then it stops")

    def _pool(self, role: Role) -> Any:
        return self.gateway.router if role.name == "encoder" else self.gateway.decoders

    def _progress(self, role: Role, now: float) -> None:
        """Instances starting, draining and stopping: move each on when it is ready."""
        for name, (proc, since) in list(role.starting.items()):
            if not proc.running or now - since > self.dep.cfg.startup_timeout_s:
                del role.starting[name]
                why = "exited" if not proc.running else "was not healthy in time"
                proc.stop(timeout_s=5.0)
                self.say(f"scale {role.name}: {name} {why} while starting (log "
                         f"{proc.log_path}); the role waits a new window")
                role.decider.settled()
            elif proc.healthy():
                del role.starting[name]
                self.dep.spare.remove(proc)
                role.active.append(proc)
                if role.name == "encoder":
                    self.gw.call_soon(lambda p=proc: self.gateway.router.add(
                        self.gateway.encoder_client(p.url)))
                else:
                    self.gw.call_soon(lambda p=proc: self.gateway.decoders.add(p.url))
                self.metrics.instance_registered(name)
                self.supervisor.watch(proc)
                role.decider.settled()
                self.say(f"scale {role.name}: {name} serving after {now - since:.0f} s; "
                         f"{len(role.active)} {role.name} instance(s) now")
        for name, (proc, future) in list(role.draining.items()):
            if future.done():
                del role.draining[name]
                drained = not future.cancelled() and future.exception() is None \
                    and future.result()
                self.say(f"scale {role.name}: {name} "
                         + ("drained (its requests in flight finished)" if drained else
                            f"left undrained after {self.sc.drain_timeout_s:g} s "
                            "(drain_timeout_s: the gateway continues its broken streams "
                            "elsewhere)") + "; stopping its process session")
                t = threading.Thread(target=proc.stop, name=f"stop-{name}", daemon=True)
                t.start()
                role.stopping[name] = t
        for name, t in list(role.stopping.items()):
            if not t.is_alive():
                del role.stopping[name]
                role.decider.settled()
                self.say(f"scale {role.name}: {name} stopped, nothing of it left; "
                         f"{len(role.active)} {role.name} instance(s) now")

    # -- what an operator sees ---------------------------------------------------------------
    def _event(self, role: Role, d: Decision, proc: ManagedProcess, what: str) -> None:
        self.say(f"scale {role.name} {d.direction}: {what}; why: {d.detail}")
        self.events.append({"at": time.time(), "role": role.name, "direction": d.direction,
                            "reason": d.reason, "instance": proc.name, "detail": d.detail})

    def _publish(self) -> None:
        roles = {}
        for role in self.roles.values():
            n = {"starting": len(role.starting), "serving": len(role.active),
                 "draining": len(role.draining) + len(role.stopping)}
            n["wanted"] = n["serving"] + n["starting"]
            for state in STATES:
                self.metrics.instances.labels(role.name, state).set(n[state])
            roles[role.name] = {**n, "min": role.decider.lo, "max": role.decider.hi,
                                "load": role.load}
        self.view = {"roles": roles, "decisions": list(self.events)}

    def close(self) -> None:
        self._asks.shutdown(wait=True)
        self.http.close()


def _policy(p: RoleScaling) -> str:
    return (f"up when the mean load per instance over {p.up_window_s:g} s > {p.target:g}, "
            f"down after {p.idle_window_s:g} s at or below {p.idle_below:g}; cooldowns "
            f"{p.up_cooldown_s:g} s up, {p.down_cooldown_s:g} s down")
