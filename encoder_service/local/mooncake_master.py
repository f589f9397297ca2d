"""The Mooncake Store master process, started where a deployment needs one.

The Mooncake Store master (`mooncake_master` from the Mooncake wheel), started by the project
where a deployment needs one: `epd up`, tests, benchmarks, `epd master` in compose/k8s.

It serves the store's RPC (`rpc_port`, default 50051), the HTTP metadata server clients
register their segments with (`http_port`, default RPC + 1) and Prometheus metrics
(`metrics_port`, default RPC + 2): `ec_connectors.protocol.ports`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import httpx

from ec_connectors.protocol import ports
from encoder_service.local.processes import ManagedProcess, ServerFailed
from epd_common.net import port_holder, port_open

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; annotations only


class MasterMissing(ServerFailed):
    pass


def master_binary() -> str:
    """Path of `mooncake_master`: beside this interpreter (venv), else on PATH."""
    beside = Path(sys.executable).with_name("mooncake_master")
    if beside.exists():
        return str(beside)
    found = shutil.which("mooncake_master")
    if found is None:
        raise MasterMissing(
            "mooncake_master not found beside the interpreter or on PATH: pip install "
            "'epd-serve[cpu]' (mooncake-transfer-engine-non-cuda) or '[cuda]'; it needs "
            "libibverbs.so.1 (apt-get install libibverbs1)")
    return found


def master_command(host: str, rpc_port: int, http_port: int, metrics_port: int) -> list[str]:
    return [master_binary(), f"--rpc_address={host}", f"--rpc_port={rpc_port}",
            "--enable_http_metadata_server=true", f"--http_metadata_server_host={host}",
            f"--http_metadata_server_port={http_port}", f"--metrics_host={host}",
            f"--metrics_port={metrics_port}"]


@dataclass
class MasterServer(ManagedProcess):
    """One `mooncake_master` process (start/wait/stop, log file).

    `port` is the RPC port; healthy = RPC port accepts and the metadata server answers."""

    name: str
    port: int
    work_dir: Path
    host: str = "127.0.0.1"
    http_port: int = 0  # default port + 1
    metrics_port: int = 0  # default port + 2
    env: dict[str, str] = field(default_factory=dict)  # on top of os.environ
    proc: subprocess.Popen | None = None

    startup_timeout_s: ClassVar[float] = 30.0

    def __post_init__(self) -> None:
        self.http_port = self.http_port or ports.master_http_port(self.port)
        self.metrics_port = self.metrics_port or ports.master_metrics_port(self.port)

    @property
    def address(self) -> str:
        """What clients take as `store_master`."""
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}"

    @property
    def metadata_url(self) -> str:
        """What clients take as `store_metadata`."""
        return f"http://{self.host}:{self.http_port}/metadata"

    def command(self) -> list[str]:
        return master_command(self.host, self.port, self.http_port, self.metrics_port)

    def start(self) -> Self:
        for port in (self.port, self.http_port, self.metrics_port):
            if port_open(self.host, port, 0.2):
                held = port_holder(port)
                raise ServerFailed(f"{self.name}: {self.host}:{port} is already in use"
                                   f"{f' by {held}' if held else ''}; stop what holds it or "
                                   "pick other master ports")
        super().start()
        return self

    def healthy(self) -> bool:
        if not port_open(self.host, self.port):
            return False
        try:  # any HTTP answer (404 for an unknown key) means the metadata server is up
            httpx.get(self.metadata_url, params={"key": "epd-health"}, timeout=1.0)
            return True
        except httpx.HTTPError:
            return False


def master_server(work_dir: Path, port: int = ports.MASTER_RPC_PORT, host: str = "127.0.0.1",
                  name: str = "mooncake-master") -> MasterServer:
    """A master with RPC on `port`, metadata on port+1, metrics on port+2 (log in work_dir)."""
    return MasterServer(name, port, work_dir, host=host)


def main(argv: list[str] | None = None) -> int:
    """`epd master`: run the store master in the foreground (compose, k8s)."""
    parser = argparse.ArgumentParser(prog="epd master", description=__doc__)
    parser.add_argument("--host", default=os.environ.get("EPD_MASTER_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=ports.MASTER_RPC_PORT,
                        help=f"RPC port (store_master; default {ports.MASTER_RPC_PORT})")
    parser.add_argument("--http-port", type=int, help="HTTP metadata server port "
                        "(store_metadata; default: the RPC port + 1)")
    parser.add_argument("--metrics-port", type=int,
                        help="Prometheus metrics port (default: the RPC port + 2)")
    args, extra = parser.parse_known_args(argv)
    http_port = args.http_port or ports.master_http_port(args.port)
    metrics_port = args.metrics_port or ports.master_metrics_port(args.port)
    try:
        cmd = master_command(args.host, args.port, http_port, metrics_port)
    except MasterMissing as exc:
        print(f"epd master: {exc}", file=sys.stderr)
        return 2
    print(f"epd master: {' '.join(cmd + extra)}", flush=True)
    os.execv(cmd[0], cmd + extra)  # extra: any other mooncake_master flag, passed through
    return 0


if __name__ == "__main__":
    sys.exit(main())
