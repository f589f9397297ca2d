"""Chunked vs whole video encoding in the encoder pool, seen from the client: the TTFT of a
120-frame video request, and the p99 TTFT of 16 image requests sent while it encodes.

    flock /tmp/epd-vllm.lock .venv/bin/python -m benchmarks.encoder.video_chunk [--json FILE]

The stack is `epd up` (gateway, one encoder pool, one prefill/decode vLLM server, shm) on
the `qwen-vl-heavy` test model, whose vision tower is slow enough on one CPU core that
images wait behind a 120-frame 112 px video (behind the tiny models' towers nothing would
wait; docs/benchmarks.md has the times).
It is started once per mode: `whole` (video_chunk_tokens 0: the video is one batch) and
`chunked` (`--chunk-tokens` rows per batch: 8 chunks of 8 temporal groups). Every server
keeps 120 frames (`media_io_kwargs`: the same for pool and vLLM). Each round sends a new
video, then `--lag-ms` later 16 new images at once, all streamed, greedy, `--max-tokens`;
the first round of each mode warms the servers and is not counted. Both modes get the same
media, so the answers are compared too (token ids, chunked vs whole).
Prints per mode the video TTFT (median over rounds) and the images' TTFT p50/p99 (over
all rounds), and whole/chunked ratios; `--json` writes the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import httpx

from benchmarks.harness.report import ms, percentile, say
from encoder_service.bench import stream_greedy
from encoder_service.local.processes import default_work_dir
from encoder_service.local.requests import image_part, sample_frames, sample_image_png, video_part
from encoder_service.local.up import run_up
from encoder_service.local.up_config import UpConfig

MODEL = "qwen-vl-heavy"
FRAMES = 120


async def stream(client: httpx.AsyncClient, url: str, model: str, part: dict,
                 max_tokens: int) -> tuple[float, list[int]]:
    """(seconds to the first token, the answer's token ids) of one streamed request."""
    answer = await stream_greedy(client, url, model, part, "describe this", max_tokens)
    return answer.ttft, answer.token_ids


async def one_round(url: str, model: str, r: int, a: argparse.Namespace
                    ) -> tuple[float, list[float], list[list[int]]]:
    video = video_part(sample_frames(10_000 + r, FRAMES))
    images = [image_part(sample_image_png(100_000 + 100 * r + i)) for i in range(a.images)]
    async with httpx.AsyncClient(timeout=300) as client:
        vid = asyncio.create_task(stream(client, url, model, video, a.max_tokens))
        await asyncio.sleep(a.lag_ms / 1000)
        imgs = await asyncio.gather(*(stream(client, url, model, p, a.max_tokens)
                                      for p in images))
        v = await vid
    return v[0], [t for t, _ in imgs], [v[1], *(s for _, s in imgs)]


def measure(mode: str, chunk_tokens: int, a: argparse.Namespace) -> dict:
    cfg = UpConfig(model=MODEL, encoder_backend="pool", base_port=a.base_port,
                   pool={"video_chunk_tokens": chunk_tokens},
                   media_io_kwargs={"video": {"num_frames": FRAMES}})
    out: dict = {}

    def bench(dep) -> int:
        model = cfg.served_model_name
        asyncio.run(one_round(dep.url, model, 0, a))  # warm-up: processors, first batches
        videos, images, answers = [], [], []
        for r in range(1, a.rounds + 1):
            v, imgs, texts = asyncio.run(one_round(dep.url, model, r, a))
            videos.append(v)
            images.extend(imgs)
            answers.extend(texts)
            say(f"{mode}: round {r}: video TTFT {ms(v):.0f} ms, images TTFT max "
                f"{ms(max(imgs)):.0f} ms")
        stats = httpx.get(dep.encoders[0].url + "/v1/stats", timeout=10).json()
        out.update(video_ttft_ms=ms(statistics.median(videos)),
                   image_ttft_p50_ms=ms(percentile(images, 50)),
                   image_ttft_p99_ms=ms(percentile(images, 99)),
                   chunks=stats.get("chunks", 0), answers=answers)
        return 0

    if run_up(cfg, default_work_dir(), demo=bench) != 0 or not out:
        raise SystemExit(f"{mode}: the stack did not run (see the lines above)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--lag-ms", type=float, default=300.0,
                   help="images follow the video by this much (the video is then encoding)")
    p.add_argument("--chunk-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--base-port", type=int, default=20500)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    res = {mode: measure(mode, tokens, a)
           for mode, tokens in (("whole", 0), ("chunked", a.chunk_tokens))}
    w, c = res["whole"], res["chunked"]
    summary = {
        "video_ttft_ratio": w["video_ttft_ms"] / c["video_ttft_ms"],
        "image_ttft_p99_ratio": w["image_ttft_p99_ms"] / c["image_ttft_p99_ms"],
        "answers_equal": w["answers"] == c["answers"],
    }
    print(f"{'mode':<8} {'video TTFT':>11} {'images p50':>11} {'images p99':>11} chunks")
    for mode, r in res.items():
        print(f"{mode:<8} {r['video_ttft_ms']:>8.0f} ms {r['image_ttft_p50_ms']:>8.0f} ms "
              f"{r['image_ttft_p99_ms']:>8.0f} ms {r['chunks']:>6}")
    print(f"whole / chunked: images' TTFT p99 {summary['image_ttft_p99_ratio']:.2f}x, video "
          f"TTFT {summary['video_ttft_ratio']:.2f}x; answers equal: {summary['answers_equal']}")
    if a.json:
        a.json.write_text(json.dumps({"modes": {m: {k: v for k, v in r.items()
                                                    if k != "answers"}
                                                for m, r in res.items()},
                                      **summary, "args": {k: str(v) for k, v in
                                                          vars(a).items()}}, indent=2))
    return 0 if summary["answers_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
