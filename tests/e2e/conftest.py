"""End-to-end tests: real `vllm serve` processes (and `epd up`) on the locally built tiny
model. Everything under tests/e2e is marked `e2e`; the fast lane is `-m "not e2e"`."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from encoder_service.local.processes import VllmServer
from encoder_service.local.testmodels import SPECS, build
from tests.e2e import fleets
from tests.helpers import WORK, port_block

_HERE = __file__.rsplit("/", 1)[0]
AGG_PORT = port_block(__name__)[0]  # the aggregated reference's own block


FLEETS = ("e_pd_fleet", "e_p_d_fleet", "tiered_fleet")
_LAST_USER: dict[str, str] = {}  # fleet fixture -> the node id of the last test using it


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.path).startswith(_HERE):
            item.add_marker(pytest.mark.e2e)


def pytest_collection_finish(session):
    for item in session.items:  # in run order: the last one seen is the last user
        for name in FLEETS:
            if name in getattr(item, "fixturenames", ()):
                _LAST_USER[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop a fleet once its last user is done: idle vLLM servers still hold memory and a
    little CPU that the lane's later servers need (the session fixture's end stops it too)."""
    for name in FLEETS:
        if _LAST_USER.get(name) == item.nodeid and name in item.funcargs:
            item.funcargs[name].close()


@pytest.fixture(scope="session")
def aggregated():
    """The aggregated tiny-LLaVA server (the reference answers), one for the session: started
    by the first module that asks for it and stopped at the session's end. Yielded started but
    maybe not yet healthy, so that it starts beside the module's own servers: call `wait()`
    (at once once it is healthy) or check `healthy()` before using it."""
    model = build(WORK / "models" / "tiny-llava", SPECS["tiny"])
    server = VllmServer("aggregated", model, AGG_PORT, WORK / "test-e2e-agg", None, cpu_core=0)
    try:
        yield server.start()
    finally:
        server.stop()


def _session_fleet(name: str, make: Callable[[], fleets.Fleet]):
    """The session fixture `name` of the fleet `make` builds (tests/e2e/fleets.py): started
    by its first user, stopped after its last (pytest_runtest_teardown) or at the end."""

    @pytest.fixture(scope="session", name=name)
    def fixture():
        fleet = make()
        try:
            yield fleet
        finally:
            fleet.close()

    return fixture


e_pd_fleet = _session_fleet("e_pd_fleet", fleets.e_pd)
e_p_d_fleet = _session_fleet("e_p_d_fleet", fleets.e_p_d)
tiered_fleet = _session_fleet("tiered_fleet", fleets.tiered)
