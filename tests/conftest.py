"""Shared fixtures. End-to-end fixtures (real vLLM servers) live in tests/e2e/conftest.py."""

from __future__ import annotations

import tempfile

import pytest

from tests.helpers import Peers


@pytest.fixture
def ctl_dir():
    # Unix socket paths must stay short: not under pytest's deep tmp_path.
    with tempfile.TemporaryDirectory(prefix="epdctl-", dir="/tmp") as d:
        yield d


@pytest.fixture
def peers(request):
    """Transport peer processes (`peer_process`) of one test; all stopped at its end."""
    p = Peers(request.node.name)
    yield p
    p.close()


def pytest_configure(config):
    from tests.lanes import LaneReport

    config.pluginmanager.register(LaneReport(config), "epd-lane-report")
