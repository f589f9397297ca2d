"""Items moved between `epd_testkit.peer_process` peers: item sizes in whole bf16 rows, the
peers' placements, and `mooncake_s`, one whole Mooncake TE `get` between two peers (pull
request, the producer's write into the consumer's registered pool, the reply, xxh3 of every
byte, the pool block handed over as a tensor)."""

from __future__ import annotations

import os
import statistics
import tempfile

from benchmarks.harness.report import MiB
from epd_testkit.peer_process import PeerClient

HIDDEN = 4096  # an item is a bf16 [rows, HIDDEN] tensor
PRODUCER = {"is_producer": True, "is_consumer": False}
CONSUMER = {"is_producer": False, "is_consumer": True}
LOOPBACK = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}  # the Mooncake engine on loopback


def item_bytes(mib: float) -> int:
    """`mib` MiB rounded down to whole bf16 rows of HIDDEN."""
    return int(mib * MiB) // (HIDDEN * 2) * HIDDEN * 2


def mooncake_s(sizes: list[int], reps: int, slice_size: str, base_port: int,
               verify: bool, pool_device: str = "cpu", chunk_bytes: int = 8 * MiB,
               **extra) -> dict[int, float]:
    """Median seconds of one consumer `get` per size through the TE transport (the first
    pull opens the engine's connection and is not counted); `extra`: connector keys."""
    env = dict(LOOPBACK)
    if slice_size != "default":
        env["MC_TCP_SLICE_SIZE"] = slice_size
    cfg = {"transport": "mooncake", "host": "127.0.0.1", "base_port": base_port,
           "memory_pool_bytes": 512 * MiB, "verify_checksum": verify,
           "memory_pool_device": pool_device, "transfer_chunk_bytes": chunk_bytes, **extra}
    log = os.path.join(tempfile.gettempdir(), "epd-mooncake-bench.log")
    prod = PeerClient(env=env, log_path=log)
    cons = PeerClient(env=env, log_path=log)
    try:
        ep = prod.call({"op": "init", "config": cfg, "placement": PRODUCER})["endpoint"]
        cons.call({"op": "init", "config": cfg, "placement": CONSUMER})
        out = {}
        for nbytes in sizes:
            item = f"bench-{nbytes}"
            put = prod.call({"op": "put", "id": item, "seed": nbytes % 1000,
                             "shape": [nbytes // (HIDDEN * 2), HIDDEN], "dtype": "bfloat16"})
            times = []
            for i in range(reps + 1):
                got = cons.call({"op": "get", "id": item, "timeout_s": 30, "location": ep,
                                 "nbytes": put["nbytes"]})
                if not got["found"] or got["checksum"] != put["checksum"]:
                    raise RuntimeError(f"bad transfer of {nbytes} bytes: {got}")
                if i:
                    times.append(got["get_s"])
            out[nbytes] = statistics.median(times)
        return out
    finally:
        prod.close()
        cons.close()
