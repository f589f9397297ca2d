"""Put and get of one embedding, producer process -> consumer process on loopback, through a raw
TCP socket (the ceiling), the Mooncake Transfer Engine transport (`transport: "mooncake"`) and
the Mooncake Store transport (`transport: "mooncake_store"`, with a real `mooncake_master`), in
one run.

    .venv/bin/python -m benchmarks.transports.store [--sizes-mb 8 48 125] [--reps 5]
        [--master-port 20900] [--te-base-port 16000] [--json PATH] [--secret]

`--secret` runs the TE get and the store put/get again with a deployment secret (CURVE on the
side channel, sealed store objects: HMAC-SHA256 on put and get) and prints the cost of
authentication as ratios; 64 KiB items (inline: their bytes cross the encrypted side channel)
are added to the sizes.

"raw TCP" is `raw_tcp_s` of benchmarks/harness/floors.py: one stream into a preallocated
buffer, acknowledged. "TE get" is `mooncake_s` of benchmarks/harness/peers.py: one whole
consumer `get` (pull request, the producer's engine write into the consumer's registered
pool, xxh3 verify). "store put" is the producer's `put`: the copy into its registered buffer,
xxh3 of the payload, `upsert_from` into the store (which lands in the producer's own
segment). "store get" is the consumer's `get`: `get_size`, `get_into` from the producer's
segment into the consumer's registered buffer, header and xxh3 verification; "no verify" is
the same with verify_checksum off (a second consumer). Every store rep uses a fresh item id,
so every get is a real transfer; each get's checksum is compared with its put's. The first
rep of each size warms connections and is not counted; medians of the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from benchmarks.harness.env import ROOT
from benchmarks.harness.floors import raw_tcp_s
from benchmarks.harness.peers import CONSUMER, HIDDEN, LOOPBACK, PRODUCER, item_bytes, mooncake_s
from benchmarks.harness.report import MiB, say
from encoder_service.local.mooncake_master import master_server
from encoder_service.local.processes import default_work_dir
from epd_testkit.peer_process import PeerClient

WORK = default_work_dir(ROOT) / "store-bench"
GiB = 1 << 30


def store_s(sizes: list[int], reps: int, master_port: int, **extra_config
            ) -> dict[int, dict[str, float]]:
    """Median seconds per size of the store put, get (verified) and get without verify."""
    WORK.mkdir(parents=True, exist_ok=True)
    master = master_server(WORK, master_port)
    # Every rep's item stays in the producer's segment: room for all of them, so nothing is
    # evicted under the benchmark; the registered buffers hold two of the largest items.
    segment = max(1 * GiB, int(1.25 * sum((n + 512) * (reps + 1) for n in sizes)))
    buffer = 2 * max(sizes) + 64 * MiB
    peers: list[PeerClient] = []

    def peer(placement: dict, **extra) -> PeerClient:
        p = PeerClient(env=LOOPBACK,
                       log_path=str(WORK / f"peer-{len(peers)}.log"))
        peers.append(p)
        config = {"transport": "mooncake_store", "host": "127.0.0.1",
                  "store_master": master.address, "store_metadata": master.metadata_url,
                  "store_segment_bytes": 0, "store_buffer_bytes": buffer,
                  "namespace": "store-bench", "embedding_dtype": "bfloat16",
                  **extra_config, **extra}
        p.call({"op": "init", "config": config, "placement": placement})
        return p

    try:
        master.start().wait()
        prod = peer(PRODUCER, store_segment_bytes=segment)
        consumers = {"get": peer(CONSUMER), "get_nv": peer(CONSUMER, verify_checksum=False)}
        out: dict[int, dict[str, float]] = {}
        for n in sizes:
            times: dict[str, list[float]] = {"put": [], "get": [], "get_nv": []}
            for i in range(reps + 1):
                item = f"bench-{n}-{i}"
                put = prod.call({"op": "put", "id": item, "seed": i, "dtype": "bfloat16",
                                 "shape": [n // (HIDDEN * 2), HIDDEN]}, timeout_s=120)
                if put["nbytes"] != n:
                    raise RuntimeError(f"put of {item} stored {put['nbytes']} bytes, not {n}")
                got = {}
                for name, cons in consumers.items():
                    got[name] = cons.call({"op": "get", "id": item, "timeout_s": 30},
                                          timeout_s=60)
                    if not got[name]["found"] or got[name]["checksum"] != put["checksum"]:
                        raise RuntimeError(f"store {name} of {item} ({n} bytes) is not what "
                                           f"was put: {got[name]} vs {put}")
                if i:  # the first rep opens the consumers' connections to the segment
                    times["put"].append(put["put_s"])
                    for name in consumers:
                        times[name].append(got[name]["get_s"])
            out[n] = {name: statistics.median(ts) for name, ts in times.items()}
        return out
    finally:
        for p in peers:
            p.close()
        master.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[8, 48, 125],
                    help="item sizes in MiB (rounded down to whole rows of 4096 bf16)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--master-port", type=int, default=20900,
                    help="store master RPC port; metadata on +1, metrics on +2")
    ap.add_argument("--te-base-port", type=int, default=16000,
                    help="TE producer side channel; its announcements use this + 1000")
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    ap.add_argument("--secret", action="store_true", help="also measure with a deployment "
                    "secret (CURVE side channel, sealed store objects) and print the ratios")
    args = ap.parse_args()
    sizes = [item_bytes(mb) for mb in args.sizes_mb]
    if args.secret:
        sizes = [64 * 1024, *sizes]

    say(f"raw TCP ({args.reps} reps)...")
    tcp = {n: raw_tcp_s(n, args.reps) for n in sizes}
    say("mooncake transfer engine get...")
    te = mooncake_s(sizes, args.reps, "default", args.te_base_port, verify=True)
    say("mooncake store put / get / get without verify...")
    store = store_s(sizes, args.reps, args.master_port)

    def cell(n: int, s: float) -> str:
        return f"{s * 1e3:9.2f} ms {s / tcp[n]:5.2f}x"

    print(f"\nProducer process -> consumer process on loopback, median of {args.reps} reps "
          "(GB/s = 1e9 bytes/s; Nx = time / raw TCP time)")
    print(f"{'size':>9} | {'raw TCP':^21} | {'TE get':^19} | {'store put':^19} | "
          f"{'store get':^19} | {'store get no verify':^19}")
    for n in sizes:
        t = tcp[n]
        print(f"{n / MiB:5.0f} MiB | {t * 1e3:7.2f} ms {n / t / 1e9:5.2f} GB/s | "
              f"{cell(n, te[n])} | {cell(n, store[n]['put'])} | {cell(n, store[n]['get'])} | "
              f"{cell(n, store[n]['get_nv'])}")

    if args.secret:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            secret = Path(tmp) / "secret"
            secret.write_bytes(os.urandom(32).hex().encode())
            secret.chmod(0o600)
            say("the same with a deployment secret...")
            te_s = mooncake_s(sizes, args.reps, "default", args.te_base_port + 100, verify=True,
                              secret_file=str(secret))
            store_sealed = store_s(sizes, args.reps, args.master_port + 10,
                                   secret_file=str(secret))
        print("\nCost of authentication (with the secret / without; medians of "
              f"{args.reps}): TE get (CURVE side channel), store put and get (sealed)")
        for n in sizes:
            label = f"{n / MiB:5.0f} MiB" if n >= MiB else f"{n // 1024:5d} KiB"
            print(f"{label} | TE get {te_s[n] * 1e3:8.2f} vs {te[n] * 1e3:8.2f} ms "
                  f"({te_s[n] / te[n]:4.2f}x) | store put {store_sealed[n]['put'] * 1e3:8.2f} "
                  f"vs {store[n]['put'] * 1e3:8.2f} ms ({store_sealed[n]['put'] / store[n]['put']:4.2f}x) | "  # noqa: E501
                  f"store get {store_sealed[n]['get'] * 1e3:8.2f} vs {store[n]['get'] * 1e3:8.2f}"
                  f" ms ({store_sealed[n]['get'] / store[n]['get']:4.2f}x)")

    if args.json:
        rows = [{"bytes": n, "raw_tcp_s": tcp[n], "te_get_s": te[n],
                 "store_put_s": store[n]["put"], "store_get_s": store[n]["get"],
                 "store_get_no_verify_s": store[n]["get_nv"]} for n in sizes]
        Path(args.json).write_text(json.dumps({"reps": args.reps, "statistic": "median",
                                               "rows": rows}, indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
