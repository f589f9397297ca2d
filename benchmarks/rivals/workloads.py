"""The rival benchmark's workloads (rivals/run.py), the same requests for every
deployment and every round (seeded), each run against a started deployment's front end:

  light              tiny LLaVA: `--requests` streamed requests (default 200), concurrency 8,
                     50% image reuse (`epd bench serve`'s workload: image_sequence/item_part),
                     16 output tokens
  distinct           tiny LLaVA, a new image every request, concurrency 8, sent by vLLM's own
                     client: `vllm bench serve --dataset-name random-mm` (one 256 x 256 image
                     and 32 random prompt tokens per request, `--ignore-eos`, greedy); its
                     answers are compared as text (it returns no token ids);
                     `--distinct-client ours` sends the same shape with this client instead
  video              `qwen3-vl-video` clips of 6, 30 and 120 frames (512 px JPEG frame lists:
                     items of 6.3 / 31.5 / 125.8 MB), each size alone (case video_<n>x1:
                     three new clips one after another; one clip was one noisy sample) and
                     four new clips at once (video_<n>x4), 8 output tokens
  video_with_images  a new 120-frame clip, then (`--lag-ms` later, while it encodes) 16 new
                     images at once; TTFT p50/p99 of the images, the video's TTFT beside

A deployment without an encoder (stacks.TEXT_ONLY: vllm_pd_text) runs the text of
light and distinct instead (TEXT_RUNNERS), and so does aggregated, for the answers to compare
with, when such a deployment runs:

  light_text         light's requests without their image: `--requests` streamed requests of
                     the prompt "describe this" alone, concurrency 8, 16 output tokens
  distinct_text      distinct without its image: `vllm bench serve --dataset-name random`,
                     32 random prompt tokens a request (seed 7), 16 tokens, `--ignore-eos`

Each workload first warms the deployment with other media (a fresh server's first batches of
each shape cost far more). A measured window: the processes' CPU (harness/load.py's CpuMeter)
and its wall-clock bounds (the handoff probe's events are read for that window).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness.load import CpuMeter, warm
from benchmarks.harness.stack import Stack
from benchmarks.harness.video import clip
from encoder_service.bench import (
    BenchSpec,
    image_sequence,
    item_part,
    run_bench,
    stream_greedy,
)
from encoder_service.local.processes import vllm_env
from encoder_service.local.requests import image_part, sample_image_png

CONCURRENCY = 8
WORKLOADS = ("light", "distinct", "video", "video_with_images")
GROUP_OF = {"light": "llava", "distinct": "llava", "video": "qwen3",
            "video_with_images": "qwen3"}
DISTINCT_BUCKETS = "{(256, 256, 1): 1.0}"  # random-mm: one 256 x 256 image per request
DISTINCT_PROMPT_TOKENS = 32
SOLO_CLIPS = 3  # video_<n>x1: clips sent one after another


@dataclass
class Run:
    """One measured window: per request its TTFT (s) and answer (token ids, or text from
    `vllm bench serve`), or its error."""

    ttft: list[float | None]
    answers: list[Any]
    errors: list[str]
    duration_s: float
    t0: float  # wall clock
    t1: float
    cpu: dict[str, float] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)


async def _load(url: str, model: str, parts: list[dict | None], prompt: str, concurrency: int,
                max_tokens: int) -> list[tuple[float | None, Any, str]]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=2 * concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one(part: dict | None) -> tuple[float | None, Any, str]:
            async with sem:
                try:
                    # part None: text only, the prompt as the one content part
                    ans = await stream_greedy(client, url, model, part, prompt, max_tokens)
                except (RuntimeError, httpx.HTTPError, ValueError) as exc:
                    return None, None, f"{type(exc).__name__}: {exc}"[:400]
                return ans.ttft, ans.token_ids, ""

        return await asyncio.gather(*(one(p) for p in parts))


def measure(stack: Stack, parts: list[dict | None], concurrency: int, max_tokens: int,
            prompt: str = "describe this") -> Run:
    meter = CpuMeter(stack.pids)
    meter.start()
    t0, p0 = time.time(), time.perf_counter()
    out = asyncio.run(_load(stack.url, stack.model, parts, prompt, concurrency, max_tokens))
    dur = time.perf_counter() - p0
    run = Run([t for t, _, _ in out], [a for _, a, _ in out], [e for _, _, e in out if e],
              dur, t0, time.time())
    run.cpu = meter.stop(len(parts))
    return run


def _warm_llava(stack: Stack) -> None:
    warm(stack.url, stack.model)
    asyncio.run(run_bench(BenchSpec(url=stack.url, model=stack.model,
                                    num_requests=4 * CONCURRENCY, concurrency=CONCURRENCY,
                                    reuse=0.5, max_tokens=16, label="warm-up", seed=97),
                          progress=False))


def light(stack: Stack, a: argparse.Namespace) -> dict[str, Run]:
    _warm_llava(stack)
    spec = BenchSpec(url=stack.url, model=stack.model, num_requests=a.requests,
                     concurrency=CONCURRENCY, reuse=0.5, max_tokens=16)
    seq = image_sequence(spec)
    items = {i: item_part(spec, i)[1] for i in sorted(set(seq))}
    return {"light": measure(stack, [items[i] for i in seq], CONCURRENCY, 16)}


def _distinct_ours(stack: Stack, a: argparse.Namespace) -> Run:
    parts = [image_part(sample_image_png(500_000 + i, size=256)) for i in range(a.requests)]
    return measure(stack, parts, CONCURRENCY, 16)


def vllm_bench_command(stack: Stack, a: argparse.Namespace, model_dir: Path, out: Path,
                       text: bool = False) -> list[str]:
    """distinct's `vllm bench serve`; `text`: distinct_text's (its prompts, no image)."""
    mm = [] if text else [
        "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio",
        "0", "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
        "--random-mm-bucket-config", DISTINCT_BUCKETS]
    return [sys.executable, "-m", "encoder_service.local.vllm_cli", "bench", "serve",
            "--backend", "openai-chat", "--base-url", stack.url,
            "--endpoint", "/v1/chat/completions", "--model", stack.model,
            "--tokenizer", str(model_dir), "--dataset-name", "random" if text else "random-mm",
            "--num-prompts", str(a.requests), "--max-concurrency", str(CONCURRENCY),
            "--random-input-len", str(DISTINCT_PROMPT_TOKENS), "--random-output-len", "16",
            "--random-range-ratio", "0", *mm, "--seed", "7", "--ignore-eos",
            "--temperature", "0", "--ready-check-timeout-sec", "0", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(out.parent),
            "--result-filename", out.name]


def read_vllm_bench(result: dict[str, Any], t0: float, t1: float) -> Run:
    """A Run from `vllm bench serve --save-result --save-detailed`'s JSON."""
    errors = [e for e in result.get("errors") or [] if e]
    texts = result.get("generated_texts") or []
    ttfts = [t if t and not e else None for t, e in zip(result.get("ttfts") or [],
                                                        result.get("errors") or [],
                                                        strict=False)]
    answers = [None if e else t for t, e in zip(texts, result.get("errors") or [],
                                                 strict=False)]
    return Run(ttfts, answers, errors, float(result["duration"]), t0, t1)


def distinct(stack: Stack, a: argparse.Namespace) -> dict[str, Run]:
    _warm_llava(stack)
    if a.distinct_client == "ours":
        return {"distinct": _distinct_ours(stack, a)}
    return {"distinct": _vllm_bench(stack, a, False)}


def _vllm_bench(stack: Stack, a: argparse.Namespace, text: bool) -> Run:
    tag = f"{stack.name}{'-text' if text else ''}"
    out = a.work / "vllm-bench" / f"{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    cmd = vllm_bench_command(stack, a, a.models / stack.model, out, text)
    meter = CpuMeter(stack.pids)
    meter.start()
    t0 = time.time()
    log = a.work / "logs" / f"vllm-bench-{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=1800,
                            env=vllm_env(a.work)).returncode
    t1 = time.time()
    if rc != 0 or not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"vllm bench serve exited {rc}: {' | '.join(tail)}")
    run = read_vllm_bench(json.loads(out.read_text()), t0, t1)
    run.cpu = meter.stop(a.requests)
    return run


def _warm_text(stack: Stack) -> None:
    parts = [None] * (4 * CONCURRENCY)
    asyncio.run(_load(stack.url, stack.model, parts, "warm up", CONCURRENCY, 16))


def light_text(stack: Stack, a: argparse.Namespace) -> dict[str, Run]:
    _warm_text(stack)
    return {"light_text": measure(stack, [None] * a.requests, CONCURRENCY, 16)}


def distinct_text(stack: Stack, a: argparse.Namespace) -> dict[str, Run]:
    _warm_text(stack)  # `vllm bench serve` whatever --distinct-client says
    return {"distinct_text": _vllm_bench(stack, a, True)}


def _warm_video(stack: Stack, a: argparse.Namespace) -> None:
    parts = [clip(9_000 + n, n) for n in a.frames]
    parts.append(image_part(sample_image_png(9_999)))
    for p in parts:  # one at a time: each shape once
        asyncio.run(_load(stack.url, stack.model, [p], "warm up", 1, 2))


def video(stack: Stack, a: argparse.Namespace) -> dict[str, Run]:
    _warm_video(stack, a)
    runs = {}
    for n in a.frames:
        runs[f"video_{n}x1"] = measure(stack, [clip(100_000 + 10 * n + k, n)
                                               for k in range(SOLO_CLIPS)], 1, 8,
                                       "what happens in this clip?")
        runs[f"video_{n}x4"] = measure(stack, [clip(200_000 + 10 * n + k, n) for k in range(4)],
                                       4, 8, "what happens in this clip?")
    return runs


async def _video_and_images(url: str, model: str, lag_s: float, images: int
                            ) -> list[tuple[float | None, Any, str]]:
    vid = asyncio.create_task(_load(url, model, [clip(300_000, 120)], "describe this", 1, 8))
    await asyncio.sleep(lag_s)
    parts = [image_part(sample_image_png(310_000 + i)) for i in range(images)]
    imgs = await _load(url, model, parts, "describe this", images, 8)
    return [*(await vid), *imgs]


def video_with_images(stack: Stack, a: argparse.Namespace) -> dict[str, Run]:
    _warm_video(stack, a)
    meter = CpuMeter(stack.pids)
    meter.start()
    t0, p0 = time.time(), time.perf_counter()
    out = asyncio.run(_video_and_images(stack.url, stack.model, a.lag_ms / 1000, 16))
    dur = time.perf_counter() - p0
    # TTFT over the images (what waits behind the video); the video's own beside it
    run = Run([t for t, _, _ in out[1:]], [x for _, x, _ in out], [e for _, _, e in out if e],
              dur, t0, time.time())
    run.cpu = meter.stop(len(out))
    if out[0][0] is not None:
        run.extra["video_ttft_ms"] = out[0][0] * 1e3
    return {"video_with_images": run}


RUNNERS = {"light": light, "distinct": distinct, "video": video,
           "video_with_images": video_with_images}
# a workload's text alone (deployments without an encoder; aggregated beside them)
TEXT_RUNNERS = {"light": light_text, "distinct": distinct_text}
TEXT_CASES = {"light": "light_text", "distinct": "distinct_text"}
