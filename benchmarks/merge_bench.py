"""Position-map merge: vectorized (`merge_embeddings`) vs a per-token Python loop.

    .venv/bin/python benchmarks/merge_bench.py [--tokens 5000] [--dim 4096] [--device cuda]

A prompt of `--tokens` merged rows: `--images` images of `--image-tokens` rows each, the rest
text, embedding table of `--vocab` rows in bf16. Prints medians and the speed-up (target 10x).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from encoder_service.encoder_pool.merge import (
    ItemRef,
    build_position_map,
    merge_embeddings,
    merge_loop,
)

PLACEHOLDER = 3


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=5000)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--image-tokens", type=int, default=576)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--device", default="cpu", help="where the table, features and output live")
    args = p.parse_args(argv)
    n_text = args.tokens - args.images * args.image_tokens
    if n_text < args.images:
        p.error("too few tokens for that many image tokens")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.vocab, args.dim, generator=g).to(args.device, torch.bfloat16)
    items = [ItemRef(f"img-{i}", "image", args.image_tokens) for i in range(args.images)]
    feats = {it.item_id: torch.randn(it.num_tokens, args.dim, generator=g).to(
        args.device, torch.bfloat16) for it in items}
    text = torch.randint(10, args.vocab, (n_text,), generator=g).tolist()
    ids: list[int] = []
    chunk = n_text // (args.images + 1)
    for i in range(args.images):
        ids += text[i * chunk:(i + 1) * chunk] + [PLACEHOLDER]
    ids += text[args.images * chunk:]
    ph = {PLACEHOLDER: "image"}

    def vectorized():
        return merge_embeddings(build_position_map(ids, items, ph), weight, feats)

    def loop():
        return merge_loop(ids, items, ph, weight, feats)

    out_fast, out_slow = vectorized(), loop()
    assert out_fast.shape == (args.tokens, args.dim) and torch.equal(out_fast, out_slow)
    pmap = build_position_map(ids, items, ph)
    t_map = median_s(lambda: build_position_map(ids, items, ph), args.repeat)
    t_merge = median_s(lambda: merge_embeddings(pmap, weight, feats), args.repeat)
    t_fast = median_s(vectorized, args.repeat)
    t_loop = median_s(loop, max(3, args.repeat // 5))
    buf = torch.zeros(args.tokens, args.dim, dtype=torch.bfloat16,
                      device=args.device)  # persistent, pre-touched
    t_fast_buf = median_s(
        lambda: merge_embeddings(build_position_map(ids, items, ph), weight, feats, out=buf),
        args.repeat)
    t_loop_buf = median_s(lambda: merge_loop(ids, items, ph, weight, feats, out=buf),
                          max(3, args.repeat // 5))
    print(f"merge on {args.device}: {args.tokens} tokens x {args.dim} (bf16; {args.images} "
          f"images x {args.image_tokens} + {n_text} text tokens), medians:")
    print(f"  position map                         {t_map * 1e3:8.3f} ms")
    print(f"  vectorized merge (map given)         {t_merge * 1e3:8.3f} ms")
    print("  into a reused output buffer (as a serving engine's inputs_embeds):")
    print(f"    map + vectorized merge             {t_fast_buf * 1e3:8.3f} ms")
    print(f"    per-token Python loop              {t_loop_buf * 1e3:8.3f} ms")
    print(f"    speed-up: {t_loop_buf / t_fast_buf:.1f}x (target >= 10x)")
    print("  into a freshly allocated output (both pay ~8 ms of first-touch page faults):")
    print(f"    map + vectorized merge             {t_fast * 1e3:8.3f} ms")
    print(f"    per-token Python loop              {t_loop * 1e3:8.3f} ms")
    print(f"    speed-up: {t_loop / t_fast:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
