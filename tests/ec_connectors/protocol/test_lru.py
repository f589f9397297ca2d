import pytest

from epd_common.lru import BoundedLRU


def test_oldest_written_entry_goes_first_once_the_limit_is_passed():
    lru = BoundedLRU[str, int](2)
    lru["a"] = 1
    lru["b"] = 2
    lru["a"] = 3  # rewriting makes "a" the newest
    lru["c"] = 4
    assert list(lru.items()) == [("a", 3), ("c", 4)]


def test_touch_keeps_an_entry_and_a_zero_limit_is_refused():
    lru = BoundedLRU[str, int](2)
    lru["a"] = 1
    lru["b"] = 2
    lru.touch("a")
    lru["c"] = 3
    assert set(lru) == {"a", "c"}
    with pytest.raises(ValueError):
        BoundedLRU(0)
