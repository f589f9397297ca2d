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

    flock /tmp/epd-vllm.lock .venv/bin/python -m benchmarks.serving.serve [--spec qwen-omni]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from benchmarks.harness.env import ROOT
from benchmarks.harness.load import CpuMeter, stage_means
from benchmarks.harness.processes import example_config, start_gateway
from benchmarks.harness.report import say
from benchmarks.serving.serve_measure import (
    bench,
    gateway_overhead,
    isolated_overhead,
    pd_time,
)
from benchmarks.serving.serve_report import (
    AGGREGATED,
    EPD,
    EXAMPLE,
    POOL,
    format_cpu,
    format_overhead,
    print_report,
)
from encoder_service.bench import format_table, parse_mix
from encoder_service.local.processes import PoolServer, VllmServer, default_work_dir, start_all
from encoder_service.local.testmodels import SPECS, build
from encoder_service.local.up import epd_config

PORT = 20300  # 20300-20309


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
        enc = PoolServer(f"pool-{port}", model, port + 1, work, cpu_core=0, served_name=a.model,
                         pool_config={"transport": {"storage_path": str(storage)}})
    else:
        enc = VllmServer(f"encoder-{port}", model, port + 1, work,
                         make_cfg("ec_producer", storage), cpu_core=0, served_name=a.model)
    dec = VllmServer(f"decode-{port}", model, port + 2, work,
                     make_cfg("ec_consumer", storage), cpu_core=1, served_name=a.model)
    start_all([enc, dec], progress=say)
    gw = None
    try:
        # Without our connector's availability the gateway neither skips stored items nor
        # overlaps encodes with the decode request (vLLM's connectors would encode a pending
        # item themselves): routing.overlap stays off there.
        config: dict = {} if availability else {"routing": {"overlap": "off"}}
        if pool:
            config["encoder_backend"] = "pool"
        gw = start_gateway(f"gateway-{port}", port, work, model=a.model, encoders=[enc.url],
                           decoders=[dec.url], storage=storage if availability else None,
                           config=config)
        res = bench(gw.url, label, a, CpuMeter({"encoder": enc.proc.pid,
                                                "decode": dec.proc.pid,
                                                "gateway": gw.proc.pid}))
        time.sleep(1.5)  # vLLM publishes connector stats with its next metrics update
        stages = stage_means(gw.url, [enc, dec])
        say(f"{label}: mean ms per stage: {json.dumps(stages)}")
        res.summary["stages_ms"] = stages
        ovh = (gateway_overhead(gw.url, dec.url, a.overhead_samples, a.model) if overhead
               else None)
        if compare_raw:
            raw = start_gateway(f"gateway-raw-{port}", port + 9, work, model=a.model,
                                encoders=[enc.url], decoders=[dec.url], storage=storage,
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
    p.add_argument("--out", type=Path, default=default_work_dir(ROOT) / "bench")
    a = p.parse_args()
    spec = SPECS[a.spec]
    a.model = spec.model_name  # the served name every server and request uses
    if a.overhead_isolated:
        print(format_overhead(isolated_overhead(a.out, a.overhead_samples, a.model, PORT + 7,
                                                a.stand_in_delay_ms)))
        return 0
    a.mix = parse_mix(a.mix or ",".join(f"{m}=1" for m in spec.modalities))
    qwen = spec.family != "llava"
    work = a.out
    model = build(default_work_dir(ROOT) / "models" / spec.model_name, spec)
    if a.overhead_only:
        a.num_requests = 8
        _, overhead = epd_run(model, work, EPD, epd_config, True, a, PORT + 3,
                              overhead=True)
        print(format_overhead(overhead))
        return 0
    runs: list[dict] = []
    overhead = None
    for rep in range(1, a.repeat + 1):
        tag = f"[{rep}/{a.repeat}] " if a.repeat > 1 else ""
        results = {}
        say(f"{tag}1/4 aggregated vLLM (one server, all cores)")
        agg = VllmServer("aggregated", model, PORT, work, None, served_name=a.model)
        start_all([agg], progress=say)
        try:
            results[AGGREGATED] = bench(agg.url, AGGREGATED, a,
                                        CpuMeter({"aggregated": agg.proc.pid}))
        finally:
            agg.stop()
        say(f"{tag}2/4 EPD through the gateway (EPDConnector, safetensors; vLLM encoder core 0, "
            "decode 1)")
        results[EPD], ovh = epd_run(model, work, EPD, epd_config, True, a, PORT + 3,
                                    overhead=overhead is None, compare_raw=qwen and rep == 1)
        overhead = overhead or ovh
        say(f"{tag}3/4 EPD through the gateway, the project's encoder pool on core 0")
        results[POOL], _ = epd_run(model, work, POOL, epd_config, True, a, PORT + 3,
                                   overhead=False, pool=True)
        say(f"{tag}4/4 EPD with vLLM's ECExampleConnector (same gateway, same cores)")
        results[EXAMPLE], _ = epd_run(model, work, EXAMPLE, example_config, False, a,
                                      PORT + 6, overhead=False)
        runs.append(results)
        if a.repeat > 1:
            print(format_table({k: v.summary for k, v in results.items()}))
            print(format_cpu({k: v.summary for k, v in results.items()}))
    assert overhead is not None
    print_report(runs, a, overhead, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
