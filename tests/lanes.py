"""What each test lane cost: its time, the vLLM servers it started, its slowest set-ups.

A pytest plugin (tests/conftest.py registers it). Every process a lane starts through
`ManagedProcess` (fixtures, `epd up` and what it restarts or scales) appends to the lane's
start ledger (`$EPD_START_LEDGER`, encoder_service/local/processes.py). At the end of a lane
its summary is printed and written to .work/lanes/<lane>.json; `python -m tests.lanes` prints
every lane's summary again (what `./run.sh test` shows last) and fails when a lane is over
its limit.

The limit: a vLLM server costs 40-70 s of the machine's two cores to start (most of the e2e
lane), so the e2e lane starts at most E2E_VLLM_SERVER_LIMIT distinct vLLM servers: a new
end-to-end test joins a shared deployment (tests/e2e/fleets.py) instead of starting its own.
What `epd up` starts under test (a server started again after a test killed it, a scale-up
under a burst) is counted and printed beside them, not against the limit: it is what the
fault and scaling tests prove.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from encoder_service.local.processes import LEDGER_ENV
from tests.helpers import WORK

E2E_VLLM_SERVER_LIMIT = 16
FAST_VLLM_SERVER_LIMIT = 0  # the fast lane starts no vLLM server (that is what makes it fast)
LIMITS = {"e2e": E2E_VLLM_SERVER_LIMIT, "fast": FAST_VLLM_SERVER_LIMIT}
LANES = WORK / "lanes"
SLOWEST = 5


def lane_of(config) -> str:
    """The lane a pytest run is (run.sh's marker expressions): `-m e2e` the e2e lane, `-m
    compat` the version lane, one that leaves e2e out the fast lane."""
    marks = " ".join((config.getoption("markexpr", "") or "").split())
    if marks in ("e2e", "compat"):
        return marks
    return "fast" if marks.startswith("not e2e") else "custom"


def read_ledger(path: Path) -> list[dict]:
    """The starts a ledger holds (a torn last line, from a process killed mid-write, skipped)."""
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def vllm_counts(starts: list[dict]) -> tuple[int, int]:
    """(vLLM servers the lane's deployments started, those `epd up` started under test:
    restarts after a kill and scale-ups) in a ledger's starts."""
    vllm = [s for s in starts if s.get("kind") == "VllmServer"]
    deployed = sum(1 for s in vllm if s.get("reason") == "deploy")
    return deployed, len(vllm) - deployed


def over_limit(summary: dict) -> str:
    """Why a lane's summary breaks its limit, or ''."""
    limit = LIMITS.get(summary["lane"])
    if limit is not None and summary["vllm_servers"] > limit:
        return (f"the {summary['lane']} lane started {summary['vllm_servers']} vLLM servers, "
                f"over its limit of {limit} (tests/lanes.py): share a deployment "
                "(tests/e2e/fleets.py) instead of starting one")
    return ""


def describe(summary: dict) -> str:
    minutes, seconds = divmod(round(summary["seconds"]), 60)
    lines = [f"[lane {summary['lane']}] {minutes} min {seconds:02d} s, "
             f"{summary['passed']} passed, {summary['failed']} failed, "
             f"{summary['skipped']} skipped; vLLM servers started: "
             f"{summary['vllm_servers']} (limit {LIMITS.get(summary['lane'], 'none')}), "
             f"started by epd up under test (restarts, scale-ups): {summary['vllm_restarts']}"]
    for nodeid, took in summary["slowest_setups"]:
        lines.append(f"    set-up {took:6.1f} s  {nodeid}")
    return "\n".join(lines)


class LaneReport:
    """The pytest plugin: times the lane, counts its starts and its set-ups."""

    def __init__(self, config) -> None:
        self.lane = lane_of(config)
        self.controller = not hasattr(config, "workerinput")  # xdist workers report to it
        self.ledger = LANES / f"{self.lane}-starts.jsonl"
        self.t0 = time.monotonic()
        self.setups: dict[str, float] = {}
        self.outcomes = {"passed": 0, "failed": 0, "skipped": 0}
        if self.controller:
            LANES.mkdir(parents=True, exist_ok=True)
            self.ledger.write_text("")
            os.environ[LEDGER_ENV] = str(self.ledger)  # workers and servers inherit it

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "setup":
            self.setups[report.nodeid] = report.duration
        if report.when == "call" or (report.when == "setup" and not report.passed):
            key = "skipped" if report.skipped else "failed" if report.failed else "passed"
            self.outcomes[key] += 1

    def summary(self) -> dict:
        servers, restarts = vllm_counts(read_ledger(self.ledger))
        slowest = sorted(self.setups.items(), key=lambda kv: -kv[1])[:SLOWEST]
        return {"lane": self.lane, "seconds": time.monotonic() - self.t0, **self.outcomes,
                "vllm_servers": servers, "vllm_restarts": restarts,
                "slowest_setups": [[n, round(s, 1)] for n, s in slowest]}

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if not self.controller or not self.setups:
            return
        summary = self.summary()
        (LANES / f"{self.lane}.json").write_text(json.dumps(summary, indent=1))
        reason = over_limit(summary)
        if reason and session.exitstatus == 0:
            session.exitstatus = 1
        self.lines = describe(summary) + (f"\nFAILED: {reason}" if reason else "")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if getattr(self, "lines", ""):
            terminalreporter.write_line(self.lines)


def main(lanes: list[str]) -> int:
    """Print the summaries of `lanes` (each lane's last run); 1 when one is missing or over."""
    failed = 0
    for lane in lanes:
        try:
            summary = json.loads((LANES / f"{lane}.json").read_text())
        except (OSError, ValueError):
            print(f"[lane {lane}] no summary (.work/lanes/{lane}.json)")
            failed = 1
            continue
        print(describe(summary))
        if over_limit(summary):
            print(f"FAILED: {over_limit(summary)}")
            failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["fast", "e2e"]))
