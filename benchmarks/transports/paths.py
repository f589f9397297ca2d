"""Producer process -> consumer process through each transport, verified, beside this
machine's limits measured in the same run: memcpy into a warm, preallocated destination, and
one raw TCP stream on loopback into a preallocated buffer.

    .venv/bin/python -m benchmarks.transports.paths [--sizes-mb 30 125] [--reps 7]
        [--paths shm shm_bytes shm_nohash shm_blake3 mooncake_te mooncake_te_engine
                 mooncake_store safetensors nixl nixl_tcp]
        [--secret] [--netns]
        [--json FILE]

Each path runs a producer and a consumer `peer_process` (epd_testkit/), built with
`make_transport` as a vLLM worker would be (`shm`: the defaults, the reader checking the
producer's seal; `shm_bytes`: the reader hashing every byte again, shm_read_verify "bytes";
`shm_nohash`: shm_verify "none", no byte hashed by either side, the seal and header checked;
`shm_blake3`: shm verified with blake3 instead of xxh3; `mooncake_te`: the Transfer Engine
transport over TCP with its default data path, a socket stream; `mooncake_te_engine`: the
same with `te_data_path` engine, the engine's writes; `nixl`: the NIXL transport, UCX
picking its own transports (on one host: cma, a process_vm_readv by the reader); `nixl_tcp`:
the same with UCX_TLS=tcp, UCX's TCP over loopback;
`--secret`: every path with a deployment secret, i.e. keyed digests, seals, CURVE;
`--netns`: producer and consumer in two network namespaces joined by a veth pair (two
"hosts", harness/netns.py; root), with a secret (peers beyond loopback need one), raw TCP
measured across the same pair; only the peer paths, mooncake_te and nixl[_tcp]).
One rep: the producer `put`s a bf16 [rows, 4096] item, then the consumer `get`s it (every
byte verified, the transport's own way); `ms` is put + get as each process timed it
(median; the first rep of each size is a warm-up). `memcpy@put`: before each put the
producer makes the same tensor the same way and copies it into warm memory, timed (the copy
a put makes, in the state a put finds the process in: the item just written on one core,
the other idle; no put can do better than that copy); `x m@put` is put + get over it.
memcpy and raw TCP are measured again right before each path, and each path's ratios are
to those (a busy machine's load drifts over a run: ratios to figures taken minutes earlier
would drift with it).
Budgets: shm and Mooncake TE evict older items (short leases: the steady state of a busy
producer); the store and safetensors keep every rep's item (the store refuses puts into a
full segment, safetensors' eviction scans and frees files inside put).

JSON (`--json`): {"<MiB>": {"memcpy_ms": m, "raw_tcp_ms": t, "paths": {"<name>": {"ms": x,
"x_memcpy": x/m, "x_raw_tcp": x/t, "put_ms": .., "get_ms": .., "memcpy_at_put_ms": c,
"x_memcpy_at_put": x/c, "memcpy_ms": m', "raw_tcp_ms": t'}}}}: m and t are medians over
the whole run, m' and t' the ones measured beside the path (its ratios use those); `nixl`
paths also have "nixl_read_ms" (harness/floors.py's bare READ) and, where Debian's ucx-utils is
installed, "ucx_get_ms" (`ucx_perftest -t ucp_get`), and "checksum_ms" (the peer checksum
of the same bytes in warm memory on two threads: UCX's get plus one at each end is the
floor of a put + get that verifies every byte); a path that cannot run here has
{"error": why}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.harness.env import ROOT
from benchmarks.harness.floors import memcpy_s, nixl_read_s, raw_tcp_s, ucx_get_s
from benchmarks.harness.netns import ADDR_A, ADDR_B, NetnsPair, raw_tcp_netns_s
from benchmarks.harness.peers import CONSUMER, HIDDEN, LOOPBACK, PRODUCER, item_bytes
from benchmarks.harness.report import MiB
from ec_connectors.transports.base import checksum, tensor_bytes
from encoder_service.local.processes import default_work_dir
from epd_common.net import port_open
from epd_testkit.peer_process import PeerClient, seeded_tensor

PATHS = ("shm", "shm_bytes", "shm_nohash", "shm_blake3", "mooncake_te", "mooncake_te_engine",
         "mooncake_store", "safetensors", "nixl", "nixl_tcp")


def free_port(start: int, span: int = 1, step: int = 10) -> int:
    """The first port from `start` with `span` free ports (and +1000 for announcements, +2000
    for data connections)."""
    for port in range(start, start + 2000, step):
        if not any(port_open("127.0.0.1", p, timeout_s=0.05)
                   for q in range(port, port + span) for p in (q, q + 1000, q + 2000)):
            return port
    raise RuntimeError(f"no free ports from {start}")


def hashed_copy_s(nbytes: int, reps: int) -> float:
    """The least a put that hashes every byte costs here: shm's own copy-and-hash pass.

    The `shm` producer's pass (chunked copy, xxh3 of each chunk from cache, on its default
    threads) between two warm in-process buffers: no arena, no record, no other process."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from ec_connectors.config import EPDConfig
    from ec_connectors.transports.hashed_copy import Digest, copy_and_hash

    cfg = EPDConfig()
    threads = min(cfg.shm_copy_threads, len(os.sched_getaffinity(0)))
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    view = memoryview(dst.numpy()).cast("B")
    digest = Digest("xxh3", None)
    times = []
    with ThreadPoolExecutor(max(1, threads - 1)) as pool:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            copy_and_hash(dst.data_ptr(), view, src.data_ptr(), nbytes, cfg.shm_chunk_bytes,
                          digest, pool, threads)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def peer_checksum_s(nbytes: int, reps: int) -> float:
    """The peer transports' checksum of `nbytes` already in warm memory, on a put's threads.

    What a `nixl` put whose item stays where it lies still does (and the consumer again on
    arrival): with UCX's get, the floor of a put + get that verifies every byte."""
    import torch

    from ec_connectors.transports.hashed_copy import helper_threads, peer_checksum

    data = memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()).cast("B")
    pool, threads = helper_threads(2, "bench-hash")
    times = []
    try:
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            peer_checksum(data, pool, threads)
            times.append(time.perf_counter() - t0)
    finally:
        if pool is not None:
            pool.shutdown()
    return statistics.median(times[1:])


class Path_:
    """One transport path: its configs, and what it needs started (a store master)."""

    def __init__(self, name: str, max_bytes: int, reps: int, work: Path,
                 secret: str | None, netns: NetnsPair | None = None) -> None:
        self.name, self.master = name, None
        self.netns = netns
        self.env = dict(LOOPBACK)  # the peers' environment
        self.dirs: list[str] = []
        if name in ("shm", "shm_bytes", "shm_nohash", "shm_blake3"):
            root = f"/dev/shm/epd-bench-{uuid.uuid4().hex[:8]}"
            self.dirs.append(root)
            base = {"transport": "shm", "shm_path": root, "shm_lease_ttl_s": 0.05,
                    "shm_verify": {"shm_blake3": "blake3", "shm_nohash": "none"}.get(
                        name, "xxh3"),
                    **({"shm_read_verify": "bytes"} if name == "shm_bytes" else {}),
                    "shm_arena_bytes": 3 * max_bytes + 16 * MiB,
                    "shm_consumer_pool_bytes": 2 * max_bytes + 16 * MiB}
            self.prod, self.cons = base, base
        elif name in ("mooncake_te", "mooncake_te_engine"):
            port = free_port(23500)
            base = {"transport": "mooncake", "protocol": "tcp", "host": "127.0.0.1",
                    "base_port": port, "lease_ttl_s": 0.05,
                    "memory_pool_bytes": 3 * max_bytes + 16 * MiB,
                    "te_data_path": "engine" if name == "mooncake_te_engine" else "auto"}
            self.prod, self.cons = base, {**base, "producers": [f"127.0.0.1:{port}"]}
        elif name in ("nixl", "nixl_tcp"):
            port = free_port(23700)
            base = {"transport": "nixl", "host": "127.0.0.1", "base_port": port,
                    "lease_ttl_s": 0.05, "memory_pool_bytes": 3 * max_bytes + 16 * MiB}
            self.prod, self.cons = base, {**base, "producers": [f"127.0.0.1:{port}"]}
            if name == "nixl_tcp":
                self.env["UCX_TLS"] = "tcp"
        elif name == "mooncake_store":
            from encoder_service.local.mooncake_master import master_server

            self.master = master_server(work, free_port(23950, span=3)).start()
            self.master.wait()
            base = {"transport": "mooncake_store", "host": "127.0.0.1",
                    "store_master": self.master.address,
                    "store_metadata": self.master.metadata_url, "embedding_dtype": "bfloat16",
                    "store_buffer_bytes": 2 * max_bytes + 16 * MiB}
            # the store refuses a put when its segments are full (-200) rather than evict:
            # room for every rep of every size (items of the smaller sizes stay stored)
            self.prod = {**base, "store_segment_bytes": (reps + 2) * 2 * (max_bytes + MiB)
                         + 64 * MiB}
            self.cons = {**base, "store_segment_bytes": 0}
        elif name == "safetensors":
            root = tempfile.mkdtemp(prefix="epd-bench-st-", dir="/dev/shm")  # tmpfs, as shm
            self.dirs.append(root)
            base = {"transport": "safetensors", "storage_path": root,
                    "max_storage_bytes": (reps + 2) * 2 * max_bytes}
            self.prod, self.cons = base, base
        else:
            raise ValueError(f"unknown path {name!r} (known: {', '.join(PATHS)})")
        if netns is not None:  # the producer on "host" a, the consumer on b
            if "producers" not in self.cons:
                raise ValueError(f"{name} has no peers to put in two namespaces")
            port = self.prod["base_port"]
            self.prod = {**self.prod, "host": ADDR_A}
            self.cons = {**self.cons, "host": ADDR_B, "producers": [f"{ADDR_A}:{port}"]}
            self.env = {k: v for k, v in self.env.items() if k != "MC_TCP_BIND_ADDRESS"}
        for cfg in (self.prod, self.cons):
            cfg.update(namespace="bench", secret_file=secret)

    def close(self) -> None:
        if self.master is not None:
            self.master.stop()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


def run_path(name: str, sizes: list[int], reps: int, work: Path,
             secret: str | None, netns: NetnsPair | None = None,
             extra: dict | None = None) -> dict[int, dict]:
    """{nbytes: {"put_ms": .., "get_ms": .., "ms": ..}} (medians) for one path; `extra`:
    connector keys over both ends' configs."""
    path = Path_(name, max(sizes), reps, work, secret, netns)
    path.prod, path.cons = {**path.prod, **(extra or {})}, {**path.cons, **(extra or {})}
    where = (netns.prefix(netns.a), netns.prefix(netns.b)) if netns else (None, None)
    log = str(work / f"transport-bench-{name}.log")
    peers: list[PeerClient] = []
    try:
        prod = PeerClient(prefix=where[0], env=path.env, log_path=log)
        peers.append(prod)
        cons = PeerClient(prefix=where[1], env=path.env, log_path=log)
        peers.append(cons)
        prod.call({"op": "init", "config": path.prod, "placement": PRODUCER}, 120)
        cons.call({"op": "init", "config": path.cons, "placement": CONSUMER}, 120)
        out: dict[int, dict] = {}
        for n in sizes:
            shape = [n // (HIDDEN * 2), HIDDEN]
            want = checksum(tensor_bytes(seeded_tensor(n, shape, "bfloat16")))
            puts, gets, copies = [], [], []
            for rep in range(reps + 1):
                item_id = f"{name}-{n}-{rep}"
                copied = prod.call({"op": "memcpy", "seed": n, "shape": shape,
                                    "dtype": "bfloat16"}, 120)
                stored = prod.call({"op": "put", "id": item_id, "seed": n, "shape": shape,
                                    "dtype": "bfloat16"}, 120)
                got = cons.call({"op": "get", "id": item_id, "timeout_s": 30,
                                 "location": stored.get("location", ""),
                                 "nbytes": stored["nbytes"]}, 120)
                if not got.get("found") or got["checksum"] != want:
                    raise RuntimeError(f"{name}: rep {rep} of {n} bytes came back "
                                       f"{'different' if got.get('found') else 'missing'}")
                if rep:  # the first is a warm-up (mappings, pools, connections)
                    puts.append(stored["put_s"] * 1e3)
                    gets.append(got["get_s"] * 1e3)
                    copies.append(copied["memcpy_s"] * 1e3)
            put_ms, get_ms = statistics.median(puts), statistics.median(gets)
            totals = [p + g for p, g in zip(puts, gets, strict=True)]
            out[n] = {"ms": statistics.median(totals), "put_ms": put_ms, "get_ms": get_ms,
                      "memcpy_at_put_ms": statistics.median(copies)}
        return out
    finally:
        for peer in peers:
            peer.close()
        path.close()


def label(mb: float) -> str:
    return str(int(mb)) if float(mb).is_integer() else str(mb)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[30, 125])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--secret", action="store_true", help="a deployment secret for every path")
    ap.add_argument("--netns", action="store_true", help="producer and consumer in two "
                    "network namespaces (root)")
    ap.add_argument("--extra", type=json.loads, default={},
                    help='connector keys for every path\'s both ends, as JSON: '
                         '\'{"transfer_chunk_bytes": 0}\'')
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.netns:
        args.secret = True
        with NetnsPair() as pair:
            return run(args, pair)
    return run(args, None)


def run(args: argparse.Namespace, netns: NetnsPair | None) -> int:
    os.environ.update(LOOPBACK)
    work = default_work_dir(ROOT)
    work.mkdir(parents=True, exist_ok=True)
    sizes = [item_bytes(mb) for mb in args.sizes_mb]
    secret = None
    if args.secret:
        secret = str(work / "transport-bench.secret")
        Path(secret).write_bytes(os.urandom(32).hex().encode())
        os.chmod(secret, 0o600)
    result: dict[str, dict] = {label(mb): {"paths": {}} for mb in args.sizes_mb}
    limits: dict[str, dict[str, list[float]]] = {
        label(mb): {"memcpy_ms": [], "raw_tcp_ms": [], "hashed_copy_ms": []}
        for mb in args.sizes_mb}
    for name in args.paths:
        beside = {}
        for mb, n in zip(args.sizes_mb, sizes, strict=True):
            tcp = raw_tcp_netns_s(netns, n, args.reps) if netns else raw_tcp_s(n, args.reps)
            beside[label(mb)] = {"memcpy_ms": memcpy_s(n, args.reps) * 1e3,
                                 "raw_tcp_ms": tcp * 1e3,
                                 "hashed_copy_ms": hashed_copy_s(n, args.reps) * 1e3}
            if name.startswith("nixl"):  # NIXL's own READ, nothing of ours around it
                tls = {"UCX_TLS": "tcp"} if name == "nixl_tcp" else {}
                beside[label(mb)]["nixl_read_ms"] = nixl_read_s(n, args.reps, tls,
                                                                netns) * 1e3
                ucx = ucx_get_s(n, args.reps, tls, netns)
                if ucx is not None:
                    beside[label(mb)]["ucx_get_ms"] = ucx * 1e3
                beside[label(mb)]["checksum_ms"] = peer_checksum_s(n, args.reps) * 1e3
            for k, v in beside[label(mb)].items():
                limits[label(mb)].setdefault(k, []).append(v)
        try:
            timings = run_path(name, sizes, args.reps, work, secret, netns, args.extra)
        except Exception as exc:  # noqa: BLE001 - a path that cannot run here is reported
            print(f"{name}: not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
            for mb in args.sizes_mb:
                result[label(mb)]["paths"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        for mb, n in zip(args.sizes_mb, sizes, strict=True):
            t, lim = timings[n], beside[label(mb)]
            result[label(mb)]["paths"][name] = {
                "ms": t["ms"], "x_memcpy": t["ms"] / lim["memcpy_ms"],
                "memcpy_at_put_ms": t["memcpy_at_put_ms"],
                "x_memcpy_at_put": t["ms"] / t["memcpy_at_put_ms"],
                "x_raw_tcp": t["ms"] / lim["raw_tcp_ms"], "put_ms": t["put_ms"],
                "get_ms": t["get_ms"], **lim}
    for mb, row in result.items():
        row.update({k: statistics.median(v) if v else float("nan")
                    for k, v in limits[mb].items()})
    print(f"producer process -> consumer process{' across two namespaces' if netns else ''}, "
          f"verified; bf16 [rows, {HIDDEN}]; median "
          f"of {args.reps}; {'with' if secret else 'no'} deployment secret; load "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'MiB':>5} {'path':<18} {'ms':>8} {'x memcpy':>9} {'x raw TCP':>10} "
          f"{'put ms':>8} {'get ms':>8} {'(memcpy':>8} {'raw TCP)':>8} "
          f"{'memcpy@put':>10} {'x m@put':>8}")
    for mb, row in result.items():
        print(f"{mb:>5} {'memcpy':<18} {row['memcpy_ms']:>8.1f}  (median of the run)")
        print(f"{mb:>5} {'raw TCP':<18} {row['raw_tcp_ms']:>8.1f}  (median of the run)")
        print(f"{mb:>5} {'hashed copy':<18} {row['hashed_copy_ms']:>8.1f} "
              f"{row['hashed_copy_ms'] / row['memcpy_ms']:>9.2f}  (a put's floor: shm's copy "
              "and xxh3 pass, in process)")
        for name, p in row["paths"].items():
            if "error" in p:
                print(f"{mb:>5} {name:<18} not measured ({p['error'][:60]})")
                continue
            print(f"{mb:>5} {name:<18} {p['ms']:>8.1f} {p['x_memcpy']:>9.2f} "
                  f"{p['x_raw_tcp']:>10.2f} {p['put_ms']:>8.1f} {p['get_ms']:>8.1f} "
                  f"{p['memcpy_ms']:>8.1f} {p['raw_tcp_ms']:>8.1f} "
                  f"{p['memcpy_at_put_ms']:>10.1f} {p['x_memcpy_at_put']:>8.2f}"
                  + (f"  NIXL's own READ {p['nixl_read_ms']:.1f}" if "nixl_read_ms" in p
                     else "")
                  + (f", ucx_perftest get {p['ucx_get_ms']:.1f}" if "ucx_get_ms" in p
                     else ", no ucx_perftest (apt install ucx-utils)" if "nixl_read_ms" in p
                     else "")
                  + (f"; that get + 2 checksums ({p['checksum_ms']:.1f}): "
                     f"{p['ucx_get_ms'] + 2 * p['checksum_ms']:.1f}, ms / it "
                     f"{p['ms'] / (p['ucx_get_ms'] + 2 * p['checksum_ms']):.2f}"
                     if "ucx_get_ms" in p and "checksum_ms" in p else ""))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
