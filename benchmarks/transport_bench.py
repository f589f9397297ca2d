"""Save + load of bf16 embeddings: the safetensors transport vs the ECExampleConnector pattern
(`safetensors.torch.save_file` + `load_file`) vs plain memcpy, in one run.

    .venv/bin/python benchmarks/transport_bench.py [--sizes-mb 8 48 125] [--reps 5] [--dir DIR]

Prints per size: milliseconds (median), GB/s and ratios. "Critical path" is what the model
runner waits for: the example connector saves and loads synchronously inside the step; ours
enqueues the save (the write happens on a background thread) and places a tensor that was
staged before the request was scheduled.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ec_connectors.transports.safetensors_fs import SafetensorsTransport

HIDDEN = 4096


def median_ms(fn, reps: int) -> float:
    fn()  # warm (page cache, allocator)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_size(mb: float, reps: int, root: Path) -> dict[str, float]:
    rows = int(mb * (1 << 20)) // (HIDDEN * 2)
    x = torch.randn(rows, HIDDEN).to(torch.bfloat16)
    nbytes = x.numel() * 2
    dst = torch.empty_like(x)
    ours = SafetensorsTransport(root / "ours", "bench", max_bytes=1 << 40)
    example_path = root / "example" / "encoder_cache.safetensors"
    example_path.parent.mkdir(parents=True, exist_ok=True)

    def memcpy():
        dst.copy_(x)

    def example_save():
        save_file({"ec_cache": x}, str(example_path))

    def example_load():
        y = load_file(str(example_path))["ec_cache"]
        assert y.shape == x.shape

    def ours_save():
        ours.put("item", x)

    def ours_load():
        y = ours.get("item", time.monotonic() + 1)  # mmap + full checksum verification
        assert y is not None and y.shape == x.shape

    r = {"mb": nbytes / (1 << 20), "memcpy": median_ms(memcpy, reps)}
    r["example_save"] = median_ms(example_save, reps)
    r["example_load"] = median_ms(example_load, reps)
    r["ours_save"] = median_ms(ours_save, reps)
    r["ours_load"] = median_ms(ours_load, reps)
    staged = {"item": x}
    cache: dict[str, torch.Tensor] = {}
    r["ours_place"] = median_ms(lambda: cache.__setitem__("item", staged["item"]), reps)
    r["gbps"] = nbytes / 1e9
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[8, 48, 125])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="storage dir (default: a temp dir)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="epd-bench-", dir=args.dir))
    print(f"storage: {root}  (bf16 [rows, {HIDDEN}], median of {args.reps})")
    hdr = (f"{'size':>8} | {'memcpy':>8} | {'example save+load':>18} | {'ours save+load':>15} | "
           f"{'ours/example':>12} | {'ours/memcpy':>11} | {'crit. path example':>18} | "
           f"{'crit. path ours':>15}")
    print(hdr)
    print("-" * len(hdr))
    try:
        for mb in args.sizes_mb:
            r = bench_size(mb, args.reps, root)
            gb = r["gbps"]
            ex = r["example_save"] + r["example_load"]
            ours = r["ours_save"] + r["ours_load"]
            crit_ex = ex
            crit_ours = r["ours_place"]
            size = f"{r['mb']:>6.0f}MB"
            print(f"{size} | {r['memcpy']:>6.1f}ms | {ex:>8.1f}ms {gb / ex * 1e3:>5.2f}GB/s | "
                  f"{ours:>7.1f}ms {gb / ours * 1e3:>4.2f}GB/s | {ex / ours:>11.2f}x | "
                  f"{ours / r['memcpy']:>10.1f}x | {crit_ex:>16.1f}ms | {crit_ours:>13.4f}ms")
            print(f"{'':>8}   save {r['ours_save']:.1f} ms vs {r['example_save']:.1f} ms, "
                  f"load {r['ours_load']:.1f} ms (verified) vs {r['example_load']:.1f} ms")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
