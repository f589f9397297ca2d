"""Ours beside vLLM's own EC connectors: the same requests, cores and front end for every
deployment, rounds interleaved, every answer's tokens compared with aggregated vLLM's.

    flock /tmp/epd-vllm.lock .venv/bin/python -m benchmarks.rivals.run \
        [--workloads light distinct video video_with_images] [--rounds 3] [--quick] \
        [--deployments ...] [--epd] [--json FILE]

Deployments (stacks.py): `aggregated` (plain vLLM, the reference for answers),
`ec_example` (E+PD, vLLM's ECExampleConnector), `ec_mooncake` (E+PD, vLLM's
ECMooncakeConnector over TCP, driven by mooncake_front.py), `ours_shm`, `ours_te` (vLLM encoder
+ EPDConnector over shared memory / the Mooncake Transfer Engine) and `ours_pool_shm` (our
encoder pool); not by default, `ours_nixl` (the same over NIXL) and E/P/D (`--epd` =
`--deployments aggregated vllm_epd ours_epd vllm_pd_text vllm_pd_router`): `vllm_epd` (vLLM's
disaggregated-encoder proxy flow: ECExampleConnector encoder, prefill and decode
instances with NixlConnector, epd_front.py in front), `ours_epd` (`epd up --prefill 1
--decode 1`, shm) and
`vllm_pd_text` (vLLM's P/D alone on text prompts: cases light_text and distinct_text, which
aggregated then runs too, for the answers) and `vllm_pd_router` (the same instances
behind vLLM's Rust router in its P/D mode). Workloads (workloads.py): `light`,
`distinct`, `video` (cases video_<frames>x<at once>) and `video_with_images`. Each round
starts every deployment fresh, in order (A B C D, A B C D, ...), once per model (tiny LLaVA
for light and distinct, qwen3-vl-video for the rest), and runs the round's workloads on it.

Per workload case and deployment, medians over the rounds: req/s, TTFT p50/p99, decode CPU
per request (harness/load.py's CpuMeter: the prefill/decode instance's API server + EngineCore;
aggregated: its one server), bytes moved to the prefill/decode instance per request, and the
handoff (probe.py: encoder output done -> placed in the prefill/decode instance's
encoder cache, timestamps from every connector the same way), and whether every answer
equals aggregated vLLM's (token ids; `distinct`: the text `vllm bench serve` returns). A
difference fails the run (exit 1), as does one of ours that did not run; a rival that cannot
run a case (vLLM's error) is left out and reported with its error. `--json FILE` (default
.work/rivals/rivals.json) gets `{case: {deployment: {req_per_s, ttft_p50_ms, ttft_p99_ms,
decode_cpu_ms_per_req, handoff_ms, answers_equal, ...}}}` (E/P/D rows also `prefill_ms`,
the prefill hop, and `kv_first_token_ms`, the decode request sent -> its first chunk: p50
over the window's requests from the front's per-request log lines), FILE's `.details.json` every
round and error, its `.png` the chart.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.harness.env import ROOT
from benchmarks.harness.report import say
from benchmarks.rivals.probe import handoffs, read_events
from benchmarks.rivals.report import combine, failed, format_table, hop_times, summarize, write
from benchmarks.rivals.stacks import (
    DEFAULT_DEPLOYMENTS,
    DEPLOYMENTS,
    EPD,
    TEXT_ONLY,
    Unsupported,
    start,
)
from benchmarks.rivals.workloads import GROUP_OF, RUNNERS, TEXT_CASES, TEXT_RUNNERS, WORKLOADS
from encoder_service.local.processes import default_work_dir

HANDOFF = ("per encode: the producer's save_caches call (the pool: its publish) -> the "
           "first time the item appears in the consumer's encoder cache after it "
           "(start_load_caches), wall clock, every connector wrapped alike "
           "(benchmarks/rivals/probe.py); p50 over the round's encodes")


def case_names(workload: str, a: argparse.Namespace) -> list[str]:
    if workload == "video":
        return [f"video_{n}x{k}" for n in a.frames for k in (1, 4)]
    return [workload]


def runners(dep: str, workload: str, a: argparse.Namespace) -> list[tuple[Any, list[str]]]:
    """(runner, its case names) of `workload` on `dep`: a text-only deployment runs the
    workload's text (none for video: Unsupported), aggregated both when one is selected."""
    plain = (RUNNERS[workload], case_names(workload, a))
    text = ((TEXT_RUNNERS[workload], [TEXT_CASES[workload]])
            if workload in TEXT_RUNNERS else None)
    if dep in TEXT_ONLY:
        return [text] if text else []
    if dep == "aggregated" and text and any(d in TEXT_ONLY for d in a.deployments):
        return [plain, text]
    return [plain]


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())[:1500]


def run_deployment(dep: str, group: str, workloads: list[str], rnd: int,
                   a: argparse.Namespace, results: dict, errors: dict) -> None:
    """Start `dep` fresh on `group`'s model, run `workloads` on it, stop it."""
    probe_dir = a.work / "probe" / dep

    def fail(wl: str, exc: BaseException, cases: list[str] | None = None) -> None:
        what = "not run" if isinstance(exc, Unsupported) else "FAILED"
        say(f"round {rnd} {dep} {wl}: {what}: {_error(exc)[:400]}")
        for case in cases or case_names(wl, a):
            errors.setdefault(case, {}).setdefault(dep, []).append(
                f"round {rnd}: {_error(exc)}")

    say(f"round {rnd}: starting {dep} ({group})")
    try:
        stack = start(dep, group, a.work, a.models, probe_dir, say)
    except Exception as exc:  # noqa: BLE001 - reported and left out, the run goes on
        for wl in workloads:
            fail(wl, exc)
        return
    jobs = [(wl, job) for wl in workloads for job in runners(dep, wl, a)]
    for wl in workloads:
        if not runners(dep, wl, a):
            fail(wl, Unsupported(f"{dep} serves text only: {wl} has no text case"))
    try:
        for wl, (runner, cases) in jobs:
            try:
                runs = runner(stack, a)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                fail(wl, exc, cases)
                continue
            time.sleep(0.5)  # the probe's (and the front's) last lines
            events = read_events(probe_dir)
            for case, run in runs.items():
                h = (None if dep == "aggregated" or stack.text_only
                     else handoffs(events, run.t0, run.t1))
                if stack.hop_log is not None:
                    lines = stack.hop_log.read_text(errors="replace").splitlines()
                    run.extra.update(hop_times(lines, run.t0, run.t1))
                s = summarize(run, h)
                results.setdefault(case, {}).setdefault(dep, []).append(
                    {"round": rnd, "summary": s, "cpu": run.cpu, "answers": run.answers,
                     "first_errors": run.errors[:3]})
                handoff = "-" if s["handoff_ms"] is None else f"{s['handoff_ms']:.2f} ms"
                hops = "".join(f", {k} {s[k]:.1f}" for k in
                               ("encode_ms", "prefill_ms", "kv_first_token_ms") if k in s)
                say(f"round {rnd} {dep} {case}: {s['req_per_s']:.2f} req/s, TTFT p50 "
                    f"{s['ttft_p50_ms'] or 0:.1f} p99 {s['ttft_p99_ms'] or 0:.1f} ms, "
                    f"handoff p50 {handoff}{hops}, errors {s['errors']}"
                    + (f" (first: {run.errors[0][:200]})" if run.errors else ""))
    finally:
        stack.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--deployments", nargs="+", choices=DEPLOYMENTS,
                   default=list(DEFAULT_DEPLOYMENTS))
    p.add_argument("--epd", action="store_true",
                   help="E/P/D: --deployments aggregated " + " ".join(EPD))
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    p.add_argument("--requests", type=int, default=200, help="light and distinct")
    p.add_argument("--frames", type=int, nargs="+", default=[6, 30, 120])
    p.add_argument("--lag-ms", type=float, default=300.0,
                   help="video_with_images: the images follow the video by this much")
    p.add_argument("--distinct-client", choices=["vllm", "ours"], default="vllm",
                   help="distinct: vLLM's `vllm bench serve` (random-mm) or this client")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 1 round, 24 requests, 6-frame clips only")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.epd:
        a.deployments = ["aggregated", *EPD]
    if a.quick:
        a.rounds, a.requests, a.frames = 1, 24, [6]
    if any(not 2 <= n <= 128 for n in a.frames):
        p.error("--frames: 2 to 128 frames per clip (the servers keep 128)")
    a.work = default_work_dir(ROOT) / "rivals"
    a.models = default_work_dir(ROOT) / "models"
    a.json = a.json or a.work / "rivals.json"
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    groups: dict[str, list[str]] = {}
    for wl in a.workloads:
        groups.setdefault(GROUP_OF[wl], []).append(wl)
    results: dict[str, dict[str, list[dict]]] = {}
    errors: dict[str, dict[str, list[str]]] = {}
    t0 = time.monotonic()
    for rnd in range(1, a.rounds + 1):
        for group, workloads in groups.items():
            for dep in a.deployments:
                run_deployment(dep, group, workloads, rnd, a, results, errors)
    table = combine(results)
    left_out = {case: {dep: " || ".join(errs) for dep, errs in per.items()
                       if dep not in table.get(case, {})} for case, per in errors.items()}
    left_out = {c: d for c, d in left_out.items() if d}
    print(format_table(table, left_out))
    details: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(a).items()}, "handoff": HANDOFF,
        "minutes": round((time.monotonic() - t0) / 60, 1), "left_out": left_out,
        "errors": errors,
        "rounds": {case: {dep: [{k: v for k, v in r.items() if k != "answers"} for r in rs]
                          for dep, rs in per.items()} for case, per in results.items()}}
    for path in write(a.json, table, details):
        print(f"wrote {path}")
    why = failed(table, left_out)
    for line in why:
        print(f"FAILED: {line}")
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
