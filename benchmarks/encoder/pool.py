"""Encoder pool throughput with concurrent clients, batching on vs off, and peak memory.

    flock /tmp/epd-vllm.lock .venv/bin/python -m benchmarks.encoder.pool [--clients 32]

Builds the `vitl32` random LLaVA (ViT-L/32-style tower, 49 tokens x 2048 per image) once,
then for each mode starts `epd encoder` (python -m encoder_service.encoder_pool.server) as its own
process on port 20700 and drives it over real HTTP with `--clients` concurrent clients, each
sending one distinct 224 px image per request. Every embedding is published through the
safetensors transport. Prints images/s per mode, the batching speed-up (target >= 2x), the
mean batch size, and the pool's peak feature bytes vs its CPU budget and the server's peak RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness.env import ROOT
from encoder_service.local.processes import PoolServer, default_work_dir
from encoder_service.local.requests import sample_image_png
from encoder_service.local.testmodels import SPECS, build

PORT = 20700


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def drive(url: str, images: list[bytes], clients: int, tag: str) -> tuple[float, int]:
    """Send every image once from `clients` concurrent clients; (seconds, failures)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(images)):
        queue.put_nowait(i)
    failures = 0

    async def client(c: httpx.AsyncClient) -> None:
        nonlocal failures
        while not queue.empty():
            i = queue.get_nowait()
            r = await c.post("/v1/encode", json={"items": [
                {"id": f"{tag}-{i}", "data": base64.b64encode(images[i]).decode()}]})
            if r.status_code != 200 or r.json()["fallback"]:
                failures += 1

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for _ in range(clients)))
        return time.perf_counter() - t0, failures


def run_mode(model: Path, work: Path, name: str, batch: int, wait_ms: float,
             images: list[bytes], warmup: list[bytes], clients: int, budget: int) -> dict:
    storage = work / f"store-{name}"
    server = PoolServer(name, model, PORT, work, served_name="vitl32", pool_config={
        "max_batch_size": batch, "max_wait_ms": wait_ms, "cpu_budget_bytes": budget,
        "max_queue_items": 256, "transport": {"storage_path": str(storage)}}).start()
    url = server.url
    try:
        server.wait(120)
        asyncio.run(drive(url, warmup, clients, f"warm-{name}"))
        before = httpx.get(url + "/v1/stats").json()
        seconds, failures = asyncio.run(drive(url, images, clients, name))
        stats = httpx.get(url + "/v1/stats").json()
        batches = stats["batches"] - before["batches"]
        encoded = stats["items_encoded"] - before["items_encoded"]
        return {"name": name, "seconds": seconds, "ips": len(images) / seconds,
                "failures": failures, "mean_batch": encoded / max(1, batches),
                "peak_cpu": stats["peak_bytes"]["cpu"], "budget": stats["budget_bytes"]["cpu"],
                "evictions": stats["evictions"], "rss_mib": peak_rss_mib(server.proc.pid)}
    finally:
        server.stop(30)
        shutil.rmtree(storage, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--images", type=int, default=320)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-wait-ms", type=float, default=10.0)
    p.add_argument("--budget-mib", type=float, default=12.0,
                   help="CPU feature budget (default ~60 embeddings: eviction is exercised)")
    args = p.parse_args(argv)
    spec = SPECS["vitl32"]
    model = build(default_work_dir(ROOT) / "models" / "vitl32-llava", spec)
    images = [sample_image_png(10_000 + i, spec.image_size) for i in range(args.images)]
    warmup = [sample_image_png(90_000 + i, spec.image_size) for i in range(args.clients * 2)]
    budget = int(args.budget_mib * (1 << 20))
    work = Path(tempfile.mkdtemp(prefix="pool-bench-", dir=default_work_dir(ROOT)))
    item_bytes = spec.image_tokens * spec.lm_hidden * 2
    print(f"pool bench: {spec.name} tower ({spec.vision_layers} layers x {spec.vision_hidden}, "
          f"{spec.image_tokens} tokens, {item_bytes / 1024:.0f} KiB bf16 per embedding), "
          f"{args.clients} clients, {args.images} distinct images, published via safetensors")
    try:
        on = run_mode(model, work, "batching-on", args.max_batch_size, args.max_wait_ms,
                      images, warmup, args.clients, budget)
        off = run_mode(model, work, "batching-off", 1, 0.0, images, warmup, args.clients,
                       budget)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in (on, off):
        print(f"  {r['name']:13s} {r['ips']:7.1f} images/s  ({r['seconds']:.1f} s, mean batch "
              f"{r['mean_batch']:.1f}, failures {r['failures']}); peak feature bytes "
              f"{r['peak_cpu'] / 2**20:.1f} MiB of {r['budget'] / 2**20:.1f} MiB budget "
              f"({'within' if r['peak_cpu'] <= r['budget'] else 'OVER'}), evictions "
              f"{r['evictions']}, server peak RSS {r['rss_mib']:.0f} MiB")
    print(f"  batching speed-up: {on['ips'] / off['ips']:.2f}x (target >= 2x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
