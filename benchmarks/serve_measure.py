"""What the serving benchmark measures (benchmarks/serve_bench.py): a load run of `epd bench
serve`'s workload with each server's CPU per request, the gateway's own overhead (beside a real
decode instance, or alone against a stand-in), a decode instance's time for metadata-only vs
raw-media requests, and the mean time of each stage from /metrics."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.serve_processes import GatewayProcess, StandIn  # noqa: E402
from benchmarks.serve_report import say  # noqa: E402
from ec_connectors.protocol.keys import content_item_id  # noqa: E402
from ec_connectors.protocol.params import ItemEntry, TransferParams  # noqa: E402
from encoder_service.bench import BenchSpec, item_part, run_bench  # noqa: E402
from encoder_service.gateway.config import GatewayConfig  # noqa: E402
from encoder_service.gateway.upstreams.availability import SafetensorsAvailability  # noqa: E402
from encoder_service.local.processes import PoolServer, VllmServer, metric_value  # noqa: E402
from encoder_service.local.requests import chat_body, parts_body, sample_image_png  # noqa: E402


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


def warm(url: str, model: str, n: int = 4) -> None:
    with httpx.Client(timeout=120) as c:
        for i in range(n):
            r = c.post(url + "/v1/chat/completions",
                       json=chat_body(model, sample_image_png(seed=90_000 + i), "warm up",
                                      max_tokens=4))
            r.raise_for_status()


def bench(url: str, label: str, a: argparse.Namespace, meter: CpuMeter | None = None):
    """One load run of `a`'s workload against `url` (the served model `a.model`), after a
    warm-up; with `meter`, the CPU per request goes into the summary."""
    warm(url, a.model)
    # A burst at the measured concurrency first (other images): the first batches of each
    # shape cost a fresh server far more (oneDNN primitives), whichever deployment runs first.
    asyncio.run(run_bench(BenchSpec(url=url, model=a.model, num_requests=4 * a.concurrency,
                                    concurrency=a.concurrency, reuse=a.reuse,
                                    max_tokens=a.max_tokens, label="warm-up", mix=a.mix,
                                    seed=97), progress=False))
    spec = BenchSpec(url=url, model=a.model, num_requests=a.num_requests,
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


def gateway_overhead(gw_url: str, dec_url: str, samples: int, model: str) -> dict:
    """p50 of direct-to-decode vs through-the-gateway for the same non-streamed request."""
    image = sample_image_png(seed=91_000)
    item = content_item_id(image, model)
    via_gw = chat_body(model, image, "describe", max_tokens=4)
    direct = chat_body(model, image, "describe", item_id=item, max_tokens=4,
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
                       json=parts_body(a.model, [part], "describe", max_tokens=1))
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


def isolated_overhead(work: Path, samples: int, model: str, port: int,
                      delay_ms: float = 0.0) -> dict:
    """The gateway's own overhead: the gateway process and a stand-in decode instance that
    answers after `delay_ms` (0: at once), no vLLM beside them; the image is already
    available (a stored file). The gateway on `port`, the stand-in on the next."""
    storage = work / "store-isolated"
    shutil.rmtree(storage, ignore_errors=True)
    cfg = GatewayConfig.build({"model": model, "decoders": ["http://127.0.0.1:1"]})
    item = content_item_id(sample_image_png(seed=91_000), model)
    path = Path(SafetensorsAvailability(storage, cfg.namespace).path_for(item))
    path.parent.mkdir(parents=True)
    path.touch()
    stand_in = StandIn("stand-in", port + 1, work, delay_ms=delay_ms).start()
    gw = None
    try:
        stand_in.wait(30)
        gw = GatewayProcess(port, [], [stand_in.url], storage,
                            work / "logs" / "gateway-isolated.log",
                            config={"routing": {"probe_interval_s": 0}}, model=model)
        return gateway_overhead(gw.url, stand_in.url, samples, model)
    finally:
        if gw is not None:
            gw.stop()
        stand_in.stop()


CONNECTOR_STAGES = ("save_wait", "save", "loader_wait", "get", "load", "staged_to_scheduled",
                    "defer", "pending")
# vLLM's own view of a request on each server (queued, then prefill, end to end): the
# gateway's encode / first_token stage minus these is HTTP, the API server and the gateway.
VLLM_STAGES = ("request_queue_time", "request_prefill_time", "e2e_request_latency")
GATEWAY_STAGES = ("parse", "encode", "prefill", "first_token", "total")  # prefill: E/P/D


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
