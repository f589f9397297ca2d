"""What an item's GPU ends cost on a GPU host: the copies a vLLM worker makes around a
transport when the encoder output is on the GPU (producer) and vLLM's encoder cache is on the
GPU (consumer), and the shm path end to end with those ends. Needs CUDA.

    python -m benchmarks.transports.gpu_path [--sizes-mb 30 125] [--reps 10] [--json FILE]

Copies (one process, medians; bf16 [rows, 4096] items):
  memcpy              host -> host, warm preallocated destination (transports/paths.py's limit)
  d2h_pageable        `tensor.to("cpu")`: a fresh pageable destination (what the worker did)
  d2h_pinned          `host_copy`: torch's caching pinned allocator (what the worker does now)
  d2h_shm_registered  straight into a /dev/shm mapping registered with cudaHostRegister
                      (how an arena block could take the copy itself)
  h2d_pageable        from a pageable host tensor
  h2d_pinned          from the consumer's pinned pool block (the worker's staging copy)
  h2d_shm_registered  from a registered /dev/shm mapping
End to end (two `peer_process`es, shm transport, xxh3): the producer's host copy of a GPU
tensor (pageable, then pinned) + put, the consumer's get + copy to the GPU.
JSON: {"<MiB>": {"copies": {name: ms}, "shm_e2e": {"pageable"|"pinned": {"host_copy_ms",
"put_ms", "get_ms", "to_device_ms", "ms"}}}}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import sys
import time
import uuid

import torch

from benchmarks.harness.peers import CONSUMER, HIDDEN, PRODUCER
from benchmarks.harness.report import MiB
from ec_connectors.transports.base import checksum, host_copy, tensor_bytes
from epd_testkit.peer_process import PeerClient, seeded_tensor


def _median_ms(fn, reps: int) -> float:
    fn()  # warm-up: first-touch faults, allocator caches, context
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


class _Registered:
    """A /dev/shm file mapping registered with CUDA (page-locked for DMA), as a uint8 tensor."""

    def __init__(self, nbytes: int) -> None:
        self.path = f"/dev/shm/epd-gpu-bench-{uuid.uuid4().hex[:8]}"
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            self.map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
        self.registered = int(err) == 0
        if not self.registered:
            print(f"  cudaHostRegister failed ({err}): d2h/h2d_shm_registered are pageable",
                  file=sys.stderr)

    def close(self) -> None:
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        del self.tensor
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes at exit
            self.map.close()
        os.unlink(self.path)


def copies(nbytes: int, reps: int) -> dict[str, float]:
    dev = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    warm = torch.empty_like(host)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.copy_(host)
    reg = _Registered(nbytes)
    try:
        out = {
            "memcpy": _median_ms(lambda: warm.copy_(host), reps),
            "d2h_pageable": _median_ms(lambda: host_copy(dev, pinned=False), reps),
            "d2h_pinned": _median_ms(lambda: host_copy(dev), reps),
            "d2h_shm_registered": _median_ms(lambda: reg.tensor.copy_(dev), reps),
            "h2d_pageable": _median_ms(lambda: host.to("cuda"), reps),
            "h2d_pinned": _median_ms(lambda: pinned.to("cuda"), reps),
            "h2d_shm_registered": _median_ms(lambda: reg.tensor.to("cuda"), reps),
        }
        if not torch.equal(reg.tensor.to("cuda"), dev):
            raise AssertionError("the registered mapping does not hold what was copied in")
        return out
    finally:
        reg.close()


def shm_e2e(sizes: list[int], reps: int) -> dict[int, dict[str, dict[str, float]]]:
    root = f"/dev/shm/epd-gpu-bench-{uuid.uuid4().hex[:8]}"
    top = max(sizes)
    cfg = {"transport": "shm", "shm_path": root, "shm_lease_ttl_s": 0.05, "namespace": "bench",
           "shm_arena_bytes": 3 * top + 16 * MiB, "shm_consumer_pool_bytes": 2 * top + 16 * MiB}
    log = os.environ.get("EPD_BENCH_LOG")  # the peers' stderr (default: dropped)
    prod, cons = PeerClient(log_path=log), PeerClient(log_path=log)
    try:
        prod.call({"op": "init", "config": cfg,
                   "placement": PRODUCER}, 120)
        cons.call({"op": "init", "config": cfg,
                   "placement": CONSUMER}, 120)
        out: dict[int, dict[str, dict[str, float]]] = {}
        for n in sizes:
            shape = [n // (HIDDEN * 2), HIDDEN]
            want = checksum(tensor_bytes(seeded_tensor(n, shape, "bfloat16")))
            out[n] = {}
            for mode in ("pageable", "pinned"):
                rows: dict[str, list[float]] = {}
                for rep in range(reps + 1):
                    item = f"{mode}-{n}-{rep}"
                    put = prod.call({"op": "put", "id": item, "seed": n, "shape": shape,
                                     "dtype": "bfloat16", "device": "cuda",
                                     "pinned": mode == "pinned"}, 120)
                    got = cons.call({"op": "get", "id": item, "timeout_s": 30,
                                     "to_device": "cuda"}, 120)
                    if not got.get("found") or got["checksum"] != want:
                        raise AssertionError(f"{item}: consumer got {got}")
                    if rep == 0:
                        continue  # warm-up
                    for k, v in (("host_copy_ms", put["host_copy_s"]),
                                 ("put_ms", put["put_s"]), ("get_ms", got["get_s"]),
                                 ("to_device_ms", got["to_device_s"]),
                                 ("ms", put["put_s"] + got["get_s"] + got["to_device_s"])):
                        rows.setdefault(k, []).append(v * 1e3)
                out[n][mode] = {k: statistics.median(v) for k, v in rows.items()}
        return out
    finally:
        for p in (prod, cons):
            p.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[30, 125])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_path: no CUDA device here", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    sizes = [m * MiB for m in args.sizes_mb]
    result: dict[str, dict] = {}
    for n in sizes:
        c = copies(n, args.reps)
        result[str(n // MiB)] = {"copies": c}
        print(f"\n{n // MiB} MiB copies (ms, median of {args.reps}; GB/s):")
        for k, v in c.items():
            print(f"  {k:20s} {v:8.2f}   {n / v / 1e6:6.1f}   x memcpy {v / c['memcpy']:.2f}")
    e2e = shm_e2e(sizes, args.reps)
    for n, modes in e2e.items():
        result[str(n // MiB)]["shm_e2e"] = modes
        print(f"\n{n // MiB} MiB shm, GPU -> producer process -> consumer process -> GPU (ms):")
        for mode, r in modes.items():
            print(f"  host copy {mode:8s}: host_copy {r['host_copy_ms']:.2f}, put "
                  f"{r['put_ms']:.2f} (incl.), get {r['get_ms']:.2f}, to GPU "
                  f"{r['to_device_ms']:.2f}, total {r['ms']:.2f}")
        pg, pn = modes["pageable"]["ms"], modes["pinned"]["ms"]
        print(f"  pinned host copy: {pg / pn:.2f}x faster end to end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
