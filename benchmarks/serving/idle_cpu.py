"""Idle CPU of an E/P/D deployment, then a burst through it:

    flock /tmp/epd-vllm.lock .venv/bin/python -m benchmarks.serving.idle_cpu [--decode 3]
    EPD_NIXL_PROGRESS_THREAD=1 flock ... (vLLM's own NIXL agent: its progress thread on)

Starts `epd up --model tiny --prefill 1 --decode N --no-restart` (a vLLM encoder, a prefill
instance and N decode instances, NixlConnector on cpu buffers between them), waits for it,
then with no traffic samples the CPU time of every vLLM server's whole process tree (API
server, EngineCore, workers) from /proc over --idle-s seconds and prints each server's % of a
core, with its hottest thread. Then one burst: --burst concurrent chat requests for one new
image through the gateway, all to be answered within --burst-timeout-s. Then --sequential
requests one at a time (a new image each): client latency and, from /metrics, the gateway's
prefill hop and the decode instances' time to first token (vLLM's TTFT: the KV pull
included), mean over those requests.

Exit status 1 when a server used more than --max-idle-pct of a core idle, the burst was not
all answered in time or a KV handoff failed (the gateway's epd_kv_handoff_failures_total).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.harness.env import ROOT
from benchmarks.harness.procfs import HZ, children_map, cmdline, thread_ticks, tree
from benchmarks.harness.report import say
from encoder_service.local.processes import UpProcess, default_work_dir, metric_value
from encoder_service.local.requests import chat_body, sample_image_png
from encoder_service.local.testmodels import SPECS, build

WORK = default_work_dir(ROOT)
PORT = 20980  # gateway; servers 20981..; NIXL side channels after them (clear of the tests')
MODEL = "tiny-llava"


def vllm_servers(root: int) -> dict[str, tuple[int, int]]:
    """{role-i: (pid, port)} of the `vllm serve` processes under `root` (the topmost of each tree):
    encoder (ec_producer), prefill (a KV connector, no failure policy), decode."""
    kids = children_map()
    found: dict[str, list[tuple[int, int]]] = {}
    for pid in tree(root, kids):
        cmd = cmdline(pid)
        if "serve" not in cmd or "--port" not in cmd or "vllm_cli" not in " ".join(cmd):
            continue
        port = int(cmd[cmd.index("--port") + 1])
        kv = cmd[cmd.index("--kv-transfer-config") + 1] if "--kv-transfer-config" in cmd else ""
        role = ("encoder" if not kv else
                "decode" if "kv_load_failure_policy" in kv else "prefill")
        found.setdefault(role, []).append((port, pid))
    out = {}
    for role, rows in found.items():
        # a pinned server runs under `taskset`: keep the topmost process per port
        seen: dict[int, int] = {}
        for port, pid in rows:
            if port not in seen or pid in tree(seen[port], kids):
                seen.setdefault(port, pid)
        for i, (port, pid) in enumerate(sorted(seen.items())):
            out[f"{role}-{i}"] = (pid, port)
    return out


def idle_cpu(servers: dict[str, tuple[int, int]], seconds: float) -> dict[str, dict]:
    """Each server's process tree's CPU over `seconds`: % of a core, hottest thread."""
    kids = children_map()
    trees = {name: tree(pid, kids) for name, (pid, _) in servers.items()}
    before = {name: thread_ticks(pids) for name, pids in trees.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    after = {name: thread_ticks(pids) for name, pids in trees.items()}
    wall = time.monotonic() - t0
    out = {}
    for name in servers:
        deltas = {k: (v[0], v[1] - before[name].get(k, (v[0], v[1]))[1])
                  for k, v in after[name].items()}
        total = sum(d for _, d in deltas.values()) / HZ / wall * 100
        (pid, tid), (tname, ticks) = max(deltas.items(), key=lambda kv: kv[1][1])
        out[name] = {"pct": round(total, 1), "processes": len(trees[name]),
                     "hottest": f"{tname} (pid {pid} tid {tid}) "
                                f"{ticks / HZ / wall * 100:.1f}%"}
    return out


def ask(c: httpx.Client, url: str, image: bytes) -> float:
    """Seconds to the answer of one chat request (raises unless 200 with tokens)."""
    t0 = time.monotonic()
    r = c.post(url + "/v1/chat/completions", json=chat_body(MODEL, image, "what is this"))
    r.raise_for_status()
    assert r.json()["choices"][0]["message"]["content"] is not None
    return time.monotonic() - t0


def burst(url: str, n: int, timeout_s: float, seed: int) -> dict:
    """n concurrent requests for one new image; how many were answered, in what time."""
    image = sample_image_png(seed=seed)
    t0 = time.monotonic()
    with httpx.Client(timeout=timeout_s) as c, ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(ask, c, url, image) for _ in range(n)]
        lat, errors = [], []
        for f in futures:
            try:
                lat.append(f.result())
            except Exception as e:  # noqa: BLE001 - reported, counted
                errors.append(repr(e)[:200])
    wall = time.monotonic() - t0
    return {"answered": len(lat), "errors": errors, "wall_s": round(wall, 2),
            "latency_s_max": round(max(lat), 2) if lat else None,
            "ok": len(lat) == n and wall <= timeout_s}


def sums(text: str, metric: str, labels: str = "") -> tuple[float, float]:
    """(sum, count) of a histogram in a /metrics text."""
    return (metric_value(text, f"{metric}_sum{labels}"),
            metric_value(text, f"{metric}_count{labels}"))


def handoffs(url: str, decode_urls: list[str]) -> dict[str, float]:
    """The gateway's KV handoffs and failed ones, the prompt tokens the decode instances
    loaded through the KV connector and computed themselves."""
    with httpx.Client(timeout=10) as c:
        text = c.get(url + "/metrics").text
        out = {"handoffs": metric_value(text, "epd_kv_handoffs_total"),
               "failures": metric_value(text, "epd_kv_handoff_failures_total"),
               "external_kv_tokens": 0.0, "local_compute_tokens": 0.0}
        for u in decode_urls:
            for line in c.get(u + "/metrics").text.splitlines():
                if line.startswith("vllm:prompt_tokens_by_source_total{"):
                    for src in ("external_kv_transfer", "local_compute"):
                        if f'source="{src}"' in line:
                            key = "external_kv_tokens" if src[0] == "e" else "local_compute_tokens"
                            out[key] += float(line.rsplit(" ", 1)[1])
    return out


def drain(urls: list[str], timeout_s: float = 120.0) -> float:
    """Seconds until no server runs or queues a request (the burst's stragglers)."""
    t0 = time.monotonic()
    with httpx.Client(timeout=10) as c:
        while time.monotonic() - t0 < timeout_s:
            busy = sum(metric_value(c.get(u + "/metrics").text, m) for u in urls
                       for m in ("vllm:num_requests_running", "vllm:num_requests_waiting"))
            if not busy:
                break
            time.sleep(0.5)
    return time.monotonic() - t0


def sequential(url: str, decode_urls: list[str], n: int, seed: int) -> dict:
    """n requests one after another, a new image each: client latency, the gateway's prefill
    hop and first token, the decode instances' TTFT (means, ms)."""
    gw = "epd_gateway_stage_seconds"
    with httpx.Client(timeout=60) as c:
        def snapshot() -> dict[str, tuple[float, float]]:
            text = c.get(url + "/metrics").text
            ttft = [sums(c.get(u + "/metrics").text, "vllm:time_to_first_token_seconds")
                    for u in decode_urls]
            return {"gateway_prefill": sums(text, gw, '{stage="prefill"}'),
                    "gateway_first_token": sums(text, gw, '{stage="first_token"}'),
                    "decode_ttft": (sum(s for s, _ in ttft), sum(k for _, k in ttft))}

        before = snapshot()
        lat = [ask(c, url, sample_image_png(seed=seed + i)) * 1e3 for i in range(n)]
        time.sleep(1.5)  # vLLM publishes its histograms a step or so later
        after = snapshot()
    out = {"client_ms_median": round(statistics.median(lat), 1),
           "client_ms": [round(x, 1) for x in lat]}
    for k in after:
        ds, dn = after[k][0] - before[k][0], after[k][1] - before[k][1]
        out[k + "_ms_mean"] = round(ds / dn * 1e3, 1) if dn else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decode", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--settle-s", type=float, default=5.0,
                    help="wait this long after ready before sampling")
    ap.add_argument("--max-idle-pct", type=float, default=5.0)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--burst-timeout-s", type=float, default=60.0)
    ap.add_argument("--sequential", type=int, default=5)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000,
                    help="images: new to the deployment's caches")
    ap.add_argument("--json", type=Path, default=WORK / "idle-cpu-bench.json")
    a = ap.parse_args()
    model = build(WORK / "models" / "tiny-llava", SPECS["tiny"])
    knob = os.environ.get("EPD_NIXL_PROGRESS_THREAD", "")
    say(f"EPD_NIXL_PROGRESS_THREAD={knob or '(unset)'}: NIXL progress thread "
        f"{'on' if knob.strip().lower() in ('1', 'true', 'on', 'yes') else 'off'}")
    up = UpProcess({"model": str(model), "base_port": PORT}, WORK / "idle-cpu-bench",
                   args=["--prefill", "1", "--decode", str(a.decode), "--no-restart"])
    result: dict = {"knob": knob, "decode": a.decode}
    t0 = time.monotonic()
    up.start()
    try:
        up.wait(600)
        say(f"ready after {time.monotonic() - t0:.0f} s")
        servers = vllm_servers(up.proc.pid)
        time.sleep(a.settle_s)
        cpu = idle_cpu(servers, a.idle_s)
        result["idle"] = cpu
        with open("/proc/loadavg") as f:
            result["loadavg"] = f.read().split()[:3]
        say(f"idle {a.idle_s:.0f} s, % of a core per server (process tree); "
            f"load average {' '.join(result['loadavg'])}:")
        for name, row in sorted(cpu.items()):
            print(f"  {name:10s} {row['pct']:6.1f}%  ({row['processes']} processes; "
                  f"hottest thread {row['hottest']})")
        b = burst(up.url, a.burst, a.burst_timeout_s, a.seed)
        result["burst"] = b
        errors = f"; errors {b['errors']}" if b["errors"] else ""
        say(f"burst: {b['answered']}/{a.burst} answered in {b['wall_s']} s "
            f"(slowest {b['latency_s_max']} s){errors}")
        urls = {name: f"http://127.0.0.1:{port}" for name, (_, port) in servers.items()}
        decode_urls = [u for name, u in urls.items() if name.startswith("decode")]
        say(f"drained after {drain(list(urls.values())):.1f} s; KV handoffs "
            f"{handoffs(up.url, decode_urls)}")
        if a.sequential:
            s = sequential(up.url, decode_urls, a.sequential, a.seed + 1000)
            result["sequential"] = s
            result["handoffs"] = handoffs(up.url, decode_urls)
            say(f"{a.sequential} sequential requests: client median "
                f"{s['client_ms_median']} ms; means: gateway prefill hop "
                f"{s['gateway_prefill_ms_mean']} ms, first token "
                f"{s['gateway_first_token_ms_mean']} ms; decode TTFT "
                f"{s['decode_ttft_ms_mean']} ms; KV handoffs {result['handoffs']}")
    finally:
        up.stop()
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1))
    hot = [n for n, r in result.get("idle", {}).items() if r["pct"] > a.max_idle_pct]
    if hot:
        say(f"FAIL: above {a.max_idle_pct}% of a core idle: {', '.join(hot)}")
    burst_ok = result.get("burst", {}).get("ok")
    if not burst_ok:
        say("FAIL: the burst was not answered in time")
    failed = result.get("handoffs", {}).get("failures")
    if failed:
        say(f"FAIL: {failed:.0f} KV handoffs failed (decode computed the prompt)")
    return 1 if hot or not burst_ok or failed else 0


if __name__ == "__main__":
    sys.exit(main())
