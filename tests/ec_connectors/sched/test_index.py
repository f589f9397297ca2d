
import torch

from ec_connectors.protocol.keys import item_key
from ec_connectors.sched.index import AvailabilityIndex
from ec_connectors.transports.safetensors_fs import SafetensorsTransport
from tests.helpers import wait_for


def test_index_learns_new_files_in_the_background(tmp_path):
    t = SafetensorsTransport(tmp_path, "m", 1 << 30)
    idx = AvailabilityIndex(t.list_keys, interval_s=0.05)
    try:
        assert item_key("a") not in idx
        t.put("a", torch.ones(4))
        assert wait_for(lambda: item_key("a") in idx)
        t.delete("a")
        assert wait_for(lambda: item_key("a") not in idx)
    finally:
        idx.close()


def test_lookup_never_touches_the_filesystem(tmp_path):
    calls = []

    def listing():
        calls.append(1)
        return ["k1"]

    idx = AvailabilityIndex(listing, interval_s=60)
    try:
        n = len(calls)
        for _ in range(10_000):
            assert "k1" in idx
            assert "k2" not in idx
        assert len(calls) == n
    finally:
        idx.close()


def test_announced_keys_are_visible_at_once():
    idx = AvailabilityIndex(lambda: [], interval_s=60)
    try:
        idx.add("fresh")
        assert "fresh" in idx
        idx.discard("fresh")
        assert "fresh" not in idx
    finally:
        idx.close()


def test_with_inotify_a_new_file_is_known_without_listing_the_directory(tmp_path):
    t = SafetensorsTransport(tmp_path, "m", 1 << 30)
    t.put("old", torch.ones(4))
    idx = AvailabilityIndex(t.list_keys, interval_s=60, watch=t.watch_keys)
    try:
        assert idx.watching and item_key("old") in idx and idx.scans == 1
        t.put("a", torch.ones(4))  # renamed into place
        assert wait_for(lambda: item_key("a") in idx, 5)
        t.delete("old")
        assert wait_for(lambda: item_key("old") not in idx, 5)
        # a file written in place by another writer (not renamed) counts once it is closed
        (t.dir / (item_key("b") + ".safetensors")).write_bytes(b"x")
        assert wait_for(lambda: item_key("b") in idx, 5)
        (t.dir / ".tmp-partial").write_bytes(b"x")  # temp files and tombstones are not items
        assert idx.scans == 1 and len(idx) == 2
    finally:
        idx.close()
