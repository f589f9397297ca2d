"""A started deployment under test, whatever started it (the rival benchmark's deployments,
the conformance run's `epd up` stacks): where requests go and how it stops."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Stack:
    """A started deployment: `url` takes the requests for the served `model`; `stop` stops
    all of it. `pids` names the processes whose CPU a `CpuMeter` counts (`decode`: the
    prefill/decode instance, the whole server for an aggregated one); `urls` its members
    by role (`encoder`, ...)."""

    name: str
    model: str
    url: str
    stop: Callable[[], None]
    pids: dict[str, int] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    probe_dir: Path | None = None  # the rivals' handoff probe writes its events here
    hop_log: Path | None = None  # E/P/D: a log with a line per request (its hops' times)
    text_only: bool = False  # no encoder: text prompts only
    failover_url: str | None = None  # a second front whose decode streams get cut
    cuts: Callable[[], int] | None = None  # streams cut so far behind `failover_url`
    prefills: int = 0  # E/P/D prefill instances
