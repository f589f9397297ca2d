"""Follow a directory's keys as they change, from inotify.

A directory's keys as they change, from inotify (`base.KeyWatch`): what the file-backed
transports (safetensors_fs, shm) hand the scheduler's availability index. Linux only; making
one raises ImportError or OSError elsewhere, and the caller then lets the index scan."""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Callable


class DirWatch:
    """inotify on one directory.

    An entry whose name `key_of` maps to a key is added when it is renamed into place (with
    `close_write`, also when a file written there is closed) and removed when it is deleted or
    renamed away; an overflowed queue or the directory's own removal reads as "lost track" (the
    index rescans)."""

    def __init__(self, path: str, key_of: Callable[[str], str | None], *,
                 close_write: bool = False) -> None:
        from inotify_simple import INotify, flags

        self._flags = flags
        self._key_of = key_of
        self._added = flags.MOVED_TO | (flags.CLOSE_WRITE if close_write else 0)
        self._inotify = INotify(nonblocking=True)
        self._inotify.add_watch(path, self._added | flags.DELETE | flags.MOVED_FROM
                                | flags.DELETE_SELF)
        # wake() ends a blocked read at once, so closing the index does not wait out a timeout
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._inotify.fileno(), select.POLLIN)
        self._poll.register(self._wake, select.POLLIN)

    def read(self, timeout_s: float) -> tuple[list[str], list[str], bool]:
        """(keys added, keys removed, lost track), waiting at most `timeout_s`."""
        f = self._flags
        added: list[str] = []
        removed: list[str] = []
        lost = False
        ready = {fd for fd, _ in self._poll.poll(int(timeout_s * 1000))}
        if self._wake in ready:
            with contextlib.suppress(OSError):
                os.eventfd_read(self._wake)
            return added, removed, lost
        if self._inotify.fileno() not in ready:
            return added, removed, lost
        for event in self._inotify.read(timeout=0):
            if event.mask & (f.Q_OVERFLOW | f.DELETE_SELF | f.IGNORED):
                lost = True
                continue
            key = self._key_of(event.name)
            if key is not None:
                (added if event.mask & self._added else removed).append(key)
        return added, removed, lost

    def wake(self) -> None:
        """Make a read blocked in another thread return at once, with nothing."""
        with contextlib.suppress(OSError, ValueError):
            os.eventfd_write(self._wake, 1)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._inotify.close()
        if self._wake >= 0:
            os.close(self._wake)
            self._wake = -1
