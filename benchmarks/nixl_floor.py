"""NIXL's own READ between two processes, nothing of ours around it: the floor of `nixl`.

    .venv/bin/python benchmarks/nixl_floor.py [--sizes-mb 125] [--reps 7] [--ucx-tls tcp]

Two agents (UCX, no progress thread, as the transport makes them), each with a buffer of
the item's size registered once; the reader loads the other's metadata and READs the whole
buffer into its own, polling the transfer's state, median of `reps` after one warm-up (UCX
sets up its connection on the first transfer). No checksum, no side channel, no pool: what
UCX itself costs for the bytes, beside which `transport_bench.py`'s `nixl` rows are read
(there is no `ucx_perftest` in the wheels). `transport_bench.py` calls `nixl_read_s` for
its `nixl` paths.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

MiB = 1 << 20


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _holder(q_out, q_in, nbytes: int, env: dict[str, str]) -> None:
    """The other process: a registered buffer, served until told to stop."""
    os.environ.update(env)
    import torch

    agent = _agent(f"floor-src-{os.getpid()}")
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    agent.register_memory(agent.get_reg_descs([(src.data_ptr(), nbytes, 0, "")], "DRAM"))
    q_out.put((agent.get_agent_metadata(), src.data_ptr()))
    while q_in.empty():  # the reader's transfers need no help from here (one-sided) but for
        agent.get_new_notifs()  # emulated gets (tcp): keep progressing, as the producer does
        time.sleep(0.0005)


def nixl_read_s(nbytes: int, reps: int, env: dict[str, str] | None = None) -> float:
    """Median seconds of one READ of `nbytes` from another process (see the docstring)."""
    env = dict(env or {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_holder, args=(q_out, q_in, nbytes, env), daemon=True)
    proc.start()
    try:
        import torch

        agent = _agent(f"floor-dst-{os.getpid()}")
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        agent.register_memory(agent.get_reg_descs([(dst.data_ptr(), nbytes, 0, "")], "DRAM"))
        metadata, remote = q_out.get(timeout=60)
        peer = agent.add_remote_agent(metadata)
        local = agent.get_xfer_descs([(dst.data_ptr(), nbytes, 0)], "DRAM")
        far = agent.get_xfer_descs([(remote, nbytes, 0)], "DRAM")
        times = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            handle = agent.initialize_xfer("READ", local, far, peer)
            state = agent.transfer(handle)
            while state == "PROC":
                time.sleep(0.0002)
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL READ came to {state}")
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        q_in.put(None)
        proc.join(10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[125])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ucx-tls", default="", help="UCX_TLS for both agents (default: UCX's)")
    args = ap.parse_args()
    env = {"UCX_TLS": args.ucx_tls} if args.ucx_tls else {}
    for mb in args.sizes_mb:
        ms = nixl_read_s(int(mb * MiB), args.reps, env) * 1e3
        print(f"{mb:g} MiB NIXL READ ({args.ucx_tls or 'UCX default'}): {ms:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
