"""Two "hosts" on this machine: network namespaces joined by a veth pair (root, `ip netns`).

    with NetnsPair() as pair:            # pair.a / pair.b: namespace names,
        pair.prefix(pair.a)              # ["ip", "netns", "exec", name] for a process there
        raw_tcp_netns_s(pair, nbytes, reps)   # one TCP stream from b to a over the veth

`python -m benchmarks.transports.paths --netns` runs each path's producer in `a` (ADDR_A) and
consumer in `b` (ADDR_B), so every byte crosses a real interface (veth), not loopback; raw
TCP is measured across the same pair. Its sink and sender are this module:
`python -m benchmarks.harness.netns sink|send NBYTES REPS`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from benchmarks.harness.env import pythonpath_env
from benchmarks.harness.floors import tcp_send_s, tcp_sink

ADDR_A, ADDR_B = "10.79.0.1", "10.79.0.2"
_PORT = 24999


class NetnsPair:
    addr_a, addr_b = ADDR_A, ADDR_B

    def __init__(self) -> None:
        tag = os.getpid() % 10000
        self.a, self.b = f"epd-tb-a{tag}", f"epd-tb-b{tag}"
        self._veth = (f"epdtba{tag}", f"epdtbb{tag}")

    def prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def __enter__(self) -> NetnsPair:
        va, vb = self._veth
        for cmd in (f"ip netns add {self.a}", f"ip netns add {self.b}",
                    f"ip link add {va} type veth peer name {vb}",
                    f"ip link set {va} netns {self.a}", f"ip link set {vb} netns {self.b}",
                    f"ip -n {self.a} addr add {ADDR_A}/24 dev {va}",
                    f"ip -n {self.b} addr add {ADDR_B}/24 dev {vb}",
                    f"ip -n {self.a} link set {va} up", f"ip -n {self.b} link set {vb} up",
                    f"ip -n {self.a} link set lo up", f"ip -n {self.b} link set lo up"):
            if os.system(cmd) != 0:
                self.__exit__()
                raise RuntimeError(f"network namespaces need root and `ip netns`: {cmd}")
        return self

    def __exit__(self, *exc) -> None:
        os.system(f"ip netns del {self.a} >/dev/null 2>&1; ip netns del {self.b} "
                  ">/dev/null 2>&1")


def raw_tcp_netns_s(pair: NetnsPair, nbytes: int, reps: int) -> float:
    """One TCP stream from namespace b to a, into a preallocated buffer, acknowledged."""
    me = [sys.executable, "-m", "benchmarks.harness.netns"]
    env = {**os.environ, **pythonpath_env()}
    sink = subprocess.Popen([*pair.prefix(pair.a), *me, "sink", str(nbytes), str(reps)],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        out = subprocess.run([*pair.prefix(pair.b), *me, "send", str(nbytes), str(reps)],
                             capture_output=True, text=True, timeout=300, check=True,
                             env=env).stdout
        return float(out.strip())
    finally:
        sink.wait(30)


def _sink(nbytes: int, reps: int) -> None:
    srv = socket.create_server((ADDR_A, _PORT))
    print("ready", flush=True)
    tcp_sink(srv, nbytes, reps)


def _send(nbytes: int, reps: int) -> None:
    print(tcp_send_s((ADDR_A, _PORT), nbytes, reps))


if __name__ == "__main__":
    {"sink": _sink, "send": _send}[sys.argv[1]](int(sys.argv[2]), int(sys.argv[3]))
