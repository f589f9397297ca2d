"""Items held where they lie against items copied into the pool: put, then get, nothing else.

    .venv/bin/python -m benchmarks.transports.in_place [--transports nixl mooncake] [--mb 125]
        [--reps 9] [--rounds 2]

A producer process puts fresh host items (made right before each put, as vLLM's encoder
output is) and a consumer process gets each at once, `producer_put` in_place then copy,
rounds interleaved; medians of `reps` (the first two of each round are warm-ups). Unlike
transports/paths.py, no yardstick copy or checksum of the whole item runs between the put
and the get: what a producer's worker does. Prints put, get and put + get per mode and the
in_place / copy ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

from benchmarks.harness.report import MiB


def _config(transport: str, base: int, **extra):
    from ec_connectors.config import EPDConfig

    return EPDConfig.from_dict({"transport": transport, "host": "127.0.0.1",
                                "base_port": base, "memory_pool_bytes": 1024 * MiB,
                                "lease_ttl_s": 0.05, "lease_min_s": 0.05, **extra})


def _produce(transport: str, base: int, mode: str, nbytes: int, out, orders) -> None:
    import torch

    from ec_connectors.transports import Placement, make_transport

    store = make_transport(_config(transport, base, producer_put=mode),
                           Placement(is_consumer=False))
    out.put(store.endpoint)
    while (item_id := orders.get()) is not None:
        item = torch.randn(nbytes // 4)  # fresh, as an encoder output
        t0 = time.perf_counter()
        store.put(item_id, item)
        out.put(time.perf_counter() - t0)
        del item
    os._exit(0)  # a NIXL agent's process segfaults at interpreter exit (NIXL 1.5.1)


def run(transport: str, mode: str, nbytes: int, reps: int, base: int) -> tuple[float, float]:
    """Median (put, get) seconds of one round."""
    from ec_connectors.transports import Placement, make_transport

    ctx = mp.get_context("spawn")
    out, orders = ctx.Queue(), ctx.Queue()
    producer = ctx.Process(target=_produce, args=(transport, base, mode, nbytes, out, orders))
    producer.start()
    consumer = None
    try:
        endpoint = out.get(timeout=120)
        consumer = make_transport(_config(transport, base, producers=[endpoint]),
                                  Placement(is_producer=False))
        puts, gets = [], []
        for i in range(reps + 2):
            orders.put(f"{mode}-{i}")
            puts.append(out.get(timeout=120))
            t0 = time.perf_counter()
            got = consumer.get(f"{mode}-{i}", time.monotonic() + 30, location=endpoint)
            gets.append(time.perf_counter() - t0)
            if got is None:
                raise RuntimeError(f"{transport} {mode}: item {i} did not arrive")
            del got
        return statistics.median(puts[2:]), statistics.median(gets[2:])
    finally:
        orders.put(None)
        producer.join(30)
        if producer.is_alive():
            producer.kill()
        if consumer is not None:
            consumer.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transports", nargs="+", default=["nixl", "mooncake"],
                    choices=["nixl", "mooncake"])
    ap.add_argument("--mb", type=float, default=125)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--base-port", type=int, default=26300)
    args = ap.parse_args()
    nbytes = int(args.mb * MiB) // 4 * 4
    print(f"{args.mb:g} MiB float32 items, median of {args.reps} per round; ms put / get / "
          "put + get", flush=True)
    base = args.base_port
    for transport in args.transports:
        for r in range(args.rounds):
            row = {}
            for mode in ("in_place", "copy"):
                base += 10
                row[mode] = run(transport, mode, nbytes, args.reps, base)
                put, get = row[mode]
                print(f"{transport:<9} round {r + 1} {mode:<9} {put * 1e3:7.1f} "
                      f"{get * 1e3:7.1f} {(put + get) * 1e3:7.1f}", flush=True)
            ratio = sum(row["in_place"]) / sum(row["copy"])
            print(f"{transport:<9} round {r + 1} in_place / copy: {ratio:.2f}", flush=True)
    os._exit(0)  # this process made a NIXL agent (the consumer's): see _produce


if __name__ == "__main__":
    main()
