"""The rival benchmark's report (rivals/run.py): one round's numbers per workload case
and deployment, answers against aggregated vLLM's, medians over the rounds, the table, the
ratios of ours to each rival, the JSON (and its details file) and the chart. No servers here:
tests/benchmarks/test_rivals_report.py runs it on made-up rounds."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.harness.plots import grouped_bars
from benchmarks.harness.report import medians, ms, percentile
from benchmarks.rivals.probe import Handoffs
from benchmarks.rivals.stacks import DEPLOYMENTS, EPD, RIVALS

# the keys --json promises for every (workload case, deployment)
KEYS = ("req_per_s", "ttft_p50_ms", "ttft_p99_ms", "decode_cpu_ms_per_req", "handoff_ms",
        "answers_equal")
# what the table and chart also show (medians over rounds too)
MORE = ("handoff_p99_ms", "bytes_moved_per_req", "errors", "encode_ms", "prefill_ms",
        "kv_first_token_ms")
OURS = tuple(d for d in DEPLOYMENTS if d.startswith("ours"))
# ours / rival pairs of the ratio lines: our E+PD stacks against vLLM's EC connectors, our
# E/P/D against vLLM's
PAIRS = tuple((o, r) for o in OURS if o not in EPD for r in RIVALS) + (("ours_epd",
                                                                         "vllm_epd"),)
# E/P/D hops, the gateway's and the fronts' per-request log fields -> row keys
HOPS = {"encode_ms": "encode_ms", "prefill_ms": "prefill_ms",
        "first_token_ms": "kv_first_token_ms"}
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\brequest rid=")
_FIELD = re.compile(r"(?<![\w])(encode_ms|prefill_ms|first_token_ms)=([0-9.]+)")


def summarize(run: Any, handoff: Handoffs | None) -> dict[str, Any]:
    """One round of one (case, deployment): `run` a workloads.Run, `handoff` what the
    probe saw in its window (None: no connector)."""
    answered = sum(a is not None for a in run.answers)
    ttft = [t for t in run.ttft if t is not None]
    out: dict[str, Any] = {
        "req_per_s": answered / run.duration_s if run.duration_s > 0 else 0.0,
        "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p99_ms": ms(percentile(ttft, 99)),
        "decode_cpu_ms_per_req": run.cpu.get("cpu_ms_decode"),
        "handoff_ms": None, "handoff_p99_ms": None, "bytes_moved_per_req": 0.0,
        "requests": len(run.answers), "errors": len(run.errors), **run.extra}
    if handoff is not None:
        out["handoff_ms"] = ms(percentile(handoff.seconds, 50))
        out["handoff_p99_ms"] = ms(percentile(handoff.seconds, 99))
        out["bytes_moved_per_req"] = handoff.bytes_placed / max(1, len(run.answers))
        out["handoffs"] = f"{len(handoff.seconds)} of {handoff.encodes} encodes"
    return out


def hop_times(lines: Iterable[str], t0: float, t1: float) -> dict[str, float]:
    """p50 of each E/P/D hop over the requests that ended within [t0, t1] (wall clock), from
    per-request log lines (`<asctime> ... request rid=... encode_ms=X prefill_ms=Y ...
    first_token_ms=Z ...`, local time, as the gateway and the fronts write them):
    {"encode_ms", "prefill_ms", "kv_first_token_ms"}, a key left out where no line had it.
    prefill_ms: the prefill request sent -> its answer read; kv_first_token_ms: the decode
    request (with the prefill's kv_transfer_params) sent -> the first chunk of its answer."""
    vals: dict[str, list[float]] = {}
    for line in lines:
        m = _STAMP.match(line)
        if not m:
            continue
        t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if not t0 <= t <= t1 + 0.5:  # the line is written just after the request ends
            continue
        for key, value in _FIELD.findall(line):
            vals.setdefault(HOPS[key], []).append(float(value))
    return {k: percentile(v, 50) for k, v in vals.items() if v}


def answers_equal(answers: list[Any], reference: list[Any] | None) -> bool | None:
    """Every answer given and equal to the reference's (None: no reference to compare)."""
    if reference is None:
        return None
    return len(answers) == len(reference) and all(
        a is not None and a == r for a, r in zip(answers, reference, strict=True))


def reference(rounds: Iterable[dict[str, Any]]) -> list[Any] | None:
    """Aggregated vLLM's answers for a case: its first round that answered every request."""
    for r in rounds:
        if r.get("answers") and all(a is not None for a in r["answers"]):
            return r["answers"]
    return None


def combine(results: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict]]:
    """{case: {deployment: [round, ...]}} -> {case: {deployment: medians + answers_equal +
    rounds}}, rounds being {"summary": ..., "answers": [...]}; a deployment with no round
    that ran is left out (its errors are in the details)."""
    out: dict[str, dict[str, dict]] = {}
    for case, per_dep in results.items():
        ref = reference(per_dep.get("aggregated", []))
        for dep in DEPLOYMENTS:
            rounds = per_dep.get(dep) or []
            if not rounds:
                continue
            row = medians([r["summary"] for r in rounds])
            equal = [answers_equal(r["answers"], ref) for r in rounds]
            row["answers_equal"] = (None if any(e is None for e in equal)
                                    else all(equal))
            row["rounds"] = len(rounds)
            out.setdefault(case, {})[dep] = row
    return out


def json_view(table: dict[str, dict[str, dict]]) -> dict[str, dict[str, dict]]:
    """What --json writes: the promised keys (and MORE) per case and deployment."""
    return {case: {dep: {k: row.get(k) for k in (*KEYS, *MORE, "rounds")}
                   for dep, row in per.items()} for case, per in table.items()}


def failed(table: dict[str, dict[str, dict]], left_out: dict[str, dict[str, str]]) -> list[str]:
    """Why the run fails (exit 1): answers differing from aggregated vLLM's, and our own
    deployments left out (vLLM's may be, with the error, when vLLM cannot run the case; ours
    where they do not support the model at all, stacks.Unsupported)."""
    why = [f"{case}/{dep}: answers differ from aggregated vLLM's"
           for case, per in table.items() for dep, row in per.items()
           if row.get("answers_equal") is False]
    why += [f"{case}/{dep}: did not run ({err[:200]})"
            for case, per in left_out.items() for dep, err in per.items()
            if dep in OURS and "Unsupported:" not in err]
    return why


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return f"{v:.{nd}f}"


def format_table(table: dict[str, dict[str, dict]], left_out: dict[str, dict[str, str]]
                 ) -> str:
    head = (f"{'':<15}{'req/s':>8}{'TTFT p50':>10}{'p99':>9}{'decode CPU':>12}"
            f"{'handoff p50':>13}{'p99':>9}{'MB moved':>10}{'prefill':>9}{'kv 1st tok':>12}"
            f"{'errors':>8}  answers = aggregated")
    lines = []
    for case in sorted(set(table) | set(left_out), key=_case_order):
        lines += ["", f"{case}  (ms; decode CPU per request; MB moved per request; E/P/D: "
                  "prefill hop and the decode request's first token, p50)", head]
        for dep, row in table.get(case, {}).items():
            lines.append(
                f"{dep:<15}{_f(row.get('req_per_s'), 2):>8}{_f(row.get('ttft_p50_ms')):>10}"
                f"{_f(row.get('ttft_p99_ms')):>9}{_f(row.get('decode_cpu_ms_per_req'), 2):>12}"
                f"{_f(row.get('handoff_ms'), 2):>13}{_f(row.get('handoff_p99_ms'), 2):>9}"
                f"{_f((row.get('bytes_moved_per_req') or 0) / 1e6, 2):>10}"
                f"{_f(row.get('prefill_ms')):>9}{_f(row.get('kv_first_token_ms')):>12}"
                f"{_f(row.get('errors'), 0):>8}  {_f(row.get('answers_equal'))}")
        for dep, err in left_out.get(case, {}).items():
            lines.append(f"{dep:<15}left out: {err[:300]}")
        lines += ratio_lines(table.get(case, {}))
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def ratio_lines(per: dict[str, dict]) -> list[str]:
    """Ours / each rival (PAIRS): req/s (>= 1.0 wanted), TTFT p99, handoff (and E/P/D's
    hops) (<= 1.0 wanted)."""
    out = []
    for ours, rival in PAIRS:
        o, r = per.get(ours), per.get(rival)
        if o is None or r is None:
            continue
        hops = "".join(f", {k} {_ratio(o.get(k), r.get(k))}"
                       for k in ("prefill_ms", "kv_first_token_ms") if k in o or k in r)
        out.append(f"  {ours} / {rival}: req/s {_ratio(o['req_per_s'], r['req_per_s'])}, "
                   f"TTFT p99 {_ratio(o['ttft_p99_ms'], r['ttft_p99_ms'])}, handoff "
                   f"{_ratio(o.get('handoff_ms'), r.get('handoff_ms'))}, decode CPU "
                   f"{_ratio(o.get('decode_cpu_ms_per_req'), r.get('decode_cpu_ms_per_req'))}"
                   + hops)
    return out


def _case_order(case: str) -> tuple:
    head, _, tail = case.partition("_")
    if case.endswith("_text"):  # light_text after light
        head, tail = case.removesuffix("_text"), "text"
    order = {"light": 0, "distinct": 1, "video": 2}.get(head, 3)
    if order == 2 and tail[:1].isdigit():
        n, _, k = tail.partition("x")
        return (order, int(n), int(k or 0))
    return (order, 0 if not tail else 1e9, 0)


PANELS = (("req_per_s", "requests / s", 1), ("ttft_p50_ms", "TTFT p50 (ms)", 1),
          ("ttft_p99_ms", "TTFT p99 (ms)", 1), ("decode_cpu_ms_per_req",
                                                "decode CPU per request (ms)", 1),
          ("handoff_ms", "handoff p50: encoder done -> placed (ms)", 1),
          ("bytes_moved_per_req", "MB moved per request", 1e-6))


def plot(table: dict[str, dict[str, dict]], path: Path) -> bool:
    """Grouped bars, one panel per figure, cases on the x axis, a bar per deployment."""
    cases = sorted(table, key=_case_order)
    deps = [d for d in DEPLOYMENTS if any(d in table[c] for c in cases)]
    return grouped_bars(table, cases, deps, PANELS, path)


def write(path: Path, table: dict[str, dict[str, dict]], details: dict[str, Any]) -> list[Path]:
    """The JSON (`path`), its details (`<stem>.details.json`: every round, the errors of
    left-out pairs, the arguments, how handoff is measured) and the chart (`<stem>.png`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_view(table), indent=1))
    extra = path.with_name(path.stem + ".details.json")
    extra.write_text(json.dumps(details, indent=1, default=str))
    written = [path, extra]
    png = path.with_suffix(".png")
    if table and plot(table, png):
        written.append(png)
    return written
