"""A bursty trace against fixed and elastic fleets:

    flock /tmp/epd-vllm.lock .venv/bin/python -m benchmarks.serving.elastic --fleet min
    flock /tmp/epd-vllm.lock .venv/bin/python -m benchmarks.serving.elastic --fleet max
    flock /tmp/epd-vllm.lock .venv/bin/python -m benchmarks.serving.elastic --fleet auto
    .venv/bin/python -m benchmarks.serving.elastic --report     # the table, from the three

One fleet per run (each a few minutes): `epd up` (tiny LLaVA, encoder pools, vLLM
decode instances) as the fixed minimum (1 encoder, 1 decode instance), the fixed maximum (2
and 2) or elastic (`--encoders 1:2 --decoders 1:2`, windows and cooldowns below). The trace:
--quiet-s of one request a second, a --burst-s burst of --clients clients sending back to
back, --after-s of one request a second again; every request a new image, streamed. Per phase:
TTFT p50/p99 (client side: request sent -> first content event), requests lost (not answered
200 in full); over the trace: instance-seconds (each server's seconds alive: the fixed fleets'
instances times the trace's length; the elastic fleet's from its epd_instances gauges, sampled
every half second: starting, serving and draining all count). Writes
$EPD_WORK_DIR/bench/elastic-<fleet>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time

import httpx

from benchmarks.harness.env import ROOT
from encoder_service.local.processes import UpProcess, default_work_dir
from encoder_service.local.requests import chat_body, sample_image_png
from encoder_service.local.testmodels import SPECS, build

WORK = default_work_dir(ROOT)
PORT = 20940  # gateway; servers 20941..20944 (clear of the tests' ports)
MODEL = "tiny-llava"
ROLE = {"up_window_s": 3, "idle_window_s": 10, "up_cooldown_s": 10, "down_cooldown_s": 10}
FLEETS = {"min": (1, 1, None), "max": (2, 2, None), "auto": (1, 1, 2)}


def config(fleet: str) -> dict:
    enc, dec, most = FLEETS[fleet]
    conf = {"model": str(build(WORK / "models" / MODEL, SPECS["tiny"])), "base_port": PORT,
            "encoders": enc, "decoders": dec, "encoder_backend": "pool",
            "cpu_cores": [0, 1, 1, 0][:2 + 2 * (fleet != "min")],
            "connector_extra": {"shm_arena_bytes": 64 << 20}}
    if most:
        conf["scaling"] = {"encoders_max": most, "decoders_max": most, "interval_s": 0.5,
                           "encoder": {**ROLE, "target": 1.0, "idle_below": 0.5},
                           "decode": {**ROLE, "target": 2.0, "idle_below": 1.0}}
    return conf


class Trace:
    """Every request of the trace: (phase, TTFT s or None, answered in full)."""

    def __init__(self, gw: str) -> None:
        self.gw = gw
        self.results: list[tuple[str, float | None, bool]] = []
        self.seeds = iter(range(500000, 10**7))
        self.lock = threading.Lock()

    def one(self, client: httpx.Client, phase: str) -> None:
        with self.lock:
            seed = next(self.seeds)
        body = {**chat_body(MODEL, sample_image_png(seed, 64), "describe", max_tokens=16),
                "stream": True}
        t0, ttft, ok = time.perf_counter(), None, False
        try:
            with client.stream("POST", self.gw + "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith('data: {"error"'):
                        break
                    if ttft is None and line.startswith("data: {"):
                        ttft = time.perf_counter() - t0
                    if line == "data: [DONE]":
                        ok = r.status_code == 200
        except httpx.HTTPError:
            pass
        self.results.append((phase, ttft, ok))

    def steady(self, phase: str, seconds: float) -> None:
        """One request a second for `seconds`."""
        with httpx.Client(timeout=300) as c:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t = time.monotonic()
                self.one(c, phase)
                time.sleep(max(0.0, 1.0 - (time.monotonic() - t)))

    def burst(self, seconds: float, clients: int) -> None:
        end = time.monotonic() + seconds

        def run() -> None:
            with httpx.Client(timeout=300) as c:
                while time.monotonic() < end:
                    self.one(c, "burst")

        threads = [threading.Thread(target=run) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def instances_now(client: httpx.Client, gw: str) -> float:
    """Servers alive now by the gateway's epd_instances (starting, serving, draining)."""
    total = 0.0
    for line in client.get(gw + "/metrics").text.splitlines():
        if line.startswith("epd_instances{") and 'state="wanted"' not in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def run(fleet: str, args: argparse.Namespace) -> dict:
    up = UpProcess(config(fleet), WORK / "bench" / f"elastic-{fleet}", args=["--no-restart"])
    up.start()
    try:
        up.wait(420)
        gw = up.url
        trace, samples, stop = Trace(gw), [], threading.Event()

        def sample() -> None:
            with httpx.Client(timeout=5) as c:
                while not stop.is_set():
                    with contextlib.suppress(httpx.HTTPError):
                        samples.append(instances_now(c, gw))
                    stop.wait(0.5)

        sampler = threading.Thread(target=sample)
        t0 = time.monotonic()
        sampler.start()
        trace.steady("quiet", args.quiet_s)
        trace.burst(args.burst_s, args.clients)
        trace.steady("after", args.after_s)
        stop.set()
        sampler.join()
        seconds = time.monotonic() - t0
        enc, dec, most = FLEETS[fleet]
        inst_s = (statistics.fmean(samples) * seconds if most else (enc + dec) * seconds)
    finally:
        up.stop(120)
    out = {"fleet": fleet, "seconds": round(seconds, 1), "instance_seconds": round(inst_s),
           "events": [line for line in up.log_tail(4000).splitlines() if "] scale " in line]}
    for phase in ("quiet", "burst", "after"):
        got = [(t, ok) for p, t, ok in trace.results if p == phase]
        ttfts = sorted(t for t, ok in got if ok and t is not None)
        out[phase] = {"requests": len(got), "lost": sum(not ok for _, ok in got),
                      "ttft_p50_ms": round(1e3 * ttfts[len(ttfts) // 2], 1) if ttfts else None,
                      "ttft_p99_ms": round(1e3 * ttfts[min(len(ttfts) - 1,
                                                             int(0.99 * len(ttfts)))], 1)
                      if ttfts else None}
    return out


def report() -> int:
    rows = []
    for fleet in FLEETS:
        path = WORK / "bench" / f"elastic-{fleet}.json"
        if not path.exists():
            print(f"missing {path}: run --fleet {fleet} first", file=sys.stderr)
            return 1
        r = json.loads(path.read_text())
        b, a = r["burst"], r["after"]
        rows.append(f"| {fleet} | {b['requests']} | {b['ttft_p50_ms']} | {b['ttft_p99_ms']} | "
                    f"{a['ttft_p50_ms']} | {a['ttft_p99_ms']} | "
                    f"{sum(r[p]['lost'] for p in ('quiet', 'burst', 'after'))} | "
                    f"{r['instance_seconds']} |")
    print("| fleet | burst requests | burst TTFT p50 ms | p99 | after TTFT p50 ms | p99 | lost "
          "| instance-s |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleet", choices=list(FLEETS))
    p.add_argument("--report", action="store_true")
    p.add_argument("--quiet-s", type=float, default=15)
    p.add_argument("--burst-s", type=float, default=60)
    p.add_argument("--after-s", type=float, default=45)
    p.add_argument("--clients", type=int, default=6)
    args = p.parse_args()
    if args.report:
        return report()
    if not args.fleet:
        p.error("--fleet min|max|auto, or --report")
    out = run(args.fleet, args)
    path = WORK / "bench" / f"elastic-{args.fleet}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0 if all(out[p]["lost"] == 0 for p in ("quiet", "burst", "after")) else 1


if __name__ == "__main__":
    sys.exit(main())
