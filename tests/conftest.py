"""Shared fixtures. End-to-end fixtures (real vLLM servers) live in test_e2e_vllm.py."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("EPD_WORK_DIR", ROOT / ".work"))


@pytest.fixture
def ctl_dir():
    # Unix socket paths must stay short: not under pytest's deep tmp_path.
    with tempfile.TemporaryDirectory(prefix="epdctl-", dir="/tmp") as d:
        yield d


@pytest.fixture
def peers(request):
    """Transport peer processes (`peer_process`) of one test; all stopped at its end."""
    from .helpers import Peers

    p = Peers(request.node.name)
    yield p
    p.close()
