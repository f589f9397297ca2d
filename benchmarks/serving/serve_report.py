"""The serving benchmark's report (serving/serve.py): medians over repetitions, the results
table, CPU per request, the ratios to vLLM's example connector and to aggregated vLLM, the
gateway's overhead, what metadata-only saves; the JSON and the plot."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.harness.report import medians
from encoder_service.bench import format_table, plot, write_json

# The four deployments, as the table labels them
AGGREGATED = "aggregated vLLM"
EPD = "EPD gateway"
POOL = "EPD gateway, encoder pool"
EXAMPLE = "EPD ECExampleConnector"


def format_cpu(results: dict[str, dict]) -> str:
    """One line per deployment: CPU ms per request per server, each core's busy share."""
    lines = ["CPU per request (ms; vLLM servers: API server + EngineCore) and core busy share"]
    for label, s in results.items():
        servers = sorted({k.removeprefix("cpu_ms_").removesuffix("_api")
                          for k in s if k.startswith("cpu_ms_")})
        parts = []
        for name in servers:
            api = s.get(f"cpu_ms_{name}_api")
            total = s[f"cpu_ms_{name}"]
            parts.append(f"{name} {total:.2f}" + ("" if api is None else
                                                 f" ({api:.2f} + {total - api:.2f})"))
        busy = " / ".join(f"{s[k]:.2f}" for k in sorted(s) if k.startswith("busy_core"))
        lines.append(f"  {label}: {', '.join(parts)}; cores busy {busy}")
    return "\n".join(lines)


def format_overhead(o: dict) -> str:
    return (f"gateway overhead (non-streamed, cached image, {o['samples']} interleaved pairs): "
            f"direct p50 {o['direct_p50_ms']:.2f} ms, via gateway p50 "
            f"{o['gateway_p50_ms']:.2f} ms, added {o['added_p50_ms']:.2f} ms (paired median "
            f"{o['paired_median_added_ms']:.2f} ms; target < 1 ms)")


def summary_medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per deployment, the median of every number of its summary over the repetitions (a
    number missing from a repetition is left out of that median)."""
    return {label: medians(r[label].summary for r in runs) for label in runs[0]}


def print_report(runs: list[dict[str, Any]], a: argparse.Namespace, overhead: dict,
                 work: Path) -> None:
    """The whole report of `runs` (one dict of bench results per repetition, by label) to
    stdout; the last repetition's results (and the medians) to `work`/serve-bench.json/.png."""
    summaries = summary_medians(runs)
    print()
    mix = ", ".join(f"{k} {v:g}" for k, v in a.mix.items())
    print(f"{a.num_requests} requests, concurrency {a.concurrency}, {a.reuse:.0%} item reuse, "
          f"items {mix}, {a.max_tokens} output tokens, {a.model} on CPU"
          + (f"; medians of {a.repeat} interleaved repetitions" if a.repeat > 1 else ""))
    print(format_table(summaries))
    print(format_cpu(summaries))
    ex, agg_s = summaries[EXAMPLE], summaries[AGGREGATED]
    for label in (EPD, POOL):
        ours = summaries[label]
        print(f"ratios, {label} / ECExampleConnector: "
              f"req/s {ours['req_per_s'] / ex['req_per_s']:.2f}, "
              f"TTFT p50 {ours['ttft_ms_p50'] / ex['ttft_ms_p50']:.2f}, "
              f"TTFT p99 {ours['ttft_ms_p99'] / ex['ttft_ms_p99']:.2f}; "
              f"/ aggregated: req/s {ours['req_per_s'] / agg_s['req_per_s']:.2f}")
    print(format_overhead(overhead))
    pd = runs[0][EPD].summary.get("pd_ms")
    if pd:
        meta, raw = pd["metadata-only"], pd["raw media"]
        print("decode-side time per request, cached items (ms, medians): "
              + "; ".join(f"{k}: metadata-only {meta[k]:.1f} vs raw {raw[k]:.1f} "
                          f"({raw[k] / meta[k]:.2f}x)" for k in meta))
    write_json(runs[-1], work / "serve-bench.json",
               {"gateway_overhead": overhead, "medians": summaries, "repeat": a.repeat})
    plot(runs[-1], work / "serve-bench.png")
    print(f"wrote {work / 'serve-bench.json'} and {work / 'serve-bench.png'}")
    print(json.dumps(overhead))
