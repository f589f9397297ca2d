"""Small helpers shared by the tests."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator


def wait_for(pred: Callable[[], object], timeout: float = 5.0, interval: float = 0.005) -> bool:
    """Poll `pred` until it is truthy (True) or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def free_port(ports: Iterator[int]) -> int:
    """The next port of `ports` that nothing listens on (each test module owns a range)."""
    for p in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port left in this test module's range")
