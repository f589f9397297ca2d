"""Producer process -> consumer process through the Mooncake TE transport (TCP), beside this
machine's limits: a raw TCP socket on loopback and memcpy, in one run. Also the scheduler's
`has_cache_item` latency with 100,000 indexed items.

    .venv/bin/python -m benchmarks.transports.mooncake [--sizes-mb 8 48 125] [--reps 7]
        [--slice-sizes default 262144 1048576]

"bare engine" is one `transfer_sync_write` with nothing around it (the engine's ceiling).
"ours" is one whole `get`: pull request, the producer's transfer-engine write into the
consumer's registered pool, the reply, xxh3 verification of every byte, and the hand-over of
the pool block as a tensor (no copy). "no checksum" is the same with verify_checksum off.
Each slice size runs in fresh processes (MC_TCP_SLICE_SIZE is read at engine start).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import torch

from benchmarks.harness.floors import memcpy_s, raw_tcp_s
from benchmarks.harness.peers import item_bytes, mooncake_s
from benchmarks.harness.report import MiB, say
from ec_connectors.protocol import ports


def _te_sink(q, nbytes: int) -> None:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    os.environ.update(ports.engine_env([], os.environ))  # the port plan's range
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buf = torch.empty(nbytes, dtype=torch.uint8)
    engine.register_memory(buf.data_ptr(), nbytes)
    q.put((engine.get_rpc_port(), buf.data_ptr()))
    time.sleep(600)


def engine_only_s(sizes: list[int], reps: int) -> dict[int, float]:
    """Bare `transfer_sync_write` between two processes: the engine's own TCP ceiling."""
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    os.environ.update(ports.engine_env([], os.environ))  # the port plan's range
    from mooncake.engine import TransferEngine

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    sink = ctx.Process(target=_te_sink, args=(q, max(sizes)), daemon=True)
    sink.start()
    try:
        port, dst = q.get(timeout=60)
        engine = TransferEngine()
        engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        src = torch.randint(0, 256, (max(sizes),), dtype=torch.uint8)
        engine.register_memory(src.data_ptr(), src.numel())
        out = {}
        for n in sizes:
            times = []
            for i in range(reps + 1):
                t0 = time.perf_counter()
                rc = engine.transfer_sync_write(f"127.0.0.1:{port}", src.data_ptr(), dst, n)
                if rc != 0:
                    raise RuntimeError(f"transfer_sync_write returned {rc}")
                if i:
                    times.append(time.perf_counter() - t0)
            out[n] = statistics.median(times)
        return out
    finally:
        sink.kill()


def has_cache_item_ns(n_items: int = 100_000) -> dict[str, float]:
    """Median ns per `has_cache_item` call on a consumer's and a producer's scheduler side
    holding `n_items` (index and item tables filled directly: this measures the lookup)."""
    from ec_connectors.config import EPDConfig
    from ec_connectors.control.endpoint import control_address
    from ec_connectors.protocol.keys import item_key
    from ec_connectors.sched.scheduler import EPDSchedulerSide
    from ec_connectors.transports import make_transport

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="epdb-", dir="/tmp") as tmp:
        cfg = EPDConfig.from_dict({"storage_path": tmp, "control_dir": tmp, "namespace": "b"})
        ids = [f"sha256:{i:064x}" for i in range(n_items)]
        for role in ("consumer", "producer"):
            side = EPDSchedulerSide(cfg, make_transport(cfg), is_producer=role == "producer",
                                    is_consumer=role == "consumer",
                                    address=control_address(tmp, role, 0), engine_id=role,
                                    start_index=False)
            now = time.monotonic()
            for item_id in ids:
                if role == "consumer":  # staged on its one worker: STAGED
                    side.items.begin(item_id, now, 60.0)
                    side.items.staged(item_id, 0, True, 16, "", {0}, now)
                else:
                    side.index.add(item_key(item_id))
            probes = ids[::97] + [f"miss-{i}" for i in range(len(ids[::97]))]
            per_call = []
            for _ in range(5):
                for start in range(0, len(probes), 500):
                    chunk = probes[start:start + 500]
                    t0 = time.perf_counter_ns()
                    for item_id in chunk:
                        side.has_cache_item(item_id)
                    per_call.append((time.perf_counter_ns() - t0) / len(chunk))
            out[role] = statistics.median(per_call)
            side.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[8, 48, 125])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--slice-sizes", nargs="+", default=["default"],
                    help="MC_TCP_SLICE_SIZE values (no effect seen on loopback TCP)")
    ap.add_argument("--chunk-mib", type=float, nargs="+", default=[0, 4, 8, 16],
                    help="transfer_chunk_bytes values: 0 = one write, verify after")
    ap.add_argument("--base-port", type=int, default=17500)
    ap.add_argument("--pool-device", choices=["cpu", "cuda"], default="cpu",
                    help="registered pools on the GPU (GPUDirect where the NIC allows)")
    args = ap.parse_args()
    sizes = [item_bytes(mb) for mb in args.sizes_mb]

    say(f"memcpy and raw TCP baselines ({args.reps} reps each)...")
    base = {n: (memcpy_s(n, args.reps), raw_tcp_s(n, args.reps)) for n in sizes}
    say("bare transfer engine write (the engine's TCP ceiling)...")
    engine = engine_only_s(sizes, args.reps)
    runs: dict[str, dict[int, float]] = {}
    combos = [(sl, int(c * MiB)) for sl in args.slice_sizes for c in args.chunk_mib]
    for i, (slice_size, chunk) in enumerate(combos):
        name = f"slice {slice_size}, chunk {chunk / MiB:g} MiB"
        say(f"mooncake tcp, {name}...")
        runs[name] = (mooncake_s(sizes, args.reps, slice_size, args.base_port + 10 * i,
                                 verify=True, pool_device=args.pool_device, chunk_bytes=chunk),
                      (slice_size, chunk))
    best = min(runs, key=lambda k: sum(runs[k][0].values()))
    say(f"mooncake tcp, {best}, no checksum...")
    slice_size, chunk = runs[best][1]
    unverified = mooncake_s(sizes, args.reps, slice_size, args.base_port + 500, verify=False,
                            pool_device=args.pool_device, chunk_bytes=chunk)

    def gbs(n: int, s: float) -> str:
        return f"{n / s / 1e9:5.2f} GB/s"

    print(f"\nProducer process -> consumer process, pools on {args.pool_device} "
          "(median; GB/s = 1e9 bytes/s)")
    for n in sizes:
        mem, tcp = base[n]
        print(f"\n{n / MiB:.0f} MiB   memcpy {mem * 1e3:7.2f} ms {gbs(n, mem)}   "
              f"raw TCP {tcp * 1e3:7.2f} ms {gbs(n, tcp)}")
        e = engine[n]
        print(f"  bare engine write        {e * 1e3:7.2f} ms {gbs(n, e)}   "
              f"{tcp / e:4.2f}x raw TCP")
        for name, (res, _) in runs.items():
            s = res[n]
            print(f"  ours, {name:<28} {s * 1e3:7.2f} ms {gbs(n, s)}   "
                  f"{tcp / s:4.2f}x raw TCP   {mem / s:4.2f}x memcpy")
        s = unverified[n]
        print(f"  ours, {best}, no checksum {s * 1e3:7.2f} ms {gbs(n, s)}   "
              f"{tcp / s:4.2f}x raw TCP   {e / s:4.2f}x bare engine")
    print("\nhas_cache_item with 100,000 indexed items (median per call, hits and misses):")
    for role, ns in has_cache_item_ns().items():
        print(f"  {role:<9} {ns:7.0f} ns")


if __name__ == "__main__":
    main()
