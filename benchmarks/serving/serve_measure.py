"""What the serving benchmark measures (serving/serve.py): a load run of `epd bench serve`'s
workload with each server's CPU per request, the gateway's own overhead (beside a real
decode instance, or alone against a stand-in), a decode instance's time for metadata-only vs
raw-media requests."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.harness.load import CpuMeter, warm
from benchmarks.harness.processes import StandIn, start_gateway
from benchmarks.harness.report import say
from ec_connectors.protocol.keys import content_item_id
from ec_connectors.protocol.params import ItemEntry, TransferParams
from encoder_service.bench import BenchSpec, item_part, run_bench
from encoder_service.gateway.config import GatewayConfig
from encoder_service.gateway.upstreams.availability import SafetensorsAvailability
from encoder_service.local.processes import metric_value
from encoder_service.local.requests import chat_body, parts_body, sample_image_png


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
        gw = start_gateway("gateway-isolated", port, work, model=model,
                           decoders=[stand_in.url], storage=storage,
                           config={"routing": {"probe_interval_s": 0}})
        return gateway_overhead(gw.url, stand_in.url, samples, model)
    finally:
        if gw is not None:
            gw.stop()
        stand_in.stop()
