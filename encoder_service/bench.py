"""`epd bench serve`: multimodal load against an OpenAI-compatible endpoint.

`epd bench serve`: concurrent multimodal load against any OpenAI-compatible endpoint
(this gateway, or a plain vLLM server).

Workload: `num_requests` streamed chat requests, each with one media item (a data: URL) and
a short prompt, `ignore_eos` so every answer has exactly `max_tokens` tokens. Items are
images, or a seeded mix (`--mix image=2,video=1,audio=1`: 4-frame JPEG videos, 2 s WAV
audio). A `reuse` share of the requests repeat an item already sent (placed at random,
seeded); the others bring a new one. Arrivals: as fast as `concurrency` allows, or Poisson
at `request_rate`.
Reports throughput, TTFT, TPOT and end-to-end latency (p50/p90/p99); writes JSON and a PNG,
by default under the work directory (`$EPD_WORK_DIR`, else `./.work`: `bench/bench-serve.*`),
so a run never leaves generated output in the working directory (a checkout's root).
The progress bar (tqdm) and the PNG (matplotlib) come with `pip install epd-serve[bench]`;
without them progress is plain lines and the PNG is skipped with a note.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from encoder_service.local.processes import default_work_dir
from encoder_service.local.requests import (
    audio_part,
    image_part,
    sample_frames,
    sample_image_png,
    sample_wav,
    video_part,
)

MODALITIES = ("image", "video", "audio")


@dataclass
class BenchSpec:
    url: str
    model: str = "tiny-llava"
    num_requests: int = 200
    concurrency: int = 8
    request_rate: float = math.inf
    reuse: float = 0.5
    distinct_images: int | None = None
    max_tokens: int = 16
    image_size: int = 112
    prompt: str = "describe this"
    mix: dict[str, float] = field(default_factory=lambda: {"image": 1.0})
    zipf: float = 0.0  # > 0: image k (of distinct_images) is asked with weight 1 / k**zipf
    seed: int = 0
    timeout_s: float = 120.0
    label: str = ""


@dataclass
class Record:
    image: int
    ok: bool
    start: float
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    error: str = ""


class _Progress:
    """A tqdm bar when tqdm is installed, else a plain line per tenth of the work (stderr)."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done, self._next = total, desc, 0, 0
        self.t0 = time.perf_counter()
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
            print(f"{desc}: {total} requests (install epd-serve[bench] for a progress bar)",
                  file=sys.stderr, flush=True)
        else:
            self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr)

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)
            return
        self.done += n
        if self.done >= self._next or self.done == self.total:
            self._next = self.done + max(1, self.total // 10)
            print(f"{self.desc}: {self.done}/{self.total} requests, "
                  f"{time.perf_counter() - self.t0:.1f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class BenchResult:
    spec: dict[str, Any]
    duration_s: float
    summary: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)


def image_sequence(spec: BenchSpec) -> list[int]:
    """Choose which image each request of a run sends.

    Image index per request: `reuse` of them repeat an earlier image, or (zipf > 0) each
    drawn from a Zipf popularity over `distinct` images (seeded)."""
    n = spec.num_requests
    distinct = spec.distinct_images or max(1, round(n * (1 - spec.reuse)))
    distinct = min(distinct, n)
    rng = random.Random(spec.seed)
    if spec.zipf > 0:
        weights = [1 / (k + 1) ** spec.zipf for k in range(distinct)]
        return rng.choices(range(distinct), weights=weights, k=n)
    new_at = {0, *rng.sample(range(1, n), distinct - 1)} if n > 1 else {0}
    seq, seen = [], 0
    for i in range(n):
        if i in new_at:
            seq.append(seen)
            seen += 1
        else:
            seq.append(rng.randrange(seen))
    return seq


def parse_mix(text: str) -> dict[str, float]:
    """`image=2,video=1,audio=1` -> weights; raises ValueError with a clear message."""
    out: dict[str, float] = {}
    for item in text.split(","):
        name, sep, weight = item.partition("=")
        name = name.strip()
        if name not in MODALITIES:
            raise ValueError(f"--mix: {name!r} is not one of {', '.join(MODALITIES)}")
        try:
            out[name] = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"--mix: weight of {name} must be a number") from None
        if out[name] < 0:
            raise ValueError(f"--mix: weight of {name} must be >= 0")
    if not sum(out.values()):
        raise ValueError("--mix: at least one weight must be > 0")
    return out


def item_part(spec: BenchSpec, i: int) -> tuple[str, dict[str, Any]]:
    """Build the content part of distinct item `i`, the same on every run.

    The modality and content part of distinct item `i` (seeded: every run, every
    deployment gets the same items)."""
    rng = random.Random(spec.seed * 1_000_003 + i)
    names = list(spec.mix)
    modality = rng.choices(names, weights=[spec.mix[n] for n in names])[0]
    seed = 10_000 + spec.seed * 1000 + i
    if modality == "video":
        return modality, video_part(sample_frames(seed, size=spec.image_size))
    if modality == "audio":
        return modality, audio_part(sample_wav(seed))
    return modality, image_part(sample_image_png(seed=seed, size=spec.image_size))


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[Record], duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok
            if r.e2e is not None and r.ttft is not None and r.tokens > 1]
    out: dict[str, Any] = {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "duration_s": duration_s, "req_per_s": len(ok) / duration_s if duration_s else 0.0,
        "out_tok_per_s": sum(r.tokens for r in ok) / duration_s if duration_s else 0.0,
    }
    for name, vals in (("ttft_ms", ttft), ("tpot_ms", tpot), ("e2e_ms", e2e)):
        for q in (50, 90, 99):
            v = _pct(vals, q)
            out[f"{name}_p{q}"] = None if v is None else v * 1e3
    return out


@dataclass
class Answer:
    """One streamed greedy answer, as the comparing benchmarks need it."""

    ttft: float  # seconds to the first token
    e2e: float  # seconds to the last byte
    token_ids: list[int]
    prompt_tokens: int


async def stream_greedy(client: httpx.AsyncClient, url: str, model: str,
                        part: dict[str, Any] | None, prompt: str, max_tokens: int) -> Answer:
    """Stream one greedy chat completion and return its token ids.

    `part` (None: text only) and `prompt` streamed greedily to `url` (exactly `max_tokens`
    tokens, their ids returned: runs compare them). Raises RuntimeError on an error or a
    short answer."""
    content = [{"type": "text", "text": prompt}] if part is None else [
        part, {"type": "text", "text": prompt}]
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0,
            "return_token_ids": True, "messages": [{"role": "user", "content": content}]}
    t0, ttft, tokens, prompt_tokens = time.perf_counter(), None, [], 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            prompt_tokens = (chunk.get("usage") or {}).get("prompt_tokens") or prompt_tokens
            ids = ((chunk.get("choices") or [{}])[0].get("token_ids")) or []
            if ids and ttft is None:
                ttft = time.perf_counter() - t0
            tokens.extend(ids)
    if ttft is None or len(tokens) != max_tokens:
        raise RuntimeError(f"the answer held {len(tokens)} token ids, not {max_tokens}")
    return Answer(ttft, time.perf_counter() - t0, tokens, prompt_tokens)


async def _one(client: httpx.AsyncClient, spec: BenchSpec, part: dict[str, Any], idx: int
               ) -> Record:
    body = {"model": spec.model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": spec.max_tokens, "ignore_eos": True, "temperature": 0.0,
            "messages": [{"role": "user", "content": [
                part, {"type": "text", "text": spec.prompt}]}]}
    rec = Record(image=idx, ok=False, start=time.perf_counter())
    try:
        async with client.stream("POST", spec.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                choices = chunk.get("choices") or []
                if rec.ttft is None and choices and (choices[0].get("delta") or {}).get(
                        "content"):
                    rec.ttft = time.perf_counter() - rec.start
                usage = chunk.get("usage")
                if usage:
                    rec.tokens = int(usage.get("completion_tokens") or 0)
        rec.e2e = time.perf_counter() - rec.start
        rec.ok = rec.tokens > 0
        if not rec.ok:
            rec.error = "no tokens"
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


async def run_bench(spec: BenchSpec, progress: bool = True) -> BenchResult:
    """Run the workload against `spec.url`; never raises for failed requests (counted)."""
    seq = image_sequence(spec)
    parts = {i: item_part(spec, i)[1] for i in sorted(set(seq))}
    bar = _Progress(len(seq), spec.label or spec.url) if progress else None
    sem = asyncio.Semaphore(spec.concurrency)
    rng = random.Random(spec.seed + 1)
    limits = httpx.Limits(max_connections=spec.concurrency * 2)
    async with httpx.AsyncClient(timeout=spec.timeout_s, limits=limits) as client:
        async def task(i: int) -> Record:
            async with sem:
                rec = await _one(client, spec, parts[seq[i]], seq[i])
            if bar is not None:
                bar.update(1)
            return rec

        t0 = time.perf_counter()
        tasks = []
        for i in range(len(seq)):
            tasks.append(asyncio.create_task(task(i)))
            if math.isfinite(spec.request_rate):
                await asyncio.sleep(rng.expovariate(spec.request_rate))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return BenchResult(spec=asdict(spec) | {"request_rate": str(spec.request_rate)},
                       duration_s=duration, summary=summarize(records, duration),
                       records=[asdict(r) for r in records])


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """A fixed-width table of summaries, one row per label."""
    cols = [("req/s", "req_per_s", 2), ("tok/s", "out_tok_per_s", 0),
            ("TTFT p50", "ttft_ms_p50", 1), ("p90", "ttft_ms_p90", 1), ("p99", "ttft_ms_p99", 1),
            ("TPOT p50", "tpot_ms_p50", 2), ("E2E p50", "e2e_ms_p50", 1),
            ("p90", "e2e_ms_p90", 1), ("p99", "e2e_ms_p99", 1), ("errors", "errors", 0)]
    width = max(len(k) for k in results) + 2
    lines = ["".ljust(width) + "".join(c[0].rjust(10) for c in cols) + "   (ms)"]
    for label, s in results.items():
        cells = []
        for _, key, nd in cols:
            v = s.get(key)
            cells.append(("-" if v is None else f"{v:.{nd}f}").rjust(10))
        lines.append(label.ljust(width) + "".join(cells))
    return "\n".join(lines)


def plot(results: dict[str, BenchResult], path: Path) -> bool:
    """CDFs of TTFT and end-to-end latency, one line per run, and throughput per run.

    Returns False (with a note on stderr, nothing written) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print(f"epd bench: no plot written to {path}: install epd-serve[bench] for the plot",
              file=sys.stderr, flush=True)
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, res in results.items():
        ok = [r for r in res.records if r["ok"]]
        for ax, key in zip(axes[:2], ("ttft", "e2e"), strict=True):
            vals = np.sort([r[key] * 1e3 for r in ok if r[key] is not None])
            if len(vals):
                ax.plot(vals, np.arange(1, len(vals) + 1) / len(vals), label=label)
    for ax, name in zip(axes[:2], ("TTFT (ms)", "end-to-end latency (ms)"), strict=True):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    labels = list(results)
    axes[2].bar(labels, [results[k].summary["req_per_s"] for k in labels])
    axes[2].set_ylabel("requests / s")
    axes[2].tick_params(axis="x", labelrotation=15)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_json(results: dict[str, BenchResult], path: Path, extra: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": {k: asdict(v) for k, v in results.items()},
                                **(extra or {})}, indent=1))


def default_output_dir() -> Path:
    """The default directory for a run's JSON and PNG.

    Where a run's JSON and PNG go unless --json/--png say otherwise: the work directory
    (ignored by git), as `epd up` and the test models use it."""
    return default_work_dir() / "bench"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="epd bench", description="benchmarks")
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("serve", help="multimodal load against an OpenAI-compatible endpoint")
    s.add_argument("--url", required=True, help="base URL (gateway or vLLM server)")
    s.add_argument("--model", default="tiny-llava")
    s.add_argument("--mix", default="image", help="modalities of the items and their weights, "
                   "e.g. image=2,video=1,audio=1 (default: images only)")
    s.add_argument("--num-requests", type=int, default=200)
    s.add_argument("--concurrency", type=int, default=8)
    s.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (default: as fast as concurrency allows)")
    s.add_argument("--reuse", type=float, default=0.5, help="share of requests repeating an "
                   "image already sent")
    s.add_argument("--distinct-images", type=int, help="overrides --reuse")
    s.add_argument("--zipf", type=float, default=0.0, help="> 0: requests pick among "
                   "--distinct-images with Zipf popularity of this exponent (e.g. 1.1)")
    s.add_argument("--max-tokens", type=int, default=16)
    s.add_argument("--image-size", type=int, default=112)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--label", default="run")
    out = default_output_dir()
    s.add_argument("--json", type=Path, default=out / "bench-serve.json",
                   help="default: $EPD_WORK_DIR (else ./.work)/bench/bench-serve.json")
    s.add_argument("--png", type=Path, default=out / "bench-serve.png",
                   help="default: beside the JSON, bench-serve.png")
    s.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    try:
        mix = parse_mix(a.mix)
    except ValueError as exc:
        print(f"epd bench serve: {exc}", file=sys.stderr)
        return 2
    if not 0 <= a.reuse < 1 or a.num_requests < 1 or a.concurrency < 1:
        print("epd bench serve: need 0 <= reuse < 1, num-requests >= 1, concurrency >= 1",
              file=sys.stderr)
        return 2
    spec = BenchSpec(url=a.url.rstrip("/"), model=a.model, num_requests=a.num_requests,
                     concurrency=a.concurrency, request_rate=a.request_rate, reuse=a.reuse,
                     distinct_images=a.distinct_images, max_tokens=a.max_tokens,
                     image_size=a.image_size, seed=a.seed, label=a.label, mix=mix,
                     zipf=a.zipf)
    res = asyncio.run(run_bench(spec, progress=not a.no_progress))
    print(format_table({a.label: res.summary}))
    write_json({a.label: res}, a.json)
    plotted = plot({a.label: res}, a.png)
    print(f"wrote {a.json} and {a.png}" if plotted else f"wrote {a.json}")
    return 0 if res.summary["errors"] == 0 else 1
