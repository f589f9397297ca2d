"""DirWatch (ec_connectors/transports/dir_watch.py): the keys of a directory as they change,
as the safetensors and shm transports hand them to the availability index."""

from __future__ import annotations

import os

import pytest

from ec_connectors.transports.dir_watch import DirWatch

pytest.importorskip("inotify_simple")


def key_of(name: str) -> str | None:
    return name.removesuffix(".rec") if name.endswith(".rec") and name[0] != "." else None


def test_renamed_in_is_added_removed_is_gone_other_names_are_ignored(tmp_path):
    watch = DirWatch(str(tmp_path), key_of)
    try:
        (tmp_path / ".tmp-a").write_bytes(b"x")
        os.rename(tmp_path / ".tmp-a", tmp_path / "a.rec")
        (tmp_path / "b.rec").write_bytes(b"x")  # written in place: not a finished record
        assert watch.read(1.0) == (["a"], [], False)
        (tmp_path / "a.rec").unlink()
        os.rename(tmp_path / "b.rec", tmp_path / ".gone")
        assert watch.read(1.0) == ([], ["a", "b"], False)
    finally:
        watch.close()
        watch.close()  # idempotent


def test_close_write_counts_a_file_written_in_place_and_losing_the_dir_is_lost(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    watch = DirWatch(str(d), key_of, close_write=True)
    try:
        (d / "c.rec").write_bytes(b"x")
        assert watch.read(1.0) == (["c"], [], False)
        (d / "c.rec").unlink()
        d.rmdir()
        added, removed, lost = watch.read(1.0)
        assert (added, removed, lost) == ([], ["c"], True)
    finally:
        watch.close()


def test_wake_ends_a_blocked_read_with_nothing_and_later_reads_still_see_changes(tmp_path):
    import threading

    watch = DirWatch(str(tmp_path), key_of)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(watch.read(60.0)))
    try:
        reader.start()
        watch.wake()
        reader.join(10)
        assert not reader.is_alive() and got == [([], [], False)]
        (tmp_path / ".tmp-d").write_bytes(b"x")
        os.rename(tmp_path / ".tmp-d", tmp_path / "d.rec")  # the wake was used up: this counts
        assert watch.read(5.0) == (["d"], [], False)
    finally:
        watch.close()
