"""The version lane's checks (`./run.sh test-compat`, scripts/compat.py): run by each vLLM
version's own python. Every check appends what it verified to the lane's report."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def report():
    """`report(line)`: one line of what this version was checked for (printed by the lane)."""
    path = os.environ.get("EPD_COMPAT_REPORT")

    def write(line: str) -> None:
        if path:
            with open(path, "a") as f:
                f.write(f"  - {line}\n")

    return write
