import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ec_connectors.protocol.keys import item_key
from ec_connectors.transports.safetensors_fs import TMP_PREFIX, SafetensorsTransport


def make(tmp_path, max_bytes=1 << 30, **kw) -> SafetensorsTransport:
    return SafetensorsTransport(tmp_path / "store", "model-a", max_bytes, **kw)


def soon(seconds=1.0) -> float:
    return time.monotonic() + seconds


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    t = make(tmp_path)
    x = torch.randn(64, 96).to(dtype)
    info = t.put("img-1", x)
    assert info.nbytes == x.numel() * x.element_size() and info.shape == (64, 96)
    y = t.get("img-1", soon())
    assert y is not None and y.dtype == dtype and torch.equal(x, y)
    # a standard safetensors reader understands the file
    with safe_open(info.location, "pt") as f:
        assert torch.equal(f.get_tensor("ec_cache"), x)


def test_loaded_tensor_is_writable_and_private(tmp_path):
    t = make(tmp_path)
    x = torch.ones(8, 8)
    t.put("a", x)
    y = t.get("a", soon())
    y.add_(1)  # copy-on-write mapping: the file is untouched
    assert torch.equal(t.get("a", soon()), x)


def test_unlinked_file_stays_readable_after_load(tmp_path):
    t = make(tmp_path)
    x = torch.randn(32, 32)
    t.put("a", x)
    y = t.get("a", soon())
    t.delete("a")
    assert torch.equal(y, x)


def test_reader_never_sees_a_partial_file(tmp_path):
    t = make(tmp_path)
    x = torch.randn(2048, 1024)  # 8 MB: several write syscalls
    seen_bad = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            y = t.get("big", time.monotonic())  # no wait: miss or the full tensor
            if y is not None and not torch.equal(y, x):
                seen_bad.append(1)

    th = threading.Thread(target=reader)
    th.start()
    for _ in range(5):
        t.put("big", x)
    stop.set()
    th.join()
    assert not seen_bad
    assert t.events.corrupt == 0
    assert not [p for p in t.dir.iterdir() if p.name.startswith(TMP_PREFIX)]


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    t = make(tmp_path)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        t.put("a", torch.zeros(4))
    assert list(t.dir.iterdir()) == []


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "empty", "other_id"])
def test_damaged_file_is_a_miss_not_a_crash(tmp_path, damage):
    t = make(tmp_path)
    x = torch.randn(64, 64)
    info = t.put("a", x)
    path = Path(info.location)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip":
        data[-10] ^= 0xFF
    elif damage == "header":
        data[10:20] = b"\xff" * 10
    elif damage == "empty":
        data = bytearray()
    elif damage == "other_id":
        t.put("b", x)
        data = bytearray(t.path_for("b").read_bytes())
    path.write_bytes(bytes(data))
    assert t.get("a", soon(0.05)) is None
    assert t.events.corrupt == 1


def test_missing_item_waits_until_deadline_then_misses(tmp_path):
    t = make(tmp_path)
    t0 = time.monotonic()
    assert t.get("nope", t0 + 0.2) is None
    assert 0.15 <= time.monotonic() - t0 < 1.0
    assert t.events.missing == 1


def test_get_waits_for_a_file_that_lands_later(tmp_path):
    t = make(tmp_path)
    x = torch.randn(16, 16)
    threading.Timer(0.1, t.put, args=("late", x)).start()
    y = t.get("late", soon(2.0))
    assert y is not None and torch.equal(x, y)


def test_lru_eviction_keeps_recently_used(tmp_path):
    item = torch.zeros(256, 256)  # 256 KiB + header
    t = make(tmp_path, max_bytes=3 * item.nbytes + 3 * 4096)
    for name in ["a", "b", "c"]:
        t.put(name, item)
        time.sleep(0.02)
    assert t.get("a", soon()) is not None  # touch a: now b is the oldest
    time.sleep(0.02)
    t.put("d", item)
    assert not t.exists("b")
    assert t.exists("a") and t.exists("c") and t.exists("d")
    assert t.events.evictions == 1
    total = sum(p.stat().st_size for p in t.dir.iterdir())
    assert total <= t.max_bytes


def test_hostile_ids_stay_inside_the_namespace_dir(tmp_path):
    t = make(tmp_path)
    outside = tmp_path / "escaped"
    hostile = [f"../../{outside.name}", str(outside), "x\0y", "a" * 5000, "..", "/"]
    for i, item_id in enumerate(hostile):
        t.put(item_id, torch.full((2,), float(i)))
        assert torch.equal(t.get(item_id, soon()), torch.full((2,), float(i)))
    assert not outside.exists()
    files = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert len(files) == len(hostile)
    assert all(p.parent == t.dir for p in files)


def test_namespaces_are_isolated(tmp_path):
    a = SafetensorsTransport(tmp_path, "model-a", 1 << 30)
    b = SafetensorsTransport(tmp_path, "model-b", 1 << 30)
    a.put("same-id", torch.ones(3))
    assert b.get("same-id", time.monotonic()) is None


def test_list_keys_ignores_temp_files(tmp_path):
    t = make(tmp_path)
    t.put("a", torch.ones(2))
    (t.dir / f"{TMP_PREFIX}junk").write_bytes(b"partial")
    assert list(t.list_keys()) == [item_key("a")]


def test_puts_under_budget_do_not_list_the_directory_each_time(tmp_path, monkeypatch):
    """The byte budget is kept from one scan plus our own writes: a put lists the directory
    again only when the account passes the budget or the last scan is old."""
    t = make(tmp_path)
    scans = []
    real = os.scandir
    monkeypatch.setattr(os, "scandir", lambda p: scans.append(p) or real(p))
    for i in range(20):
        t.put(f"item-{i}", torch.zeros(64, 64))
    assert len(scans) == 1  # the first put scans; the next 19 trust the account
    t._scanned_at -= 10  # the scan is old: files others wrote must be counted again
    t.put("late", torch.zeros(64, 64))
    assert len(scans) == 2


def test_with_the_deployment_secret_only_sealed_files_are_used(tmp_path):
    """A well-formed file with a matching checksum, written by anyone without the secret
    (or with another one), is a miss for a reader holding the secret; so are one item's
    sealed bytes renamed to another item."""
    from ec_connectors.protocol.seal import Seal

    ours, theirs = Seal(b"s" * 32), Seal(b"t" * 32)
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    writer = make(tmp_path, seal=ours)
    reader = make(tmp_path, seal=ours)
    writer.put("good", x)
    assert torch.equal(reader.get("good", soon()), x)
    assert reader.seal.active and writer.path_for("good").read_bytes().count(b'"mac"') == 1
    for who in (make(tmp_path), make(tmp_path, seal=theirs)):  # no secret / another secret
        who.put("planted", y)
        assert torch.equal(who.get("planted", soon()), y)  # well-formed for its writer
        assert reader.get("planted", soon(0.05)) is None
        assert reader.events.corrupt >= 1
    # sealed bytes of "good" renamed to "goof" (a well-formed file: same header length,
    # checksum intact): the seal binds the item, so it is a miss
    data = writer.path_for("good").read_bytes().replace(b'"good"', b'"goof"')
    writer.path_for("goof").write_bytes(data)
    assert make(tmp_path).get("goof", soon()) is not None  # well-formed without the seal
    assert reader.get("goof", soon(0.05)) is None
    # without a secret a reader still takes sealed files (it cannot check the seal)
    assert torch.equal(make(tmp_path).get("good", soon()), x)


def test_reads_on_a_network_filesystem_are_copied_not_mapped(tmp_path):
    t = make(tmp_path)
    x = torch.randn(64, 32)
    t.put("n", x)
    t.copy_reads = True  # as when /proc/mounts puts the directory on nfs, ceph, fuse...
    got = t.get("n", soon())
    assert torch.equal(got, x)
    t.path_for("n").unlink()  # another pod evicts it: our copy is unaffected
    got.add_(1)
    assert torch.equal(got, x + 1)


def test_a_failed_save_stops_waiting_consumers_at_once(tmp_path):
    producer, consumer = make(tmp_path), make(tmp_path)
    producer.save_failed("lost", "save queue full")
    t0 = time.monotonic()
    assert consumer.get("lost", soon(5.0)) is None
    assert time.monotonic() - t0 < 0.5  # not the whole 5 s deadline
    assert "lost" not in [k for k in consumer.list_keys()]
    x = torch.randn(4, 4)
    producer.put("lost", x)  # a later save succeeds: the tombstone goes
    assert torch.equal(consumer.get("lost", soon()), x)
