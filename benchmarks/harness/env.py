"""Where the clone is, and the environment a benchmark's child process needs to import
`benchmarks` and `epd_testkit` from it (neither is installed), wherever its working
directory is. Standard library only: light enough for every child to import."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pythonpath_env() -> dict[str, str]:
    """`PYTHONPATH` with the clone's root first (and what was there after it)."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
