
import torch

from ec_connectors.protocol.keys import item_key
from ec_connectors.transports.safetensors_fs import SafetensorsTransport
from scheduler_hooks.index import AvailabilityIndex
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
