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


# The fast lane's longest modules (measured by `--durations=0`), run first:
# pytest-xdist hands modules to its workers in collection order (--dist loadfile), so a long
# one collected last keeps one worker busy after the others are done.
LONGEST_FIRST = (
    "tests/ec_connectors/transports/test_shm.py",
    "tests/ec_connectors/transports/test_mooncake_te_puller.py",
    "tests/ec_connectors/transports/test_mooncake_store.py",
    "tests/encoder_service/gateway/test_decoders.py",
    "tests/ec_connectors/transports/test_nixl_pull.py",
    "tests/encoder_service/local/test_processes.py",
    "tests/ec_connectors/test_plugin.py",
    "tests/encoder_service/gateway/test_routing.py",
    "tests/ec_connectors/transports/test_mooncake_te_server.py",
    "tests/ec_connectors/transports/test_mooncake_te_hosts.py",
    "tests/encoder_service/gateway/test_chat.py",
    "tests/encoder_service/local/test_up.py",
    "tests/encoder_service/gateway/test_top.py",
    "tests/encoder_service/local/test_supervise.py",
)


def pytest_collection_modifyitems(config, items):
    """Put the modules of LONGEST_FIRST first, in its order; the rest keep theirs."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_configure(config):
    from tests.lanes import LaneReport

    config.pluginmanager.register(LaneReport(config), "epd-lane-report")
