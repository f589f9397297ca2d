"""E/P/D beside E+PD and aggregated vLLM, one run, the same workload:

    flock /tmp/epd-vllm.lock .venv/bin/python -m benchmarks.serving.epd_kv [--rounds 2]

Deployments, each started fresh and measured in turn, rounds interleaved (A B C, A B C...):
  aggregated  one vLLM server (encoder and prefill/decode in one process), both cores
  e+pd        `epd up`: a vLLM encoder (core 0) and a prefill/decode instance (core 1)
  e/p/d       `epd up --prefill 1 --decode 1`: the encoder (core 0), a prefill instance and
              a decode instance (core 1 both), the KV cache handed over by NixlConnector
Workload: `epd bench serve` (encoder_service/bench.py), tiny LLaVA, streamed, 50% image
reuse. Prints req/s and TTFT/TPOT percentiles per deployment (median over rounds) and the
gateway's mean time per stage (encode, prefill = the KV handoff's prefill hop, first token).
Two cores cannot show what E/P/D buys (a decode instance free of prefills): this reports
what it costs here, it is not tuned for it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from benchmarks.harness.env import ROOT
from benchmarks.harness.load import stage_means
from benchmarks.harness.report import medians, say
from encoder_service.bench import BenchSpec, run_bench
from encoder_service.local.processes import UpProcess, VllmServer, default_work_dir
from encoder_service.local.testmodels import SPECS, build

WORK = default_work_dir(ROOT)
PORT = 20920  # aggregated; e+pd 20930..; e/p/d 20940.. (clear of the tests' blocks)
DEPLOYMENTS = ("aggregated", "e+pd", "e/p/d")


def start(name: str, model: Path, work: Path):
    """(process, URL) of one deployment, started and ready."""
    if name == "aggregated":
        s = VllmServer("bench-aggregated", model, PORT, work, None, cpu_core=None).start()
        s.wait()
        return s, s.url
    base = PORT + (10 if name == "e+pd" else 20)
    conf = {"model": str(model), "base_port": base, "transport": "shm",
            "cpu_cores": [0, 1] if name == "e+pd" else [0, 1, 1]}
    args = ["--prefill", "1", "--decode", "1"] if name == "e/p/d" else []
    up = UpProcess(conf, work / name.replace("/", "-"), args=args).start()
    up.wait(600)
    return up, up.url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=120)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", type=Path, default=WORK / "epd-kv-bench.json")
    a = ap.parse_args()
    model = build(WORK / "models" / "tiny-llava", SPECS["tiny"])
    work = WORK / "epd-kv-bench"
    runs: dict[str, list[dict]] = {d: [] for d in DEPLOYMENTS}
    stages: dict[str, dict] = {}
    for r in range(a.rounds):
        for name in DEPLOYMENTS:
            say(f"round {r + 1}: {name}: starting")
            proc, url = start(name, model, work)
            try:
                spec = BenchSpec(url=url, num_requests=a.num_requests,
                                 concurrency=a.concurrency, seed=r, label=name)
                res = asyncio.run(run_bench(spec, progress=False))
                runs[name].append(res.summary)
                if name != "aggregated":
                    stages[name] = stage_means(url, [])["gateway"]
                s = res.summary
                say(f"round {r + 1}: {name}: {s['req_per_s']:.1f} req/s, TTFT p50 "
                    f"{s['ttft_ms_p50']:.0f} ms p99 {s['ttft_ms_p99']:.0f} ms, "
                    f"errors {s['errors']}")
            finally:
                proc.stop()
    keys = ("req_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "errors")
    table = {d: {k: v for k, v in medians(runs[d]).items() if k in keys} for d in DEPLOYMENTS}
    print("\n| deployment | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | errors | "
          "gateway stages (mean ms) |\n|---|---|---|---|---|---|---|")
    for d, t in table.items():
        print(f"| {d} | {t['req_per_s']:.1f} | {t['ttft_ms_p50']:.0f} | {t['ttft_ms_p99']:.0f}"
              f" | {t['tpot_ms_p50']:.1f} | {t['errors']:.0f} | {stages.get(d, '-')} |")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"rounds": runs, "median": table, "stages": stages},
                                 indent=1))
    return 0 if all(t["errors"] == 0 for t in table.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
