"""Starting the Mooncake Transfer Engine of a worker process (P2P handshake, TCP or RDMA),
with one clear error when the wheel or its libraries are missing."""

from __future__ import annotations

import os

from ec_connectors.config import EPDConfig


class TransferEngineUnavailable(RuntimeError):
    pass


def start_engine(config: EPDConfig, host: str):
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
