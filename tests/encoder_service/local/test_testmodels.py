"""Test-model builds: idempotent, and one at a time per directory across callers (the e2e
lane's warm-up builds beside the fast lane's tests)."""

from __future__ import annotations

import threading
import time

from encoder_service.local import testmodels
from encoder_service.local.testmodels import SPECS


def test_concurrent_builds_of_one_model_build_it_once_and_all_see_it_whole(tmp_path,
                                                                            monkeypatch):
    built: list[str] = []

    def slow_family(tmp, spec):  # stands in for the real (seconds-long) builder
        built.append(spec.name)
        time.sleep(0.2)
        (tmp / "weights").write_text(spec.name)

    monkeypatch.setattr(testmodels, "_build_family", slow_family)
    out = tmp_path / "models" / "tiny"
    seen: list[str] = []

    def caller():
        path = testmodels.build(out, SPECS["tiny"])
        seen.append((path / "weights").read_text())

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert built == ["tiny"] and seen == ["tiny"] * 4
    testmodels.build(out, SPECS["tiny"])  # up to date: no second build
    assert built == ["tiny"]
