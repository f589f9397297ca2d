"""Small helpers shared by the tests."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(pred: Callable[[], object], timeout: float = 5.0, interval: float = 0.005) -> bool:
    """Poll `pred` until it is truthy (True) or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
