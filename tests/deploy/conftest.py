"""Everything under tests/deploy but test_manifests.py and test_dashboard_file.py is marked
`deploy` and runs only when asked for by marker (`-m deploy`, what `./run.sh test-deploy`
passes): it installs a container engine and Prometheus, builds images and starts the compose
stack and `epd up`, so `./run.sh test` (`-m "not e2e"`, then `-m e2e`) and a bare `pytest`
leave it out. test_manifests.py and test_dashboard_file.py check the deployment files and the
Grafana dashboard without running them: the fast lane's (and `-m deploy` leaves them out)."""

from __future__ import annotations

import pytest

_HERE = __file__.rsplit("/", 1)[0]
FAST = (f"{_HERE}/test_manifests.py", f"{_HERE}/test_manifests_nixl.py",
        f"{_HERE}/test_dashboard_file.py")  # the fast lane's


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items
            if str(item.path).startswith(_HERE) and str(item.path) not in FAST]
    for item in mine:
        item.add_marker(pytest.mark.deploy)
    if "deploy" not in (config.option.markexpr or ""):
        config.hook.pytest_deselected(items=mine)
        items[:] = [item for item in items if item not in mine]
