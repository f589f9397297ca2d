"""The limits a transport is measured beside, each in the same run as the transport:

- `memcpy_s`: torch's copy into a warm, preallocated destination;
- `raw_tcp_s`: one TCP stream on loopback into a preallocated buffer, acknowledged
  (`tcp_sink` / `tcp_send_s`: its two ends, also across network namespaces, netns.py);
- `nixl_read_s`: NIXL's own READ between two processes, nothing of ours around it (two
  agents, UCX, no progress thread, as the transport makes them; a buffer of the item's size
  registered once on each side; the reader loads the holder's metadata and READs the whole
  buffer, polling the transfer's state);
- `ucx_get_s`: UCX's own `ucx_perftest -t ucp_get`, where Debian's `ucx-utils` is installed
  (a distribution's UCX, not the one NIXL's wheel bundles; None elsewhere).
Each is the median of `reps` after one warm-up. NIXL's two processes are this module:
`python -m benchmarks.harness.floors nixl-hold|nixl-read ...`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.env import pythonpath_env


def memcpy_s(nbytes: int, reps: int) -> float:
    import torch

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def tcp_sink(srv: socket.socket, nbytes: int, reps: int) -> None:
    """Receive `reps + 1` items of `nbytes` on one connection to `srv`, acknowledging each."""
    conn, _ = srv.accept()
    buf = memoryview(bytearray(nbytes))
    for _ in range(reps + 1):
        got = 0
        while got < nbytes:
            got += conn.recv_into(buf[got:], nbytes - got)
        conn.sendall(b"k")
    conn.close()


def tcp_send_s(address: tuple[str, int], nbytes: int, reps: int) -> float:
    """Median seconds to send `nbytes` to a `tcp_sink` and get its acknowledgement (the
    first send is a warm-up)."""
    import torch

    sock = socket.create_connection(address)
    data = memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy())
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        sock.sendall(data)
        sock.recv(1)
        if i:
            times.append(time.perf_counter() - t0)
    sock.close()
    return statistics.median(times)


def _tcp_sink(port_q, nbytes: int, reps: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    tcp_sink(srv, nbytes, reps)


def raw_tcp_s(nbytes: int, reps: int) -> float:
    """One TCP stream on loopback, into a preallocated buffer, acknowledged: the ceiling."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_tcp_sink, args=(q, nbytes, reps), daemon=True)
    proc.start()
    seconds = tcp_send_s(("127.0.0.1", q.get(timeout=60)), nbytes, reps)
    proc.join(10)
    return seconds


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


def _where(netns) -> tuple[list[str], list[str]]:
    """The command prefixes of (the holder / server side, the reader / client side):
    namespaces a and b of a netns.NetnsPair, or none."""
    return (netns.prefix(netns.a), netns.prefix(netns.b)) if netns else ([], [])


def nixl_read_s(nbytes: int, reps: int, env: dict[str, str] | None = None,
                netns=None) -> float:
    """Median seconds of one NIXL READ of `nbytes` from another process; with `netns`
    (netns.NetnsPair) the holder runs in its namespace a, the reader in b."""
    me = [sys.executable, "-m", "benchmarks.harness.floors"]
    env = {**os.environ, **pythonpath_env(), **(env or {})}
    holder_at, reader_at = _where(netns)
    with tempfile.TemporaryDirectory(prefix="epd-nixl-floor-") as rendezvous:
        holder = subprocess.Popen([*holder_at, *me, "nixl-hold", str(nbytes), rendezvous],
                                  env=env, stdout=subprocess.DEVNULL)
        try:
            out = subprocess.run([*reader_at, *me, "nixl-read", str(nbytes), str(reps),
                                  rendezvous], env=env, capture_output=True, text=True,
                                 timeout=300, check=True).stdout
        finally:
            Path(rendezvous, "done").touch()
            holder.wait(30)
    return float(out.strip().splitlines()[-1])


def ucx_get_s(nbytes: int, reps: int, env: dict[str, str] | None = None,
              netns=None) -> float | None:
    """Median seconds of one `ucp_get` of `nbytes` by UCX's own `ucx_perftest`, or None where
    it is not installed. The server side runs in namespace a with `netns`, as the holder."""
    exe = shutil.which("ucx_perftest")
    if exe is None:
        return None
    env = {**os.environ, **(env or {})}
    server_at, client_at = _where(netns)
    host = netns.addr_a if netns else "127.0.0.1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([*server_at, exe, "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(20):  # until the server listens
            time.sleep(0.25)
            run = subprocess.run([*client_at, exe, host, "-p", str(port), "-t", "ucp_get",
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


if __name__ == "__main__":
    if sys.argv[1:2] == ["nixl-hold"]:
        _hold(int(sys.argv[2]), Path(sys.argv[3]))
        os._exit(0)  # no teardown: UCX may fault freeing what the interpreter freed first
    elif sys.argv[1:2] == ["nixl-read"]:
        print(_read(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])), flush=True)
        os._exit(0)
    raise SystemExit("usage: python -m benchmarks.harness.floors nixl-hold NBYTES DIR | "
                     "nixl-read NBYTES REPS DIR")
