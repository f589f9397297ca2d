"""When `epd up` adds or removes an instance of a role: the decision alone, no processes.

`epd up --encoders MIN:MAX` / `--decoders MIN:MAX` (the up config's `scaling` table) hands
each elastic role a `Decider`: fed a sample of the role's load every `interval_s` (what
scaler.py reads from the gateway and the servers), it answers `Direction.UP`,
`Direction.DOWN` or nothing.

- up: the mean load per serving instance over the last `up_window_s` is above `target`, the
  role is below its maximum, and `up_cooldown_s` has passed since the role's last change;
- down: every sample of the last `idle_window_s` is at or below `idle_below` per instance,
  the others would stay at or below `target` with that load shared among them (else the next
  window would add the instance back), the role is above its minimum, and `down_cooldown_s`
  has passed since its last change;
- one change at a time: no decision while an instance of the role is starting or draining,
  and a change empties the window, so the next decision waits for a whole new one.
So a role changes at most once per cooldown and never flaps between an up and a down inside
a window. Every decision carries a reason an operator can read (the load, the target, the
window) and a short label for `epd_scale_events_total{reason}`. The clock is injected: the
unit tests drive it by hand.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class Direction(StrEnum):
    """Which way a role changes (the `direction` label of epd_scale_events_total)."""

    UP = "up"
    DOWN = "down"


class Reason(StrEnum):
    """Why a role changes (the `reason` label of epd_scale_events_total)."""

    LOAD = "load_above_target"
    IDLE = "idle"


class RoleScaling(BaseModel):
    """Targets and windows of one elastic role (the up config's scaling.encoder / .decode)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: float = Field(2.0, gt=0, description="load per serving instance above which the "
                          "role grows (encoders: encode calls in flight + images waiting "
                          "for a shared call + items queued in encoder pools; decode: "
                          "requests in flight + vLLM's vllm:num_requests_waiting)")
    up_window_s: float = Field(5.0, gt=0, description="the mean over this window is compared")
    idle_below: float = Field(0.5, ge=0, description="load per instance at or below which "
                              "a sample counts as idle (0: only no load at all; a quiet "
                              "trickle then keeps every instance)")
    idle_window_s: float = Field(60.0, gt=0, description="idle this long: one instance goes")
    up_cooldown_s: float = Field(30.0, ge=0, description="after any change of the role, "
                                 "this long before it grows")
    down_cooldown_s: float = Field(60.0, ge=0, description="after any change of the role, "
                                   "this long before it shrinks")


class ScalingConfig(BaseModel):
    """`epd up`'s elastic roles (the up config's `scaling` table)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    encoders_max: int | None = Field(None, ge=1, le=16, description="encoders grow from "
                                     "`encoders` up to this (`--encoders MIN:MAX`); unset: fixed")
    decoders_max: int | None = Field(None, ge=1, le=16, description="decode instances grow "
                                     "from `decoders` up to this (`--decoders MIN:MAX`, "
                                     "`--decode MIN:MAX`); unset: fixed")
    interval_s: float = Field(1.0, gt=0, description="how often the load is sampled")
    drain_timeout_s: float = Field(120.0, gt=0, description="a leaving instance's requests "
                                   "in flight get this long to finish (then the gateway "
                                   "continues broken streams elsewhere: failover)")
    encoder: RoleScaling = Field(default_factory=RoleScaling)
    decode: RoleScaling = Field(default_factory=lambda: RoleScaling(target=4.0,
                                                                     idle_below=1.0))


@dataclass(frozen=True)
class Decision:
    """Grow or shrink a role by one instance, and why."""

    role: str
    direction: Direction
    reason: Reason
    detail: str  # for the log line


class Decider:
    """One elastic role's decisions from its load samples (see the module's docstring)."""

    def __init__(self, role: str, lo: int, hi: int, policy: RoleScaling,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 1 <= lo <= hi:
            raise ValueError(f"{role}: MIN:MAX must satisfy 1 <= MIN <= MAX, got {lo}:{hi}")
        self.role, self.lo, self.hi, self.policy, self.clock = role, lo, hi, policy, clock
        self.samples: deque[tuple[float, float]] = deque()  # (when, load per instance)
        self.since = clock()  # the window starts here (start-up, or the last change)
        self.last_change = -float("inf")

    def observe(self, load: float, serving: int, starting: int = 0,
                draining: int = 0) -> Decision | None:
        """Record one sample of the role's total `load`; a decision, or None."""
        now, p = self.clock(), self.policy
        per = load / max(1, serving)
        self.samples.append((now, per))
        keep = max(p.up_window_s, p.idle_window_s)
        while self.samples and self.samples[0][0] < now - keep:
            self.samples.popleft()
        if starting or draining or serving < 1:
            return None
        since_change = now - self.last_change
        if serving < self.hi and since_change >= p.up_cooldown_s \
                and now - self.since >= p.up_window_s:
            window = [v for t, v in self.samples if t >= now - p.up_window_s]
            mean = sum(window) / len(window)
            if mean > p.target:
                return self._change(now, Direction.UP, Reason.LOAD, (
                    f"mean load {mean:.2f} per instance over the last {p.up_window_s:g} s > "
                    f"target {p.target:g} (scaling.{self.role}.target); {serving} -> "
                    f"{serving + 1} of at most {self.hi}"))
        if serving > self.lo and since_change >= p.down_cooldown_s \
                and now - self.since >= p.idle_window_s:
            peak = max(v for t, v in self.samples if t >= now - p.idle_window_s)
            # and the others could take its share without going over the target: else the
            # next window would grow the role again (flapping)
            if peak <= p.idle_below and peak * serving / (serving - 1) <= p.target:
                return self._change(now, Direction.DOWN, Reason.IDLE, (
                    f"idle: load at most {peak:.2f} per instance for {p.idle_window_s:g} s "
                    f"(scaling.{self.role}.idle_below {p.idle_below:g}); {serving} -> "
                    f"{serving - 1}, at least {self.lo}"))
        return None

    def _change(self, now: float, direction: Direction, reason: Reason,
                detail: str) -> Decision:
        self.last_change = self.since = now
        self.samples.clear()
        return Decision(self.role, direction, reason, detail)

    def reset_window(self) -> None:
        """An instance finished starting or draining: a new window starts now."""
        self.since = self.clock()
        self.samples.clear()
