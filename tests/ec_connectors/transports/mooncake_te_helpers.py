"""What the Mooncake Transfer Engine test modules share (test_mooncake_te_server.py: the
serving side, test_mooncake_te_puller.py: the pulling side, test_mooncake_te_hosts.py: other
hosts and the deployment secret). Each module owns a block of base ports (`base_ports`), so
two of them can run at once on two xdist workers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from epd_testkit.peer_process import PeerClient
from tests.helpers import MOONCAKE, port_block

MiB = 1 << 20
PRODUCER = {"is_producer": True, "is_consumer": False}
CONSUMER = {"is_producer": False, "is_consumer": True}


def base_ports(module: str) -> Iterator[int]:
    """Base ports of test module `module` (its `__name__`), 10 apart: its Mooncake block of
    tests/helpers.py (a producer's ranks serve from the base port, announce on base + 1000,
    take data connections on base + 2000)."""
    return iter(port_block(module, MOONCAKE)[::10])


def mc_config(base_port: int, **extra) -> dict:
    return {"transport": "mooncake", "protocol": "tcp", "host": "127.0.0.1",
            "base_port": base_port, "memory_pool_bytes": 256 * MiB, **extra}


def health(peer: PeerClient) -> dict:
    return peer.call({"op": "health"})["health"]


def secret_file(directory: Path, value: bytes = b"epd-test-secret-0123456789abcdef") -> str:
    path = directory / f"secret-{value[-4:].hex()}"
    path.write_bytes(value)
    path.chmod(0o600)
    return str(path)


def netns_ok() -> bool:
    """Whether this process may make network namespaces (root and `ip netns`)."""
    if os.geteuid() != 0:
        return False
    name = f"epd-probe-{os.getpid()}"  # per process: xdist workers collect at the same time
    return os.system(f"ip netns add {name} >/dev/null 2>&1 && ip netns del {name}") == 0
