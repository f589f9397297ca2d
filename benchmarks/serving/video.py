"""Video at real sizes, served four ways on the same servers and the same requests: the
latency of one heavy request, whole (TTFT and end to end), per clip size.

    flock /tmp/epd-vllm.lock .venv/bin/python -m benchmarks.serving.video \
        [--frames 6 30 120] [--rounds 3] [--deployments ...] [--json FILE]

Model: the `qwen3-vl-video` test model and its workload (benchmarks/harness/video.py):
clips of 6, 30 and 120 frames are items of real Qwen-VL sizes.

Deployments (started one after another, each on this machine's two cores):
  aggregated    one vLLM server: encoder and prefill/decode in one process, both cores
  epd-shm       `epd up`: vLLM encoder (core 0) + vLLM prefill/decode (core 1), EPDConnector
                over shared memory, the gateway sending metadata-only parts
  epd-mooncake  the same over the Mooncake TE transport on loopback TCP (its socket data
                path, `te_data_path` auto); epd-mooncake-engine: through the engine's TCP
  example       the same two vLLM servers and gateway with vLLM's ECExampleConnector
                (safetensors files on /dev/shm, no availability lookup, no overlap)
Each round sends one new clip of each size alone (streamed, greedy, `--max-tokens`; no
repeats: vLLM's prefix cache would answer those without moving the item). The first round
warms the servers and is not counted. Token ids are compared with the
aggregated server's for every request. Prints medians per deployment and clip, and each
EPD deployment's TTFT against aggregated and against vLLM's example connector.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks.harness.env import ROOT
from benchmarks.harness.processes import example_config, start_gateway
from benchmarks.harness.report import say
from benchmarks.harness.video import GATEWAY, MEDIA_IO, MODEL, SIDE, SPEC, VLLM_ARGS, clip, item_mb
from encoder_service.bench import stream_greedy
from encoder_service.local.processes import VllmServer, default_work_dir, start_all
from encoder_service.local.testmodels import build
from encoder_service.local.up import run_up
from encoder_service.local.up_config import UpConfig

DEPLOYMENTS = ("aggregated", "epd-shm", "epd-mooncake", "epd-mooncake-engine", "example")


def workload(url: str, a: argparse.Namespace) -> dict:
    """{frames: [the Answer of each counted round]}."""
    out: dict = {n: [] for n in a.frames}

    async def go() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            for r in range(a.rounds + 1):
                for n in a.frames:
                    res = await stream_greedy(client, url, MODEL, clip(1000 * r + n, n),
                                              "what happens in this clip?", a.max_tokens)
                    if r:
                        out[n].append(res)
                    say(f"round {r}{' (warm-up)' if not r else ''}: {n} frames "
                        f"({res.prompt_tokens} prompt tokens): TTFT "
                        f"{res.ttft * 1000:.0f} ms, total {res.e2e * 1000:.0f} ms")

    asyncio.run(go())
    return out


def run_aggregated(a: argparse.Namespace, model: Path, work: Path) -> dict:
    server = VllmServer("video-aggregated", model, a.base_port, work, None, served_name=MODEL,
                        extra_args=[*VLLM_ARGS, "--media-io-kwargs", json.dumps(MEDIA_IO)])
    start_all([server], progress=say)
    try:
        return workload(server.url, a)
    finally:
        server.stop()


def run_up_stack(a: argparse.Namespace, dep: str) -> dict:
    transport, _, path = dep.removeprefix("epd-").partition("-")
    cfg = UpConfig(model=SPEC.name, transport=transport, base_port=a.base_port + 10,
                   cpu_cores=[0, 1], vllm_args=VLLM_ARGS, media_io_kwargs=MEDIA_IO,
                   gateway=GATEWAY, connector_extra={"te_data_path": path} if path else {})
    out: dict = {}

    def demo(stack) -> int:
        out.update(workload(stack.url, a))
        return 0

    if run_up(cfg, default_work_dir(ROOT), demo=demo) != 0 or not out:
        raise SystemExit(f"{dep}: the stack did not run (see the lines above)")
    return out


def run_example(a: argparse.Namespace, model: Path, work: Path) -> dict:
    storage = Path(tempfile.mkdtemp(prefix="epd-video-example-", dir="/dev/shm"))
    extra = [*VLLM_ARGS, "--media-io-kwargs", json.dumps(MEDIA_IO)]
    port = a.base_port + 30
    enc = VllmServer("video-example-encoder", model, port + 1, work,
                     example_config("ec_producer", storage), cpu_core=0, served_name=MODEL,
                     extra_args=extra)
    dec = VllmServer("video-example-decode", model, port + 2, work,
                     example_config("ec_consumer", storage), cpu_core=1, served_name=MODEL,
                     extra_args=extra)
    gw = None
    try:
        start_all([enc, dec], progress=say)
        # vLLM's connectors have no availability lookup: the gateway cannot skip stored
        # items or overlap encodes with the decode request (serving/serve.py does the same)
        gw = start_gateway("video-example-gateway", port, work, model=MODEL,
                           encoders=[enc.url], decoders=[dec.url],
                           config={"routing": {"overlap": "off"}, **GATEWAY})
        return workload(gw.url, a)
    finally:
        if gw is not None:
            gw.stop()
        enc.stop()
        dec.stop()
        shutil.rmtree(storage, ignore_errors=True)


def summarize(runs: dict[str, dict], frames: list[int]) -> dict:
    table: dict = {}
    for dep, res in runs.items():
        for n in frames:
            rows = res[n]
            table.setdefault(dep, {})[str(n)] = {
                "ttft_ms": statistics.median(r.ttft for r in rows) * 1000,
                "e2e_ms": statistics.median(r.e2e for r in rows) * 1000,
                "prompt_tokens": rows[0].prompt_tokens}
    equal = {dep: all(r.token_ids == ref.token_ids for n in frames
                      for r, ref in zip(res[n], runs["aggregated"][n], strict=True))
             for dep, res in runs.items()} if "aggregated" in runs else {}
    return {"ms": table, "answers_equal_to_aggregated": equal}


def report(summary: dict, frames: list[int]) -> None:
    table = summary["ms"]
    print(f"\n{'deployment':<13} {'clip':>14} {'item MB':>8} {'TTFT':>8} {'e2e':>8} "
          f"{'agg/this':>9} {'example/this':>13}")
    for dep, per in table.items():
        for n in frames:
            row = per[str(n)]
            mb = item_mb(n)
            agg = table.get("aggregated", {}).get(str(n), {}).get("ttft_ms")
            ex = table.get("example", {}).get(str(n), {}).get("ttft_ms")
            ttft = row["ttft_ms"]
            print(f"{dep:<13} {n:>4} fr {SIDE}px {mb:>8.1f} {ttft:>6.0f}ms "
                  f"{row['e2e_ms']:>6.0f}ms {(agg / ttft if agg else float('nan')):>8.2f}x "
                  f"{(ex / ttft if ex else float('nan')):>12.2f}x")
    if summary["answers_equal_to_aggregated"]:
        print(f"token ids equal to aggregated: {summary['answers_equal_to_aggregated']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, nargs="+", default=[6, 30, 120])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--deployments", nargs="+", choices=DEPLOYMENTS, default=list(DEPLOYMENTS))
    p.add_argument("--base-port", type=int, default=20600)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if any(not 2 <= n <= 128 for n in a.frames):
        p.error("--frames: 2 to 128 frames per clip (the servers keep 128)")
    work = default_work_dir(ROOT) / "video-bench"
    model = build(default_work_dir(ROOT) / "models" / MODEL, SPEC)
    runs: dict[str, dict] = {}
    for dep in a.deployments:
        say(f"{dep}: starting")
        if dep == "aggregated":
            runs[dep] = run_aggregated(a, model, work)
        elif dep == "example":
            runs[dep] = run_example(a, model, work)
        else:
            runs[dep] = run_up_stack(a, dep)
    summary = summarize(runs, a.frames)
    report(summary, a.frames)
    if a.json:
        a.json.write_text(json.dumps({**summary, "args": {k: str(v) for k, v in
                                                          vars(a).items()}}, indent=1))
    return 0 if all(summary["answers_equal_to_aggregated"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
