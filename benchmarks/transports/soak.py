"""Soak of the Mooncake TE data plane with the deployment secret: 2,000 pulls with duplicates,
a killed producer (later restarted), a frozen producer (SIGSTOP: a partition as the consumer
sees it), then the figures that must be zero.

    flock /tmp/epd-vllm.lock .venv/bin/python -m benchmarks.transports.soak [--pulls 2000]

Two producer processes (`peer_process`, real transfer engines, CURVE side channels) hold 120
items each (64 KiB inline up to 2 MiB); one consumer (this process, the worker-side transport
a vLLM consumer runs) pulls with 8 threads, items drawn with repeats (Zipf-like), each pull
with a 3 s deadline. Producer B is SIGKILLed at 30% and restarted (same port, items put
again) at 60%; producer A is frozen for 1.5 s at 80%. Reported:
- lost: pulls that neither answered nor failed within their deadline + 2 s (must be 0);
- wrong: answers whose bytes differ from what was put (must be 0);
- leaked: the consumer's pool bytes and quarantined buffers once every answer is dropped, and
  the producers' held bytes beyond their items (must be 0);
- misses by cause (a killed or frozen producer's items miss; that is the point: bounded, not
  lost) and pull latency p50/p99.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.harness.peers import LOOPBACK, PRODUCER
from benchmarks.harness.report import MiB, say
from ec_connectors.config import EPDConfig
from ec_connectors.transports.base import Placement, checksum, tensor_bytes
from ec_connectors.transports.mooncake_te.transport import MooncakeTransport
from epd_testkit.peer_process import PeerClient

ITEMS = 120
SIZES = [(16, 2048), (128, 2048), (512, 2048)]  # bf16 rows x 2048: 64 KiB, 512 KiB, 2 MiB


class Soak:
    """The run's processes and figures: two producers (their items' checksums in `expected`),
    the consumer, the pull plan and its results."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = Path(tempfile.mkdtemp(prefix="epd-soak-"))
        self.secret = self.work / "secret"
        self.secret.write_bytes(os.urandom(32).hex().encode())
        self.secret.chmod(0o600)
        self.env = dict(LOOPBACK)
        self.ports = {"A": a.base_port, "B": a.base_port + 20}
        self.producers: dict[str, PeerClient] = {}
        self.expected: dict[str, str] = {}
        self.lock = threading.Lock()
        self.results: list[tuple[str, str, float]] = []  # (item, outcome, seconds)
        self.events = {int(a.pulls * 0.3): "kill B", int(a.pulls * 0.6): "restart B",
                       int(a.pulls * 0.8): "freeze A"}

    def config(self, port: int, **extra) -> dict:
        return {"transport": "mooncake", "protocol": "tcp", "host": "127.0.0.1",
                "base_port": port, "memory_pool_bytes": 512 * MiB,
                "secret_file": str(self.secret), **extra}

    def start_producer(self, name: str) -> tuple[PeerClient, dict[str, str]]:
        p = PeerClient(env=self.env, log_path=str(self.work / f"producer-{name}.log"))
        p.call({"op": "init", "config": self.config(self.ports[name]),
                "placement": PRODUCER})
        sums = {}
        for i in range(ITEMS):
            rows, width = SIZES[i % len(SIZES)]
            item = f"{name}-{i}"
            put = p.call({"op": "put", "id": item, "seed": i + (1000 if name == "B" else 0),
                          "shape": [rows, width], "dtype": "bfloat16"})
            sums[item] = put["checksum"]
        return p, sums

    def control(self, n: int) -> None:
        what = self.events.get(n)
        if what == "kill B":
            self.producers["B"].proc.kill()
            self.producers["B"].proc.wait()
        elif what == "restart B":
            self.producers["B"], _ = self.start_producer("B")
        elif what == "freeze A":
            pid = self.producers["A"].proc.pid
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(1.5, os.kill, (pid, signal.SIGCONT)).start()
        if what:
            say(f"pull {n}: {what}")

    def worker(self, consumer: MooncakeTransport, plan: list[str], cursor) -> None:
        while True:
            with self.lock:
                n = next(cursor, None)
            if n is None:
                return
            item = plan[n]
            location = f"127.0.0.1:{self.ports[item[0]]}"
            t0 = time.monotonic()
            tensor = consumer.get(item, t0 + 3.0, location)
            dt = time.monotonic() - t0
            if tensor is None:
                outcome = "lost" if dt > 3.0 + 2.0 else "miss"
            else:
                outcome = ("ok" if checksum(tensor_bytes(tensor)) == self.expected[item]
                           else "wrong")
                del tensor  # back to the consumer's pool
            with self.lock:
                self.results.append((item, outcome, dt))

    def run(self, consumer: MooncakeTransport, plan: list[str]) -> float:
        """The pulls on `threads` threads, the events between them; the wall time."""
        cursor = iter(range(len(plan)))
        t0 = time.monotonic()
        threads = [threading.Thread(target=self.worker, args=(consumer, plan, cursor))
                   for _ in range(self.a.threads)]
        for t in threads:
            t.start()
        # the events run on this thread: a producer restarted here lives as long as the run
        # (peer processes die with the thread that started them)
        pending = sorted(self.events)
        while any(t.is_alive() for t in threads):
            if pending and len(self.results) >= pending[0]:
                self.control(pending.pop(0))
            time.sleep(0.005)
        for t in threads:
            t.join()
        return time.monotonic() - t0

    def report(self, consumer: MooncakeTransport, plan: list[str], wall: float) -> bool:
        """Print the figures; True when one that must be zero is not."""
        results = self.results
        health = consumer.health()
        held = {name: p.call({"op": "health"})["health"] for name, p in self.producers.items()}
        item_bytes = {name: sum(rows * width * 2 for i in range(ITEMS)
                                for rows, width in [SIZES[i % len(SIZES)]])
                      for name in self.producers}
        counts = {k: sum(1 for _, o, _ in results if o == k) for k in ("ok", "miss", "lost",
                                                                       "wrong")}
        times = sorted(dt for _, _, dt in results)
        print(f"\n{len(results)} pulls in {wall:.1f} s, {self.a.threads} threads, "
              f"{len(self.expected)} distinct items (duplicates: "
              f"{len(results) - len(set(plan))})")
        print(f"answers: ok {counts['ok']}, miss {counts['miss']} (the killed or frozen "
              f"producer's items, each within its deadline), lost {counts['lost']}, "
              f"wrong {counts['wrong']}")
        print(f"pull latency p50 {statistics.median(times) * 1e3:.2f} ms, "
              f"p99 {times[int(len(times) * 0.99) - 1] * 1e3:.1f} ms, "
              f"max {times[-1] * 1e3:.0f} ms")
        print(f"leaked: consumer pool {health['pool_used_bytes']} bytes, quarantined buffers "
              f"{health['quarantined']}; producers' held bytes beyond their items: " + ", ".join(
                  f"{n} {h['pool_used_bytes'] - item_bytes[n]}" for n, h in held.items()))
        return bool(counts["lost"] or counts["wrong"] or health["pool_used_bytes"]
                    or health["quarantined"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pulls", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--base-port", type=int, default=17050)
    a = ap.parse_args()
    soak = Soak(a)
    say("starting two producers and putting their items...")
    for name in soak.ports:
        soak.producers[name], sums = soak.start_producer(name)
        soak.expected.update(sums)
    consumer = MooncakeTransport(EPDConfig.from_dict(soak.config(a.base_port + 40, producers=[
        f"127.0.0.1:{p}" for p in soak.ports.values()], load_timeout_s=3.0)),
        Placement(is_producer=False, is_consumer=True))
    ids = sorted(soak.expected)
    rng = random.Random(7)
    weights = [1.0 / (1 + rank) ** 0.8 for rank in range(len(ids))]
    plan = rng.choices(ids, weights=weights, k=a.pulls)
    wall = soak.run(consumer, plan)
    time.sleep(1.0)  # late answers release quarantined buffers
    bad = soak.report(consumer, plan, wall)
    consumer.close()
    for p in soak.producers.values():
        p.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
