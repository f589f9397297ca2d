"""A vLLM worker's spin between steps, vLLM's 1 s against `worker_spin_s` (the default), in one run:

    flock /tmp/epd-vllm.lock .venv/bin/python -m benchmarks.serving.worker_spin [--rounds 5]

Two `epd up` stacks of the tiny model side by side (a vLLM encoder and a vLLM prefill/decode
instance each, shm, pinned as `epd up` pins them), one with `worker_spin_s: 1` (what vLLM
does: a worker that read a step busy-waits a second for the next one), one with the
connector's default. Rounds alternate between them; in each: --images requests one after
another, a new image each (the decode instance defers the request while it pulls the item:
empty steps every few ms, which keep a vLLM-default worker spinning), then one text request
of --tokens output tokens (steps back to back: the decode path a shorter spin must not slow).
Prints per stack the medians over rounds (image request ms, ms per output token), the
worker's CPU seconds per round, and the ratios default / vLLM's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import httpx

from benchmarks.harness.env import ROOT
from benchmarks.harness.procfs import tree_cpu_s
from benchmarks.harness.report import medians, say
from encoder_service.local.processes import UpProcess, default_work_dir, start_all
from encoder_service.local.requests import chat_body, parts_body, sample_image_png
from encoder_service.local.testmodels import SPECS, build

WORK = default_work_dir(ROOT)
PORTS = {"vllm 1 s": 21180, "default": 21280}  # gateways; their servers take the next ports
SPINS = {"vllm 1 s": 1.0, "default": None}
MODEL = "tiny-llava"


def stack_cpu_s(up: UpProcess) -> float:
    """CPU seconds so far of every process `epd up` started (servers, gateway)."""
    assert up.proc is not None
    return tree_cpu_s(up.proc.pid)


def one_round(c: httpx.Client, up: UpProcess, images: int, tokens: int, seed: int) -> dict:
    cpu0 = stack_cpu_s(up)
    lat = []
    for i in range(images):
        t0 = time.monotonic()
        r = c.post(up.url + "/v1/chat/completions",
                   json=chat_body(MODEL, sample_image_png(seed=seed + i), "what is this"))
        r.raise_for_status()
        lat.append((time.monotonic() - t0) * 1e3)
    t0 = time.monotonic()
    r = c.post(up.url + "/v1/chat/completions",
               json=parts_body(MODEL, [], "count slowly", max_tokens=tokens, ignore_eos=True))
    r.raise_for_status()
    out = r.json()["usage"]["completion_tokens"]
    per_token = (time.monotonic() - t0) * 1e3 / max(1, out)
    return {"image_ms": statistics.median(lat), "token_ms": per_token,
            "cpu_s": stack_cpu_s(up) - cpu0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    a = ap.parse_args()
    model = build(WORK / "models" / MODEL, SPECS["tiny"])
    ups = {}
    for name, port in PORTS.items():
        extra = {} if SPINS[name] is None else {"worker_spin_s": SPINS[name]}
        ups[name] = UpProcess({"model": str(model), "base_port": port, "transport": "shm",
                               "connector_extra": extra},
                              WORK / "worker-spin-bench" / str(port), args=["--no-restart"])
    rows: dict[str, list[dict]] = {name: [] for name in ups}
    try:
        start_all(list(ups.values()))
        with httpx.Client(timeout=120) as c:
            for up in ups.values():  # warm: first requests compile and fill caches
                one_round(c, up, 2, 8, a.seed + 90000)
            for k in range(a.rounds):
                order = list(ups) if k % 2 == 0 else list(reversed(ups))
                for name in order:
                    time.sleep(1.5)  # the other stack's workers stop spinning
                    rows[name].append(one_round(c, ups[name], a.images, a.tokens,
                                                a.seed + 1000 * k + (500 if name == "default"
                                                                     else 0)))
                    say(f"round {k} {name}: "
                        + " ".join(f"{key} {v:.1f}" for key, v in rows[name][-1].items()))
    finally:
        for up in ups.values():
            up.stop()
    med = {name: medians(rs) for name, rs in rows.items()}
    print(f"\n{'stack':10s} {'image ms':>9s} {'ms/token':>9s} {'cpu s/round':>12s}")
    for name, m in med.items():
        print(f"{name:10s} {m['image_ms']:9.1f} {m['token_ms']:9.2f} {m['cpu_s']:12.2f}")
    base, new = med["vllm 1 s"], med["default"]
    print("default / vLLM's: image request "
          f"{new['image_ms'] / base['image_ms']:.2f}x, per token "
          f"{new['token_ms'] / base['token_ms']:.2f}x, CPU {new['cpu_s'] / base['cpu_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
