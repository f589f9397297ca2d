"""The lease book on its own (ec_connectors/transports/leases.py), the one policy both producer
stores use: the clamp, renewals, the victim order (unleased first, then the oldest promise once
`lease_min_s` old, pinned holdings never), the bounded wait, the one error. A settable clock
stands in for time.monotonic, so nothing here sleeps."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ec_connectors.transports import leases
from ec_connectors.transports.leases import LeaseBook, StoreNames


class Full(MemoryError):
    pass


NAMES = StoreNames("test pool", "pool_bytes", "ttl_s", Full)


@dataclass
class Item:
    key: str
    pinned: bool = False


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(leases, "time", c)
    return c


class PinTest:
    """The store's pin test, counting the holdings the book asked about."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __call__(self, item: Item) -> bool:
        self.asked.append(item.key)
        return not item.pinned


def book_of(clock: Clock, keys: str, ttl: float = 60.0, lease_min: float | None = 10.0,
            every: float = 1.0) -> LeaseBook[str, Item]:
    """A book holding one item per letter of `keys`, promised `every` seconds apart."""
    book: LeaseBook[str, Item] = LeaseBook(NAMES, ttl, lease_min)
    for k in keys:
        book.add(k, Item(k))
        clock.now += every
    return book


def test_lease_min_is_clamped_to_the_lease(clock):
    assert LeaseBook(NAMES, 60.0).lease_min_s == 60.0
    assert LeaseBook(NAMES, 60.0, 10.0).lease_min_s == 10.0
    assert LeaseBook(NAMES, 5.0, 10.0).lease_min_s == 5.0


def test_nothing_goes_while_every_lease_is_young(clock):
    book = book_of(clock, "abc")
    take = PinTest()
    assert book.victim(take) is None and len(book) == 3
    assert take.asked == []  # the oldest promise is too young: so is every other
    assert book.leases_yielded == 0


def test_unleased_go_first_oldest_promise_first_and_renewal_starts_over(clock):
    book = book_of(clock, "abc", ttl=5.0, lease_min=5.0)
    clock.now += 10  # every lease lapsed
    assert book.renew("a") and not book.renew("zz")  # "a" is leased again, the newest
    take = PinTest()
    assert book.victim(take).key == "b"
    assert book.victim(take).key == "c"
    assert book.victim(take) is None  # "a" promised just now
    assert take.asked == ["b", "c"] and list(book.keys()) == ["a"]
    assert book.leases_yielded == 0  # lapsed leases are not yielded ones


def test_a_full_book_of_leases_yields_the_oldest_promise_once_lease_min_old(clock, caplog):
    book = book_of(clock, "ab", ttl=60.0, lease_min=0.3, every=0.05)
    assert book.victim(PinTest()) is None  # both promised just now
    clock.now += 0.3
    assert book.renew("a")  # promised again: "b" is now the oldest promise
    with caplog.at_level("INFO"):
        assert book.victim(PinTest()).key == "b"
    assert book.leases_yielded == 1 and list(book.keys()) == ["a"]
    assert "test pool full: item b gives up the rest of its lease" in caplog.text
    assert "raise pool_bytes" in caplog.text


def test_pinned_holdings_are_skipped_and_cost_only_themselves(clock):
    book = book_of(clock, "abcdefgh", ttl=60.0, lease_min=10.0)
    clock.now += 4  # a, b, c were promised 12, 11, 10 s ago: they may yield; d-h may not
    for k in "ab":
        book.get(k).pinned = True
    take = PinTest()
    assert book.victim(take).key == "c"
    assert take.asked == ["a", "b", "c"]  # no sort, no second pass: the pinned, then one
    take = PinTest()
    assert book.victim(take) is None  # "d" is 9 s old: it and everything after stay
    assert take.asked == ["a", "b"]
    assert book.leases_yielded == 1


def test_a_replaced_copy_goes_first_even_when_promised_last(clock):
    book = book_of(clock, "abc")
    book.add("a2", Item("a"))  # a newer copy of "a"
    book.drop_lease("c")  # ... and "c" was replaced by one: unleased, first to go
    book.drop_lease("missing")
    assert book.victim(PinTest()).key == "c"
    assert book.leases_yielded == 0


def test_adding_a_held_key_replaces_it_as_the_newest_promise(clock):
    book = book_of(clock, "ab", ttl=5.0)
    book.add("a", Item("a-new"))
    assert len(book) == 2 and book.get("a").key == "a-new"
    assert list(book.keys()) == ["b", "a"]


def test_the_wait_is_bounded_by_the_deadline_the_next_change_and_the_poll(clock):
    book = book_of(clock, "ab", ttl=60.0, lease_min=10.0)  # promised 2 s and 1 s ago
    assert book.victim(PinTest()) is None
    deadline = clock.now + 30
    assert book.wait_s(deadline, poll_s=100.0, pinned_poll_s=0.001) == pytest.approx(8.0)
    assert book.wait_s(deadline, poll_s=0.25, pinned_poll_s=0.001) == 0.25
    assert book.wait_s(clock.now + 0.1, poll_s=0.25, pinned_poll_s=0.001) == pytest.approx(0.1)
    assert book.wait_s(clock.now, poll_s=0.25, pinned_poll_s=0.001) is None  # give up
    clock.now += 8.5  # "a" may yield now, but it is pinned
    book.get("a").pinned = True
    assert book.victim(PinTest()) is None
    assert book.wait_s(deadline, poll_s=0.25, pinned_poll_s=0.001) == 0.001  # poll the pin
    book.get("b").pinned = True
    clock.now += 1
    assert book.victim(PinTest()) is None  # all pinned: only a pin can change that
    assert book.wait_s(deadline, poll_s=0.25, pinned_poll_s=0.25) == 0.25


def test_one_error_for_a_full_store(clock):
    book = book_of(clock, "abc", ttl=5.0)  # promised 3, 2 and 1 s ago
    clock.now += 3.5  # "a" and "b" lapsed
    err = book.full_error(used_bytes=900, capacity=1000)
    assert isinstance(err, Full)
    assert str(err) == ("test pool full: 900 of 1000 bytes hold 3 items, 1 still leased "
                        "(ttl_s=5.0) or being read; raise pool_bytes or lower ttl_s")


def test_clear_pop_and_views(clock):
    book = book_of(clock, "abc")
    assert "b" in book and book.pop("b").key == "b" and book.pop("b") is None
    assert [i.key for i in book.values()] == ["a", "c"]
    assert [i.key for i in book.clear()] == ["a", "c"] and len(book) == 0
