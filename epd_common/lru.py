"""A bounded map that forgets its least recently written entry.

A bounded map that forgets its least recently written entry: the one shape behind every
"remember the last N" table (saved infos, probe answers, holders, claims, recent evictions).
Not thread-safe: callers hold their own lock, as they already do for the state around it."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedLRU(OrderedDict[K, V], Generic[K, V]):
    """An ordered dict that keeps at most `limit` entries, dropping the oldest.

    An OrderedDict of at most `limit` entries; setting a key makes it the newest, and the
    oldest entries go once the limit is passed. Reads do not reorder (`touch` does)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a BoundedLRU needs a limit of at least 1")
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)

    def touch(self, key: K) -> None:
        """Mark `key` as the newest without changing its value (KeyError if absent)."""
        self.move_to_end(key)
