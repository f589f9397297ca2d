"""Start a worker's Mooncake Transfer Engine, where items move through it.

Starting the Mooncake Transfer Engine of a worker process (P2P handshake, TCP or RDMA),
with one clear error when the wheel or its libraries are missing, only where items move
through it (`needs_engine`), its listeners' ports from the port plan (engine_ports.py)."""

from __future__ import annotations

import os

from ec_connectors.config import EPDConfig
from ec_connectors.transports.engine_ports import EngineRangeError, plan_engine_ports


class TransferEngineUnavailable(RuntimeError):
    pass


def needs_engine(config: EPDConfig) -> bool:
    """Whether this process moves items with the transfer engine.

    Whether this process moves items with the engine: not on the socket data path
    (`te_data_path`, by default over TCP with a host pool), where an engine would only add
    two listeners on every interface (Mooncake binds them there whatever it is told) that
    nothing uses. A process without one neither proves nor writes into registered ranges:
    every process of a deployment must resolve `te_data_path` alike."""
    return not config.te_socket


def start_engine(config: EPDConfig, host: str):
    try:
        plan_engine_ports(config, "mooncake.engine")
    except EngineRangeError as exc:
        raise TransferEngineUnavailable(str(exc)) from None
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(config.progress_timeout_s))
    # The engine's TCP server listens where MC_TCP_BIND_ADDRESS says (else on every
    # interface): on the data-plane address, loopback without a deployment secret.
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransferEngineUnavailable(
            "transport 'mooncake' needs the Mooncake Transfer Engine: pip install "
            "'epd-serve[cpu]' (mooncake-transfer-engine-non-cuda) or '[cuda]'; it needs "
            f"libibverbs.so.1 (apt-get install libibverbs1). Import failed: {exc}") from exc
    engine = TransferEngine()
    device = config.device_name or os.environ.get("RDMA_DEVICE_NAME", "")
    rc = engine.initialize(host, "P2PHANDSHAKE", config.protocol, device if
                           config.protocol == "rdma" else "")
    if rc != 0:
        raise TransferEngineUnavailable(
            f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {config.protocol!r}, "
            f"{device!r}) failed with {rc}; check host/protocol/device_name")
    return engine
