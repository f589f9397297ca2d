"""The producer's save queue: count and byte bounds, backpressure with a deadline, and an
item larger than the byte budget entering alone."""

from __future__ import annotations

import threading
import time

from ec_connectors.workers.save_queue import SaveQueue


def test_bytes_bound_the_queue_not_only_the_count():
    q = SaveQueue(max_items=16, max_bytes=100)
    assert q.enter(60, 0.01) and not q.enter(60, 0.05)  # 120 bytes > 100: refused
    assert q.enter(40, 0.01)  # 100 fits
    assert (q.items, q.bytes, q.peak_bytes) == (2, 100, 100)
    q.leave(60)
    q.leave(40)
    assert (q.items, q.bytes) == (0, 0)


def test_count_bounds_small_items():
    q = SaveQueue(max_items=2, max_bytes=1 << 30)
    assert q.enter(1, 0.01) and q.enter(1, 0.01) and not q.enter(1, 0.05)


def test_an_item_over_the_budget_enters_alone():
    q = SaveQueue(max_items=4, max_bytes=100)
    assert q.enter(500, 0.01)  # nothing held: a wait for room always ends
    assert not q.enter(1, 0.05)
    q.leave(500)
    assert q.enter(1, 0.01)


def test_a_waiting_save_enters_when_room_is_made():
    q = SaveQueue(max_items=4, max_bytes=100)
    assert q.enter(80, 0.01)
    threading.Timer(0.05, q.leave, (80,)).start()
    t0 = time.monotonic()
    assert q.enter(80, 2.0)
    assert 0.03 < time.monotonic() - t0 < 1.0


def test_drain_waits_for_every_item():
    q = SaveQueue(max_items=4, max_bytes=100)
    q.enter(10, 0.01)
    assert not q.drain(0.05)
    threading.Timer(0.05, q.leave, (10,)).start()
    assert q.drain(2.0)
