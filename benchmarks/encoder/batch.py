"""Per-image throughput of the pool's vision encoder (tower + projector) by batch size, on one
device, without HTTP: what cross-request batching can buy at most.

    .venv/bin/python -m benchmarks.encoder.batch [--spec large] [--device cuda]
        [--batch-sizes 1 2 4 8 16] [--seconds 3]

Builds the random LLaVA of `--spec` locally (encoder_service/local/testmodels) once; prints
images/s per batch size and the ratio to batch 1.
"""

from __future__ import annotations

import argparse
import io
import time
from pathlib import Path

import torch
from PIL import Image

from encoder_service.encoder_pool.media import MediaItem
from encoder_service.encoder_pool.models import load_encoder
from encoder_service.local.requests import sample_image_png
from encoder_service.local.testmodels import SPECS, build


def images_per_s(encoder, items: list[MediaItem], seconds: float, sync) -> float:
    encoder.encode(items)  # warm: kernels, allocator
    sync()
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        encoder.encode(items)
        done += len(items)
    sync()
    return done / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="large", choices=sorted(SPECS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--work", type=Path, default=Path(".work/models"))
    args = ap.parse_args()

    model = build(args.work / f"{args.spec}-llava", SPECS[args.spec])
    encoder = load_encoder(model, device=args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    images = [Image.open(io.BytesIO(sample_image_png(seed=i))).convert("RGB")
              for i in range(max(args.batch_sizes))]
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"encoder of spec {args.spec!r} on {args.device} ({name}), "
          f"{args.seconds:.0f} s per batch size")
    base = None
    for bs in args.batch_sizes:
        items = [encoder.prepare(MediaItem(item_id=f"b{i}", modality="image", media=images[i]))
                 for i in range(bs)]
        rate = images_per_s(encoder, items, args.seconds, sync)
        base = base or rate
        print(f"  batch {bs:3d}: {rate:9.1f} images/s   {rate / base:5.2f}x batch 1", flush=True)


if __name__ == "__main__":
    main()
