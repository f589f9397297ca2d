"""`epd up`'s elastic roles: start, add, drain and stop instances as scale_rules.py decides.

With `scaling.encoders_max` / `scaling.decoders_max` above `encoders` / `decoders` (`epd up
--encoders 1:2 --decoders 1:2`), `epd up` plans every instance up to the maximum (its port,
core and side channel are fixed from the start: up.py's `Deployment.spare`) and starts the
minimum. `Scaler.poll()`, on the main thread beside the supervisor (a started server dies with
that thread), every `scaling.interval_s`:

The scaler reaches the gateway only through `ScalingGateway` (the in-process gateway's
`gateway/server.py` `ScalingPort`), and keeps each role's instances in its own lists. It

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

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from encoder_service.local.processes import ManagedProcess, metric_value
from encoder_service.local.scale_rules import Decider, Decision, Direction, RoleScaling
from encoder_service.local.supervise import Supervisor

if TYPE_CHECKING:
    from encoder_service.gateway.telemetry.metrics import GatewayMetrics
    from encoder_service.local.up_config import UpConfig

STATES = ("wanted", "starting", "serving", "draining")  # epd_instances{state}


class ScalingGateway(Protocol):
    """What the scaler asks of the gateway it runs beside (gateway/server.py `ScalingPort`)."""

    @property
    def metrics(self) -> GatewayMetrics: ...

    def load(self) -> dict[str, float] | None:
        """The load per role (`Fleet.load()`); None once the gateway is gone."""

    def add(self, role: str, url: str) -> None:
        """An instance of `role` joins the gateway's pool."""

    def drain(self, role: str, url: str, timeout_s: float) -> tuple[int, Future[bool]]:
        """An instance leaves the pool: its requests in flight now, and the drain's end."""

    def publish(self, view: Callable[[], dict[str, Any]]) -> None:
        """Show the scaling view under "scaling" in GET /instances."""


@dataclass
class Role:
    """One elastic role: its instances (the scaler's own lists) and changes."""

    name: str  # "encoder" or "decode": the label of its metrics, the gateway pool it joins
    serving: list[ManagedProcess]
    spare: list[ManagedProcess]  # planned, not running: the next to start (lowest port first)
    decider: Decider
    queue_metric: str | None  # what its servers queue (on their /metrics); None: nothing
    starting: dict[str, tuple[ManagedProcess, float]] = field(default_factory=dict)
    draining: dict[str, tuple[ManagedProcess, Future[bool]]] = field(default_factory=dict)
    stopping: dict[str, threading.Thread] = field(default_factory=dict)
    load: float = 0.0


class Scaler:
    """Carry out the elastic roles' decisions on a started deployment (up.py's)."""

    def __init__(self, cfg: UpConfig, roles: list[Role], gateway: ScalingGateway,
                 supervisor: Supervisor, say: Callable[[str], None],
                 api_headers: dict[str, str], clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.sc = cfg.scaling
        self.startup_timeout_s = cfg.startup_timeout_s
        self.gateway, self.supervisor, self.say, self.clock = gateway, supervisor, say, clock
        self.metrics = gateway.metrics
        self.roles = {role.name: role for role in roles}
        for role in roles:
            self.metrics.scaling_registered(role.name)
            policy = role.decider.policy
            say(f"elastic {role.name} instances: {role.decider.lo} to {role.decider.hi} "
                f"({_policy(policy)}; scaling.{role.name} in the config)")
        self.events: deque[dict[str, Any]] = deque(maxlen=20)
        self.http = httpx.Client(timeout=1.0, trust_env=False, headers=api_headers)
        self._asks = ThreadPoolExecutor(8, thread_name_prefix="epd-scaler-metrics")
        self.next_at = 0.0
        self.view: dict[str, Any] = {}
        gateway.publish(lambda: self.view)
        self._publish()

    @classmethod
    def of(cls, cfg: UpConfig, serving: dict[str, list[ManagedProcess]],
           spare: list[ManagedProcess], gateway: ScalingGateway, supervisor: Supervisor,
           say: Callable[[str], None], api_headers: dict[str, str],
           clock: Callable[[], float] = time.monotonic) -> Scaler | None:
        """The scaler of a deployment with an elastic role, else None.

        `serving`: each role's started instances; `spare`: the instances planned beyond
        them (both copied: the scaler keeps its own lists)."""
        sc = cfg.scaling
        roles = []
        for name, lo, hi, policy, queue in (
                ("encoder", cfg.encoders, sc.encoders_max, sc.encoder,
                 "epd_pool_queue_depth" if cfg.encoder_backend == "pool" else None),
                ("decode", cfg.decoders, sc.decoders_max, sc.decode,
                 "vllm:num_requests_waiting")):
            if hi is not None and hi > lo:
                roles.append(Role(name, list(serving[name]),
                                  [p for p in spare if p.name.startswith(name + "-")],
                                  Decider(name, lo, hi, policy, clock), queue))
        return cls(cfg, roles, gateway, supervisor, say, api_headers, clock) if roles else None

    # -- the loop ----------------------------------------------------------------------------
    def poll(self) -> None:
        now = self.clock()
        for role in self.roles.values():
            self._progress(role, now)
        if now < self.next_at:
            return
        self.next_at = now + self.sc.interval_s
        loads = self.gateway.load() or {}
        for role in self.roles.values():
            role.load = loads.get(role.name, 0.0) + self._queued(role)
            decision = role.decider.observe(role.load, len(role.serving), len(role.starting),
                                            len(role.draining) + len(role.stopping))
            if decision is not None:
                self._carry_out(role, decision)
        self._publish()

    def _queued(self, role: Role) -> float:
        """What the role's servers queue themselves (pool queue depth, vLLM's waiting)."""
        metric = role.queue_metric
        if metric is None:
            return 0.0

        def queued(proc: ManagedProcess) -> float:
            try:
                return metric_value(self.http.get(proc.url + "/metrics").text, metric)
            except httpx.HTTPError:
                return 0.0  # a dying instance: the supervisor's business

        # all at once: a hung instance costs one timeout per poll, not one per instance
        return sum(self._asks.map(queued, list(role.serving)))

    # -- changes -----------------------------------------------------------------------------
    def _carry_out(self, role: Role, d: Decision) -> None:
        self.metrics.scale_events.labels(role.name, d.direction, d.reason).inc()
        if d.direction is Direction.UP:
            spare = [p for p in role.spare if p.name not in role.starting and not p.running]
            proc = min(spare, key=lambda p: p.port)
            proc.start_reason = "scale-up"
            proc.start()
            role.starting[proc.name] = (proc, self.clock())
            self._event(role, d, proc, f"{proc.name} starting on :{proc.port} (log "
                        f"{proc.log_path})")
            return
        proc = role.serving[-1]
        self.supervisor.unwatch(proc.name)
        role.serving.remove(proc)
        role.spare.append(proc)
        inflight, future = self.gateway.drain(role.name, proc.url, self.sc.drain_timeout_s)
        role.draining[proc.name] = (proc, future)
        self._event(role, d, proc, f"{proc.name} draining: nothing new from the gateway, "
                    f"{inflight} request(s) in flight finish first (at most "
                    f"{self.sc.drain_timeout_s:g} s), then it stops")

    def _progress(self, role: Role, now: float) -> None:
        """Instances starting, draining and stopping: move each on when it is ready."""
        for name, (proc, since) in list(role.starting.items()):
            if not proc.running or now - since > self.startup_timeout_s:
                del role.starting[name]
                why = "exited" if not proc.running else "was not healthy in time"
                proc.stop(timeout_s=5.0)
                self.say(f"scale {role.name}: {name} {why} while starting (log "
                         f"{proc.log_path}); the role waits a new window")
                role.decider.reset_window()
            elif proc.healthy():
                del role.starting[name]
                role.spare.remove(proc)
                role.serving.append(proc)
                self.gateway.add(role.name, proc.url)
                self.metrics.instance_registered(name)
                self.supervisor.watch(proc)
                role.decider.reset_window()
                self.say(f"scale {role.name}: {name} serving after {now - since:.0f} s; "
                         f"{len(role.serving)} {role.name} instance(s) now")
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
                role.decider.reset_window()
                self.say(f"scale {role.name}: {name} stopped, nothing of it left; "
                         f"{len(role.serving)} {role.name} instance(s) now")

    # -- what an operator sees ---------------------------------------------------------------
    def _event(self, role: Role, d: Decision, proc: ManagedProcess, what: str) -> None:
        self.say(f"scale {role.name} {d.direction}: {what}; why: {d.detail}")
        self.events.append({"at": time.time(), "role": role.name, "direction": d.direction,
                            "reason": d.reason, "instance": proc.name, "detail": d.detail})

    def _publish(self) -> None:
        roles = {}
        for role in self.roles.values():
            n = {"starting": len(role.starting), "serving": len(role.serving),
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
