"""Routing benchmark, one run: Zipf-popular images through the gateway over 4 encoders
(`epd encoder` pools on the tiny LLaVA, keeping what they encoded under a byte budget) and 2
vLLM prefill/decode instances (EPDConnector over safetensors), the gateway's routing policy
`affinity` vs `least_loaded` vs `round_robin` (routing.encoders and routing.decoders).

The gateway looks nothing up (availability `none`): every item goes to an encoder, so the
encoder's own cache decides whether it is encoded again. Per policy (each on its own images,
the same Zipf shape):
- encodes per unique item (the pools' `items_encoded` over the unique images asked; 1.00 =
  every item encoded once across the fleet),
- encoder-cache hit ratio (items an encoder served from memory over items sent to encoders),
- decode affinity (requests served by their first item's own decode instance),
- req/s and TTFT p50 / p99 (`epd bench serve`, streamed, concurrency 8).

    flock /tmp/epd-vllm.lock .venv/bin/python -m benchmarks.gateway.routing [--requests 240]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from pathlib import Path

import httpx

from benchmarks.harness.env import ROOT
from benchmarks.harness.processes import start_gateway
from benchmarks.harness.report import say
from encoder_service.bench import BenchSpec, image_sequence, run_bench
from encoder_service.local.processes import PoolServer, VllmServer, default_work_dir, start_all
from encoder_service.local.testmodels import SPECS, build
from encoder_service.local.up import epd_config

PORT = 20400  # gateway 20400; pools 20401-20404; decode 20405-20406
POLICIES = ("affinity", "least_loaded", "round_robin")


def pool_totals(urls: list[str]) -> dict[str, float]:
    out = {"items_encoded": 0.0, "reuse_hits": 0.0}
    for u in urls:
        s = httpx.get(u + "/v1/stats", timeout=10).json()
        for k in out:
            out[k] += s.get(k, 0)
    return out


def run_policy(policy: str, pools: list[str], decoders: list[str], work: Path,
               a: argparse.Namespace, seed: int) -> dict:
    config = {"encoder_backend": "pool", "availability": {"kind": "none"},
              "routing": {"encoders": policy, "decoders": policy}}
    gw = start_gateway(f"gateway-{policy}", PORT, work, model="tiny-llava", encoders=pools,
                       decoders=decoders, config=config)
    try:
        spec = BenchSpec(url=gw.url, model="tiny-llava", num_requests=a.requests,
                         concurrency=a.concurrency, distinct_images=a.distinct, zipf=a.zipf,
                         max_tokens=a.max_tokens, seed=seed, label=policy)
        unique = len(set(image_sequence(spec)))
        before = pool_totals(pools)
        res = asyncio.run(run_bench(spec, progress=True))
        after = pool_totals(pools)
        listed = httpx.get(gw.url + "/instances", timeout=10).json()
    finally:
        gw.stop()
    encoded = after["items_encoded"] - before["items_encoded"]
    reused = after["reuse_hits"] - before["reuse_hits"]
    requests = sum(d["requests"] for d in listed["decoders"]) or 1
    s = res.summary
    return {"policy": policy, "unique": unique, "encodes_per_unique": encoded / unique,
            "encoder_hit_ratio": reused / max(1.0, reused + encoded),
            "decode_affinity": sum(d["affinity"] for d in listed["decoders"]) / requests,
            "req_per_s": s["req_per_s"], "ttft_p50": s["ttft_ms_p50"],
            "ttft_p99": s["ttft_ms_p99"], "errors": s["errors"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--distinct", type=int, default=60, help="images to draw from")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--work", type=Path, default=default_work_dir(ROOT) / "routing-bench")
    a = p.parse_args()
    model = build(default_work_dir(ROOT) / "models" / "tiny-llava", SPECS["tiny"])
    shutil.rmtree(a.work, ignore_errors=True)
    storage = a.work / "ec"
    pools = [PoolServer(f"pool-{i}", model, PORT + 1 + i, a.work, cpu_core=i % 2,
                        pool_config={"retain": "keep", "transport": {
                            "storage_path": str(storage)}}) for i in range(4)]
    decoders = [VllmServer(f"decode-{i}", model, PORT + 5 + i, a.work,
                           epd_config("ec_consumer", storage), cpu_core=i % 2)
                for i in range(2)]
    servers = [*pools, *decoders]
    start_all(servers, progress=say)
    rows = []
    try:  # warm-up: every server's first requests are slow; no policy should pay for them
        run_policy("least_loaded", [s.url for s in pools], [s.url for s in decoders], a.work,
                   argparse.Namespace(**{**vars(a), "requests": 48}), seed=99)
        for n, policy in enumerate(POLICIES):
            rows.append(run_policy(policy, [s.url for s in pools], [s.url for s in decoders],
                                   a.work, a, seed=100 + n))
            say(f"{json.dumps(rows[-1])}")
    finally:
        for s in servers:
            s.stop()
    print(f"\n{a.requests} requests over {a.distinct} Zipf({a.zipf}) images, 4 encoder pools, "
          f"2 decode instances, concurrency {a.concurrency}:\n")
    print("| policy | unique items | encodes per unique item | encoder hit ratio | decode "
          "affinity | req/s | TTFT p50 (ms) | TTFT p99 (ms) | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['unique']} | {r['encodes_per_unique']:.2f} | "
              f"{r['encoder_hit_ratio']:.2f} | {r['decode_affinity']:.2f} | "
              f"{r['req_per_s']:.2f} | {r['ttft_p50']:.1f} | {r['ttft_p99']:.1f} | "
              f"{r['errors']} |")
    base = rows[0]
    for r in rows[1:]:
        print(f"affinity / {r['policy']}: req/s {base['req_per_s'] / r['req_per_s']:.2f}, "
              f"TTFT p99 {base['ttft_p99'] / r['ttft_p99']:.2f}, encodes per unique item "
              f"{base['encodes_per_unique'] / max(r['encodes_per_unique'], 1e-9):.2f}")
    (a.work / "routing.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
