"""NIXL's own READ between two processes, nothing of ours around it: the floor of `nixl`.

    .venv/bin/python benchmarks/nixl_floor.py [--sizes-mb 125] [--reps 7] [--ucx-tls tcp]

Two agents (UCX, no progress thread, as the transport makes them), each with a buffer of
the item's size registered once; the reader loads the other's metadata and READs the whole
buffer into its own, polling the transfer's state, median of `reps` after one warm-up (UCX
sets up its connection on the first transfer). No checksum, no side channel, no pool: what
UCX itself costs for the bytes, beside which `transport_bench.py`'s `nixl` rows are read
(there is no `ucx_perftest` in the wheels: where Debian's `ucx-utils` is installed, UCX's own
`ucx_perftest -t ucp_get` of the same size is printed beside, `ucx_get_s`; a distribution's
UCX, not the wheel's). `transport_bench.py` calls both for its `nixl` paths.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _registered(agent, nbytes: int, fill: bool):
    import torch

    buf = (torch.randint(0, 256, (nbytes,), dtype=torch.uint8) if fill
           else torch.zeros(nbytes, dtype=torch.uint8))
    agent.register_memory(agent.get_reg_descs([(buf.data_ptr(), nbytes, 0, "")], "DRAM"))
    return buf


def _hold(nbytes: int, rendezvous: Path) -> None:
    """The other process: a registered buffer, its agent's metadata left in `rendezvous`,
    served (progressed, for emulated gets over tcp) until the reader is done."""
    agent = _agent(f"floor-src-{os.getpid()}")
    src = _registered(agent, nbytes, fill=True)
    tmp = rendezvous / "md.tmp"
    tmp.write_bytes(src.data_ptr().to_bytes(8, "little") + agent.get_agent_metadata())
    tmp.rename(rendezvous / "md")
    while not (rendezvous / "done").exists():
        agent.get_new_notifs()
        time.sleep(0.0005)


def _read(nbytes: int, reps: int, rendezvous: Path) -> float:
    agent = _agent(f"floor-dst-{os.getpid()}")
    dst = _registered(agent, nbytes, fill=False)
    deadline = time.monotonic() + 60
    while not (rendezvous / "md").exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the holder never left its metadata")
        time.sleep(0.01)
    raw = (rendezvous / "md").read_bytes()
    peer = agent.add_remote_agent(raw[8:])
    local = agent.get_xfer_descs([(dst.data_ptr(), nbytes, 0)], "DRAM")
    far = agent.get_xfer_descs([(int.from_bytes(raw[:8], "little"), nbytes, 0)], "DRAM")
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


def nixl_read_s(nbytes: int, reps: int, env: dict[str, str] | None = None,
                netns=None) -> float:
    """Median seconds of one READ of `nbytes` from another process (see the docstring);
    with `netns` (netns_pair.NetnsPair) the holder runs in its namespace a, the reader in b."""
    me = str(Path(__file__).resolve())
    env = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="epd-nixl-floor-") as rendezvous:
        where = (netns.prefix(netns.a), netns.prefix(netns.b)) if netns else ([], [])
        holder = subprocess.Popen([*where[0], sys.executable, me, "hold", str(nbytes),
                                   rendezvous], env=env, stdout=subprocess.DEVNULL)
        try:
            out = subprocess.run([*where[1], sys.executable, me, "read", str(nbytes),
                                  str(reps), rendezvous], env=env, capture_output=True,
                                 text=True, timeout=300, check=True).stdout
        finally:
            Path(rendezvous, "done").touch()
            holder.wait(30)
    return float(out.strip().splitlines()[-1])


def ucx_get_s(nbytes: int, reps: int, env: dict[str, str] | None = None,
              netns=None) -> float | None:
    """Median seconds of one `ucp_get` of `nbytes` by UCX's own `ucx_perftest`, or None where
    it is not installed (Debian's `ucx-utils`; its UCX is the distribution's, not the one
    NIXL's wheel bundles). The server side runs in namespace a with `netns`, as the holder."""
    exe = shutil.which("ucx_perftest")
    if exe is None:
        return None
    env = {**os.environ, **(env or {})}
    where = (netns.prefix(netns.a), netns.prefix(netns.b)) if netns else ([], [])
    host = "10.79.0.1" if netns else "127.0.0.1"  # netns_pair.ADDR_A
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([*where[0], exe, "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(20):  # until the server listens
            time.sleep(0.25)
            run = subprocess.run([*where[1], exe, host, "-p", str(port), "-t", "ucp_get",
                                  "-s", str(nbytes), "-n", str(reps), "-w", "1"], env=env,
                                 capture_output=True, text=True, timeout=300)
            final = [line for line in run.stdout.splitlines() if line.startswith("Final:")]
            if final:
                return float(final[-1].split()[2]) / 1e6  # the 50th percentile, in us
            if server.poll() is not None:
                break
        raise RuntimeError(f"ucx_perftest gave no result: {run.stderr.strip()[-300:]}")
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(10)


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
        ucx = ucx_get_s(int(mb * MiB), args.reps, env)
        print(f"{mb:g} MiB ucx_perftest ucp_get: " + (f"{ucx * 1e3:.1f} ms" if ucx else
              "not installed (apt install ucx-utils)"))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["hold"]:
        _hold(int(sys.argv[2]), Path(sys.argv[3]))
        os._exit(0)  # no teardown: UCX may fault freeing what the interpreter freed first
    elif sys.argv[1:2] == ["read"]:
        print(_read(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])), flush=True)
        os._exit(0)
    else:
        raise SystemExit(main())
