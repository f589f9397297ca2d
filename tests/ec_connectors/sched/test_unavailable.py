"""What becomes of a consumer's requests whose items cannot arrive (unavailable.py): each
fallback counted once per request and item, forgotten with its request, at the cost of that
request's own items (never a scan of every live request's)."""

from __future__ import annotations

import pytest

from ec_connectors.sched.unavailable import Unavailable
from ec_connectors.stats import StatsRecorder


class NoScan(dict):
    """A dict that fails a test when iterated: reads and writes by key only."""

    def _scan(self, *_a):
        raise AssertionError("scanned every entry")

    __iter__ = keys = values = items = _scan


@pytest.fixture
def unavailable(tmp_path):
    u = Unavailable(tmp_path / "board", StatsRecorder())
    yield u
    u.close()


def test_a_fallback_is_counted_once_and_forgotten_with_its_request(unavailable):
    u = unavailable
    u.local_encode("r1", "a", "late")
    u.local_encode("r1", "a", "late")  # looked at again next step: not counted again
    u.local_encode("r1", "b", "")
    u.local_encode("r2", "a", "late")
    assert u.stats.totals["local_encode_fallbacks"] == 3
    assert u.reported("r1", "a") and u.reported("r1", "b") and u.reported("r2", "a")
    assert not u.reported("r2", "b") and not u.reported("r3", "a")
    u.finished("r1")
    assert not u.reported("r1", "a") and not u.reported("r1", "b") and u.reported("r2", "a")
    u.local_encode("r1", "a", "late")  # the same id again (a new request): counted
    assert u.stats.totals["local_encode_fallbacks"] == 4


def test_a_failing_request_is_reported_for_every_item_and_taken_once(unavailable):
    u = unavailable
    u.fail("r1", "a", "deadline passed", metadata_only=True)
    u.fail("r1", "b", "deadline passed", metadata_only=True)
    assert u.reported("r1", "zzz") and u.stats.totals["failed_requests"] == 1
    assert u.take() == {"r1"} and u.take() == set()


def test_a_request_ending_touches_its_own_fallbacks_only(unavailable):
    """1,000 live requests fell back: each end costs O(its items), not O(every request's)."""
    u = unavailable
    u._fallbacks = NoScan()
    for k in range(1000):
        u.local_encode(f"r{k}", f"item{k}", "late")
    for k in range(0, 1000, 2):
        u.finished(f"r{k}")
        u.finished(f"never-fell-back{k}")
    assert len(u._fallbacks) == 500
    assert u.reported("r1", "item1") and not u.reported("r0", "item0")
