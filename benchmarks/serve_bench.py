"""Serving benchmark on a tiny test model, one run, four deployments on this machine's cores:

1. aggregated vLLM (one server: encoder + prefill/decode in one process);
2. EPD through this gateway: vLLM encoder (ec_producer) + vLLM prefill/decode (ec_consumer),
   EPDConnector over the safetensors transport, the gateway as its own process (it skips
   stored items and sends the decode request while new items are encoded: routing.overlap);
3. the same with this project's encoder pool (`epd encoder`) in place of the vLLM encoder,
   on the same core: the whole stack as a user deploys it (`epd up --encoder-backend pool`);
4. EPD with vLLM's ECExampleConnector: the same two vLLM servers and the same gateway (item
   ids, routing), vLLM's example connector instead of ours (no availability lookup and no
   overlap: it has neither). Each EPD server runs whole on its own core (taskset), the
   aggregated server on both.

Each gets the same `epd bench serve` workload (default 200 streamed requests, concurrency 8,
50% image reuse, 16 output tokens). Then the gateway's own overhead: the same non-streamed
request (an image already encoded) sent directly to the decode instance and through the
gateway, interleaved, p50 of each.

On a Qwen model (`--spec qwen-omni`: image, video and audio items, `--mix`) the decode
instance gets metadata-only parts; the run also measures what that saves: the same cached
items through a second gateway that forwards raw media (`media.metadata_only = false`) to the
same decode instance, interleaved, decode-side time per request.

    flock /tmp/epd-heavy.lock .venv/bin/python benchmarks/serve_bench.py [--spec qwen-omni]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ec_connectors.child_process import popen  # noqa: E402
from ec_connectors.protocol.keys import content_item_id  # noqa: E402
from ec_connectors.protocol.params import ItemEntry, TransferParams  # noqa: E402
from encoder_service.bench import (  # noqa: E402
    BenchSpec,
    format_table,
    item_part,
    parse_mix,
    plot,
    run_bench,
    write_json,
)
from encoder_service.gateway.availability import SafetensorsAvailability  # noqa: E402
from encoder_service.gateway.config import GatewayConfig  # noqa: E402
from encoder_service.local.processes import (  # noqa: E402
    ManagedProcess,
    PoolServer,
    VllmServer,
    metric_value,
    start_all,
)
from encoder_service.local.requests import chat_body, parts_body, sample_image_png  # noqa: E402
from encoder_service.local.testmodels import SPECS, build  # noqa: E402
from encoder_service.local.up import epd_config  # noqa: E402

MODEL = "tiny-llava"  # the served name of --spec (set in main)
POOL = "EPD gateway, encoder pool"
PORT = 18590  # 18590-18599


def say(msg: str) -> None:
    print(f"[serve-bench] {msg}", flush=True)


def example_config(role: str, storage: Path) -> dict:
    return {"ec_connector": "ECExampleConnector", "ec_role": role, "ec_buffer_device": "cpu",
            "ec_connector_extra_config": {"shared_storage_path": str(storage)}}


class GatewayProcess:
    """`epd gateway` as its own process (as deployed), stopped with SIGTERM."""

    def __init__(self, port: int, encoders: list[str], decoders: list[str],
                 storage: Path | None, log: Path, config: dict | None = None) -> None:
        cmd = [sys.executable, "-m", "encoder_service.cli", "gateway", "--port", str(port),
               "--model", MODEL]
        if config:
            path = log.with_suffix(".json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(config))
            cmd += ["--config", str(path)]
        cmd += [x for u in encoders for x in ("--encoder", u)]
        cmd += [x for u in decoders for x in ("--decoder", u)]
        if storage is not None:
            cmd += ["--storage-path", str(storage)]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"gateway did not become healthy; log {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class CpuMeter:
    """CPU time per request of each server (its process tree: for a vLLM server the API
    server, `api`, and EngineCore, the rest) and each core's busy share, over the measured
    run. Where a deployment's req/s comes from: a core at 1.00 is the bound, and the ms per
    request on it say whose work fills it."""

    def __init__(self, servers: dict[str, int]) -> None:
        self.servers = servers  # name -> root pid

    @staticmethod
    def _tree(pid: int) -> tuple[float, float]:
        """(root, children) CPU seconds of a process tree (children gone: not counted)."""
        root = psutil.Process(pid)
        kids = 0.0
        for ch in root.children(recursive=True):
            try:
                t = ch.cpu_times()
                kids += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        t = root.cpu_times()
        return t.user + t.system, kids

    def _snap(self) -> tuple[dict[str, tuple[float, float]], list]:
        return ({n: self._tree(p) for n, p in self.servers.items()},
                psutil.cpu_times(percpu=True))

    def start(self) -> None:
        self.t0 = self._snap()

    def stop(self, requests: int) -> dict[str, float]:
        """Flat numbers (medians are taken over repetitions): `cpu_ms_<server>` and
        `cpu_ms_<server>_api` per request, `busy_core<i>`."""
        (s0, c0), (s1, c1) = self.t0, self._snap()
        out: dict[str, float] = {}
        for name in self.servers:
            (r0, k0), (r1, k1) = s0[name], s1[name]
            out[f"cpu_ms_{name}"] = round(((r1 - r0) + (k1 - k0)) * 1e3 / requests, 2)
            if k1 - k0 > 0:
                out[f"cpu_ms_{name}_api"] = round((r1 - r0) * 1e3 / requests, 2)
        for i, (a, b) in enumerate(zip(c0, c1, strict=True)):
            total = sum(b) - sum(a)
            idle = (b.idle + getattr(b, "iowait", 0)) - (a.idle + getattr(a, "iowait", 0))
            out[f"busy_core{i}"] = round(1 - idle / total, 2) if total > 0 else 0.0
        return out


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


def warm(url: str, n: int = 4) -> None:
    with httpx.Client(timeout=120) as c:
        for i in range(n):
            r = c.post(url + "/v1/chat/completions",
                       json=chat_body(MODEL, sample_image_png(seed=90_000 + i), "warm up",
                                      max_tokens=4))
            r.raise_for_status()


def bench(url: str, label: str, a: argparse.Namespace, meter: CpuMeter | None = None):
    warm(url)
    # A burst at the measured concurrency first (other images): the first batches of each
    # shape cost a fresh server far more (oneDNN primitives), whichever deployment runs first.
    asyncio.run(run_bench(BenchSpec(url=url, model=MODEL, num_requests=4 * a.concurrency,
                                    concurrency=a.concurrency, reuse=a.reuse,
                                    max_tokens=a.max_tokens, label="warm-up", mix=a.mix,
                                    seed=97), progress=False))
    spec = BenchSpec(url=url, model=MODEL, num_requests=a.num_requests,
                     concurrency=a.concurrency, reuse=a.reuse, max_tokens=a.max_tokens,
                     label=label, mix=a.mix)
    if meter is not None:
        meter.start()
    res = asyncio.run(run_bench(spec, progress=True))
    if meter is not None:
        res.summary.update(meter.stop(a.num_requests))
    say(f"{label}: {res.summary['req_per_s']:.2f} req/s, "
        f"TTFT p50 {res.summary['ttft_ms_p50']:.1f} ms, errors {res.summary['errors']}")
    return res


def gateway_overhead(gw_url: str, dec_url: str, samples: int) -> dict:
    """p50 of direct-to-decode vs through-the-gateway for the same non-streamed request."""
    image = sample_image_png(seed=91_000)
    item = content_item_id(image, MODEL)
    via_gw = chat_body(MODEL, image, "describe", max_tokens=4)
    direct = chat_body(MODEL, image, "describe", item_id=item, max_tokens=4,
                       ec_transfer_params=TransferParams(items={item: ItemEntry()}).to_dict())
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    with httpx.Client(timeout=60) as c:
        c.post(gw_url + "/v1/chat/completions", json=via_gw).raise_for_status()  # encode once
        for i in range(samples + 10):
            order = (("direct", dec_url, direct), ("gateway", gw_url, via_gw))
            for name, url, body in (order if i % 2 else order[::-1]):
                t = time.perf_counter()
                c.post(url + "/v1/chat/completions", json=body).raise_for_status()
                if i >= 10:  # first 10 rounds: warm-up
                    times[name].append(time.perf_counter() - t)
    d, g = statistics.median(times["direct"]), statistics.median(times["gateway"])
    paired = statistics.median(b - a for a, b in zip(times["direct"], times["gateway"],
                                                     strict=True))
    return {"samples": samples, "direct_p50_ms": d * 1e3, "gateway_p50_ms": g * 1e3,
            "added_p50_ms": (g - d) * 1e3, "paired_median_added_ms": paired * 1e3}


def pd_time(meta_url: str, raw_url: str, a: argparse.Namespace, samples: int = 40) -> dict:
    """The decode instance's time per request (the gateway's first_token stage: decode
    request sent -> first byte) for the same cached items, metadata-only vs raw media,
    interleaved; per modality and overall medians."""
    spec = BenchSpec(url="", mix=a.mix, seed=7)
    items = [item_part(spec, i) for i in range(12)]
    stage = 'epd_gateway_stage_seconds_sum{stage="first_token"}'
    times: dict[str, dict[str, list[float]]] = {"metadata-only": {}, "raw media": {}}
    with httpx.Client(timeout=120) as c:
        def one(url: str, part: dict) -> float:
            before = metric_value(c.get(url + "/metrics").text, stage)
            r = c.post(url + "/v1/chat/completions",
                       json=parts_body(MODEL, [part], "describe", max_tokens=1))
            r.raise_for_status()
            return metric_value(c.get(url + "/metrics").text, stage) - before

        for _, part in items:  # encode once, so both sides only load
            one(meta_url, part)
        for i in range(samples):
            modality, part = items[i % len(items)]
            order = (("metadata-only", meta_url), ("raw media", raw_url))
            for name, url in (order if i % 2 else order[::-1]):
                times[name].setdefault(modality, []).append(one(url, part))
                times[name].setdefault("all", []).append(times[name][modality][-1])
    return {name: {k: round(statistics.median(v) * 1e3, 2) for k, v in per.items()}
            for name, per in times.items()}


_STAND_IN_ANSWER = msgspec.json.encode({
    "id": "stand-in", "object": "chat.completion", "model": "stand-in",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


def serve_stand_in(port: int, delay_s: float = 0.0) -> None:
    """A decode instance that answers every chat request after `delay_s` (`--stand-in
    PORT`)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def chat(request):
        await request.body()
        if delay_s:
            await asyncio.sleep(delay_s)
        return Response(_STAND_IN_ANSWER, media_type="application/json")

    async def ok(request):
        return Response(b"{}", media_type="application/json")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/health", ok)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error")


def isolated_overhead(work: Path, samples: int, delay_ms: float = 0.0) -> dict:
    """The gateway's own overhead: the gateway process and a stand-in decode instance that
    answers after `delay_ms` (0: at once), no vLLM beside them; the image is already
    available (a stored file)."""
    storage = work / "store-isolated"
    shutil.rmtree(storage, ignore_errors=True)
    cfg = GatewayConfig.build({"model": MODEL, "decoders": ["http://127.0.0.1:1"]})
    item = content_item_id(sample_image_png(seed=91_000), MODEL)
    path = Path(SafetensorsAvailability(storage, cfg.namespace).path_for(item))
    path.parent.mkdir(parents=True)
    path.touch()
    port = PORT + 7
    stand_in = StandIn("stand-in", port + 1, work, delay_ms=delay_ms).start()
    gw = None
    try:
        stand_in.wait(30)
        gw = GatewayProcess(port, [], [stand_in.url], storage,
                            work / "logs" / "gateway-isolated.log",
                            config={"routing": {"probe_interval_s": 0}})
        return gateway_overhead(gw.url, stand_in.url, samples)
    finally:
        if gw is not None:
            gw.stop()
        stand_in.stop()


@dataclass
class StandIn(ManagedProcess):
    """This script as a stand-in decode instance (`--stand-in PORT`)."""

    name: str
    port: int
    work_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    delay_ms: float = 0.0

    def command(self) -> list[str]:
        return [sys.executable, __file__, "--stand-in", str(self.port),
                "--stand-in-delay-ms", str(self.delay_ms)]


def format_overhead(o: dict) -> str:
    return (f"gateway overhead (non-streamed, cached image, {o['samples']} interleaved pairs): "
            f"direct p50 {o['direct_p50_ms']:.2f} ms, via gateway p50 "
            f"{o['gateway_p50_ms']:.2f} ms, added {o['added_p50_ms']:.2f} ms (paired median "
            f"{o['paired_median_added_ms']:.2f} ms; target < 1 ms)")


CONNECTOR_STAGES = ("save_wait", "save", "loader_wait", "get", "load", "staged_to_scheduled",
                    "defer", "pending")
# vLLM's own view of a request on each server (queued, then prefill, end to end): the
# gateway's encode / first_token stage minus these is HTTP, the API server and the gateway.
VLLM_STAGES = ("request_queue_time", "request_prefill_time", "e2e_request_latency")
GATEWAY_STAGES = ("parse", "encode", "first_token", "total")


def stage_means(gw_url: str, servers: list[VllmServer | PoolServer]) -> dict[str, dict[str, float]]:
    """Mean milliseconds per stage over the run, from /metrics: the gateway's
    `epd_gateway_stage_seconds{stage}`, each server's `vllm:epd_<stage>_seconds` and
    vLLM's own request stages (VLLM_STAGES)."""
    out: dict[str, dict[str, float]] = {}
    with httpx.Client(timeout=10) as c:
        text = c.get(gw_url + "/metrics").text
        out["gateway"] = {}
        for st in GATEWAY_STAGES:
            n = metric_value(text, f'epd_gateway_stage_seconds_count{{stage="{st}"}}')
            if n:
                total = metric_value(text, f'epd_gateway_stage_seconds_sum{{stage="{st}"}}')
                out["gateway"][st] = round(total / n * 1e3, 2)
        for s in servers:
            text = c.get(s.url + "/metrics").text
            out[s.name] = {}
            names = [(st, f"vllm:epd_{st}_seconds") for st in CONNECTOR_STAGES]
            names += [(st, f"vllm:{st}_seconds") for st in VLLM_STAGES]
            for st, metric in names:
                n = metric_value(text, f"{metric}_count")
                if n:
                    out[s.name][st] = round(metric_value(text, f"{metric}_sum") / n * 1e3, 2)
    return out


def epd_run(model: Path, work: Path, label: str, make_cfg, availability: bool,
            a: argparse.Namespace, port: int, overhead: bool, compare_raw: bool = False,
            pool: bool = False):
    """One EPD deployment: an encoder on core 0 (a vLLM ec_producer, or with `pool` the
    project's encoder pool), a vLLM decode instance on core 1, the gateway; one bench."""
    storage = work / f"store-{port}"
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    enc: VllmServer | PoolServer
    if pool:
        enc = PoolServer(f"pool-{port}", model, port + 1, work, cpu_core=0, served_name=MODEL,
                         pool_config={"transport": {"storage_path": str(storage)}})
    else:
        enc = VllmServer(f"encoder-{port}", model, port + 1, work,
                         make_cfg("ec_producer", storage), cpu_core=0, served_name=MODEL)
    dec = VllmServer(f"decode-{port}", model, port + 2, work,
                     make_cfg("ec_consumer", storage), cpu_core=1, served_name=MODEL)
    start_all([enc, dec], progress=say)
    gw = None
    try:
        # Without our connector's availability the gateway neither skips stored items nor
        # overlaps encodes with the decode request (vLLM's connectors would encode a pending
        # item themselves): routing.overlap stays off there.
        config: dict = {} if availability else {"routing": {"overlap": "off"}}
        if pool:
            config["encoder_backend"] = "pool"
        gw = GatewayProcess(port, [enc.url], [dec.url], storage if availability else None,
                            work / "logs" / f"gateway-{port}.log", config=config or None)
        res = bench(gw.url, label, a, CpuMeter({"encoder": enc.proc.pid,
                                                "decode": dec.proc.pid,
                                                "gateway": gw.proc.pid}))
        time.sleep(1.5)  # vLLM publishes connector stats with its next metrics update
        stages = stage_means(gw.url, [enc, dec])
        say(f"{label}: mean ms per stage: {json.dumps(stages)}")
        res.summary["stages_ms"] = stages
        ovh = gateway_overhead(gw.url, dec.url, a.overhead_samples) if overhead else None
        if compare_raw:
            raw = GatewayProcess(port + 9, [enc.url], [dec.url], storage,
                                 work / "logs" / f"gateway-raw-{port}.log",
                                 config={"media": {"metadata_only": False}})
            try:
                res.summary["pd_ms"] = pd_time(gw.url, raw.url, a)
                say(f"decode time per request (ms, medians): {json.dumps(res.summary['pd_ms'])}")
            finally:
                raw.stop()
        return res, ovh
    finally:
        if gw is not None:
            gw.stop()
        enc.stop()
        dec.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--reuse", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--overhead-samples", type=int, default=400)
    p.add_argument("--repeat", type=int, default=1,
                   help="repetitions of the four runs, interleaved; the table shows medians")
    p.add_argument("--overhead-isolated", action="store_true",
                   help="only the gateway overhead against a stand-in decode instance that "
                   "answers at once or after --stand-in-delay-ms (no vLLM)")
    p.add_argument("--stand-in", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--stand-in-delay-ms", type=float, default=0.0,
                   help="--overhead-isolated: the stand-in answers after this long, as a "
                   "real decode instance does (the gateway then sleeps between its two "
                   "hops, and pays the machine's wake-up latency twice)")
    p.add_argument("--overhead-only", action="store_true",
                   help="only the gateway overhead (one EPD deployment, no load runs)")
    p.add_argument("--spec", choices=["tiny", "heavy", "qwen-vl", "qwen-omni"], default="tiny",
                   help="heavy: a vision tower that costs far more than a decode step; "
                   "qwen-*: metadata-only requests to the decode instance")
    p.add_argument("--mix", help="item modalities and weights (epd bench serve --mix); "
                   "default: image, or image=1,video=1,audio=1 (qwen-omni), image=1,video=1 "
                   "(qwen-vl)")
    p.add_argument("--out", type=Path, default=ROOT / ".work" / "bench")
    a = p.parse_args()
    global MODEL
    spec = SPECS[a.spec]
    MODEL = spec.model_name
    if a.stand_in:
        serve_stand_in(a.stand_in, a.stand_in_delay_ms / 1e3)
        return 0
    if a.overhead_isolated:
        print(format_overhead(isolated_overhead(a.out, a.overhead_samples,
                                                a.stand_in_delay_ms)))
        return 0
    a.mix = parse_mix(a.mix or ",".join(f"{m}=1" for m in spec.modalities))
    qwen = spec.family != "llava"
    work = a.out
    model = build(ROOT / ".work" / "models" / spec.model_name, spec)
    if a.overhead_only:
        a.num_requests = 8
        _, overhead = epd_run(model, work, "EPD gateway", epd_config, True, a, PORT + 3,
                              overhead=True)
        print(format_overhead(overhead))
        return 0
    runs: list[dict] = []
    overhead = None
    for rep in range(1, a.repeat + 1):
        tag = f"[{rep}/{a.repeat}] " if a.repeat > 1 else ""
        results = {}
        say(f"{tag}1/4 aggregated vLLM (one server, all cores)")
        agg = VllmServer("aggregated", model, PORT, work, None, served_name=MODEL)
        start_all([agg], progress=say)
        try:
            results["aggregated vLLM"] = bench(agg.url, "aggregated vLLM", a,
                                               CpuMeter({"aggregated": agg.proc.pid}))
        finally:
            agg.stop()
        say(f"{tag}2/4 EPD through the gateway (EPDConnector, safetensors; vLLM encoder core 0, "
            "decode 1)")
        results["EPD gateway"], ovh = epd_run(model, work, "EPD gateway", epd_config, True,
                                              a, PORT + 3, overhead=overhead is None,
                                              compare_raw=qwen and rep == 1)
        overhead = overhead or ovh
        say(f"{tag}3/4 EPD through the gateway, the project's encoder pool on core 0")
        results[POOL], _ = epd_run(model, work, POOL, epd_config, True, a, PORT + 3,
                                   overhead=False, pool=True)
        say(f"{tag}4/4 EPD with vLLM's ECExampleConnector (same gateway, same cores)")
        results["EPD ECExampleConnector"], _ = epd_run(model, work, "EPD ECExampleConnector",
                                                       example_config, False, a, PORT + 6,
                                                       overhead=False)
        runs.append(results)
        if a.repeat > 1:
            print(format_table({k: v.summary for k, v in results.items()}))
            print(format_cpu({k: v.summary for k, v in results.items()}))
    labels = list(runs[0])
    summaries = {label: {k: statistics.median(r[label].summary[k] for r in runs
                                              if k in r[label].summary)
                         for k, v in runs[0][label].summary.items()
                         if isinstance(v, int | float)}
                 for label in labels}
    print()
    mix = ", ".join(f"{k} {v:g}" for k, v in a.mix.items())
    print(f"{a.num_requests} requests, concurrency {a.concurrency}, {a.reuse:.0%} item reuse, "
          f"items {mix}, {a.max_tokens} output tokens, {spec.model_name} on CPU"
          + (f"; medians of {a.repeat} interleaved repetitions" if a.repeat > 1 else ""))
    print(format_table(summaries))
    print(format_cpu(summaries))
    ex, agg_s = summaries["EPD ECExampleConnector"], summaries["aggregated vLLM"]
    for label in ("EPD gateway", POOL):
        ours = summaries[label]
        print(f"ratios, {label} / ECExampleConnector: "
              f"req/s {ours['req_per_s'] / ex['req_per_s']:.2f}, "
              f"TTFT p50 {ours['ttft_ms_p50'] / ex['ttft_ms_p50']:.2f}, "
              f"TTFT p99 {ours['ttft_ms_p99'] / ex['ttft_ms_p99']:.2f}; "
              f"/ aggregated: req/s {ours['req_per_s'] / agg_s['req_per_s']:.2f}")
    assert overhead is not None
    print(format_overhead(overhead))
    pd = runs[0]["EPD gateway"].summary.get("pd_ms")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
