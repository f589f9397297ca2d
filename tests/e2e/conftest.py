"""End-to-end tests: real `vllm serve` processes (and `epd up`) on the locally built tiny
model. Everything under tests/e2e is marked `e2e`; the fast lane is `-m "not e2e"`."""

from __future__ import annotations

import pytest

_HERE = __file__.rsplit("/", 1)[0]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.path).startswith(_HERE):
            item.add_marker(pytest.mark.e2e)
