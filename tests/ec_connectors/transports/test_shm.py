"""The shm transport on real shared memory (/dev/shm): producer and consumer peer processes
(`peer_process`), and in-process instances for what a peer could do to a consumer: hostile
records, damaged blocks, other users' files, a full arena, readers that pin blocks, dead
producers."""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import signal
import sys
import threading
import time
import uuid

import pytest
import torch

from ec_connectors.config import EPDConfig
from ec_connectors.protocol.keys import item_key, namespace_key
from ec_connectors.transports import Placement, make_transport
from ec_connectors.transports.hashed_copy import Digest, copy_and_hash
from ec_connectors.transports.shm.arena import BLOCK_HEADER, ArenaFull, range_lock
from ec_connectors.transports.shm.layout import RECORD_MAGIC, Record, ShmError
from tests.helpers import expected, wait_for

MiB = 1 << 20
PRODUCER = {"is_producer": True, "is_consumer": False}
CONSUMER = {"is_producer": False, "is_consumer": True}
SCHEDULER = {"role": "scheduler", "is_producer": False, "is_consumer": True}
NS = "llava-a"


def fresh_root() -> str:
    return f"/dev/shm/epd-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def root():
    path = fresh_root()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def pair():
    """A producer and a consumer process on one directory, for the tests that need no
    special configuration (peer processes take seconds to start)."""
    from tests.helpers import Peers

    path = fresh_root()
    p = Peers("shm-pair")
    try:
        yield {"root": path, "prod": p.start(PRODUCER, **conf(path)),
               "cons": p.start(CONSUMER, **conf(path))}
    finally:
        p.close()
        shutil.rmtree(path, ignore_errors=True)


def conf(root: str, **extra) -> dict:
    return {"transport": "shm", "shm_path": root, "namespace": NS,
            "shm_arena_bytes": 128 * MiB, "shm_consumer_pool_bytes": 64 * MiB, **extra}


def make(root: str, placement: dict, **extra):
    return make_transport(EPDConfig.from_dict(conf(root, **extra)), Placement(**placement))


def ns_dir(root: str) -> str:
    return os.path.join(root, namespace_key(NS))


def secret(tmp_path, name: str) -> str:
    path = tmp_path / name
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return str(path)


def soon(s: float = 2.0) -> float:
    return time.monotonic() + s


def put(peer, item_id: str, seed: int, shape: list[int]) -> dict:
    return peer.call({"op": "put", "id": item_id, "seed": seed, "shape": shape,
                      "dtype": "bfloat16"})


def get(peer, item_id: str, timeout_s: float = 2.0) -> dict:
    return peer.call({"op": "get", "id": item_id, "timeout_s": timeout_s})


# -- across processes --------------------------------------------------------------------------
def test_items_cross_processes_verified(pair):
    prod, cons, root = pair["prod"], pair["cons"], pair["root"]
    for seed, shape in ((1, [1, 512]), (2, [129, 4096]), (3, [6144, 4096])):  # 1 KiB-48 MiB
        put(prod, f"img-{seed}", seed, shape)
        got = get(cons, f"img-{seed}")
        assert got["found"] and got["shape"] == shape and got["dtype"] == "bfloat16"
        assert got["checksum"] == expected(seed, shape)
    sched = make(root, SCHEDULER)  # a consumer's scheduler reads small items itself
    try:
        small = sched.get_small("img-1", 4096)
        assert small is not None and small.shape == (1, 512)
        assert sched.get_small("img-2", 4096) is None  # larger: the workers load it
    finally:
        sched.close()
    # a save that failed: a waiting consumer stops at once instead of running out its wait
    prod.call({"op": "save_failed", "id": "lost"})
    t0 = time.monotonic()
    assert not get(cons, "lost", timeout_s=10)["found"]
    assert time.monotonic() - t0 < 5
    health = cons.call({"op": "health"})["health"]
    assert health["pool_used_bytes"] == 0  # every load's block went back with its tensor
    assert prod.call({"op": "health"})["health"]["items"] >= 3


def test_a_damaged_block_is_a_miss_never_wrong_bytes_where_the_reader_hashes(pair):
    """With `shm_read_verify: bytes` a bit flipped in a block after its seal is a miss."""
    prod, root = pair["prod"], pair["root"]
    cons = make(root, CONSUMER, shm_read_verify="bytes")
    try:
        put(prod, "damaged", 5, [256, 4096])
        rec = _record(root, "damaged")
        with open(os.path.join(ns_dir(root), rec.arena), "r+b") as f, \
                mmap.mmap(f.fileno(), 0) as mm:
            mm[rec.offset + BLOCK_HEADER + 12345] ^= 0x01  # one bit of the payload
        assert cons.get("damaged", soon()) is None and cons.events.corrupt == 1
    finally:
        cons.close()


def test_a_dead_producers_arena_and_records_are_swept(root, peers):
    prod = peers.start(PRODUCER, **conf(root))
    put(prod, "img", 7, [64, 4096])
    os.killpg(prod.proc.pid, signal.SIGKILL)
    prod.proc.wait(10)
    names = os.listdir(ns_dir(root))
    assert any(n.endswith(".shm") for n in names) and any(n.endswith(".item") for n in names)
    cons = make(root, CONSUMER)  # a worker sweeps at start
    try:
        assert os.listdir(ns_dir(root)) == []  # the arena's memory is free again
        assert cons.get("img", soon(0.1)) is None
    finally:
        cons.close()


def test_tiers_fall_back_to_safetensors(root, tmp_path):
    tiers = EPDConfig.from_dict(conf(root, transport=["shm", "safetensors"],
                                     storage_path=str(tmp_path / "st")))
    prod = make_transport(tiers, Placement(**PRODUCER))
    cons = make_transport(tiers, Placement(**CONSUMER))
    try:
        x = torch.randn(128, 4096).to(torch.bfloat16)
        prod.put("a", x)
        prod.put("b", x)
        os.unlink(os.path.join(ns_dir(root), item_key("b") + ".item"))  # gone from shm
        for item_id in ("a", "b"):
            got = cons.get(item_id, soon())
            assert got is not None and torch.equal(got, x)
        assert cons.totals["tier_shm_hits"] == 1 and cons.totals["tier_safetensors_hits"] == 1
    finally:
        prod.close()
        cons.close()


def test_items_are_bound_to_the_deployment_secret(root, tmp_path):
    a, b = secret(tmp_path, "a"), secret(tmp_path, "b")
    prod = make(root, PRODUCER, secret_file=a, shm_verify="blake3")
    consumers = [make(root, CONSUMER, secret_file=s, shm_verify=v)
                 for s, v in ((a, "blake3"), (b, "blake3"), (a, "xxh3"), (None, "blake3"))]
    try:
        x = torch.randn(64, 4096).to(torch.bfloat16)
        prod.put("img", x)
        same, other, xxh3, unkeyed = consumers
        assert torch.equal(same.get("img", soon()), x)
        for c in (other, unkeyed):  # stored under another secret (or none): a miss
            assert c.get("img", soon()) is None and c.events.corrupt == 1
        assert xxh3.get("img", soon()) is None  # a consumer that verifies otherwise
    finally:
        for c in (prod, *consumers):
            c.close()


# -- what a record may claim -------------------------------------------------------------------
def _record(root: str, item_id: str) -> Record:
    from ec_connectors.transports.shm.layout import _decode

    with open(os.path.join(ns_dir(root), item_key(item_id) + ".item"), "rb") as f:
        return _decode(f.read()[len(RECORD_MAGIC):])


def _plant(root: str, item_id: str, rec: Record, mode: int = 0o600) -> None:
    import msgspec

    path = os.path.join(ns_dir(root), item_key(item_id) + ".item")
    with open(path, "wb") as f:
        f.write(RECORD_MAGIC + msgspec.msgpack.encode(rec))
    os.chmod(path, mode)


def test_records_are_checked_against_the_deployment_and_the_arena(root, tmp_path):
    prod, cons = make(root, PRODUCER), make(root, CONSUMER)
    try:
        x = torch.randn(64, 512).to(torch.bfloat16)
        prod.put("real", x)
        real = _record(root, "real")
        outside = tmp_path / "outside.shm"
        outside.write_bytes(b"EPDSHMA1" + bytes(1 << 16))
        os.symlink(outside, os.path.join(ns_dir(root), "arena-1-00000000.shm"))
        hostile = {
            "other item": dict(item_id="real"),
            "other model": dict(scope=f"{NS}#another-model"),
            "arena outside": dict(arena="../../" + outside.name),
            "symlinked arena": dict(arena="arena-1-00000000.shm"),
            "offset past the end": dict(offset=1 << 40),
            "unaligned offset": dict(offset=real.offset + 8),
            "size past the end": dict(nbytes=(1 << 40), shape=(1 << 39,)),
            "shape not its size": dict(shape=(65, 512)),
            "negative shape": dict(shape=(-64, -512)),
            "tiny chunks": dict(chunk=1),
            "other digest": dict(algo="blake3"),
            "bad dtype": dict(dtype="pickle"),
        }
        for n, (what, change) in enumerate(hostile.items()):
            item_id = f"hostile-{n}"
            fields = {f: getattr(real, f) for f in real.__struct_fields__}
            fields.update({"key": item_key(item_id), "item_id": item_id, **change})
            _plant(root, item_id, Record(**fields))
            before = cons.events.corrupt + cons.events.missing
            assert cons.get(item_id, soon(0.2)) is None, what
            assert cons.events.corrupt + cons.events.missing == before + 1, what
        assert outside.read_bytes()[8:16] == bytes(8)  # nothing there was touched
        # a loose record (another user could have written it) and a symlinked one
        fields = {f: getattr(real, f) for f in real.__struct_fields__}
        _plant(root, "loose", Record(**{**fields, "item_id": "loose",
                                        "key": item_key("loose")}), mode=0o644)
        os.symlink(os.path.join(ns_dir(root), item_key("real") + ".item"),
                   os.path.join(ns_dir(root), item_key("linked") + ".item"))
        for item_id in ("loose", "linked"):
            assert cons.get(item_id, soon(0.2)) is None
        with open(os.path.join(ns_dir(root), item_key("junk") + ".item"), "wb") as f:
            f.write(RECORD_MAGIC + b"\xff" * 100)
        os.chmod(os.path.join(ns_dir(root), item_key("junk") + ".item"), 0o600)
        assert cons.get("junk", soon(0.2)) is None
        assert torch.equal(cons.get("real", soon()), x)  # the genuine one still loads
    finally:
        prod.close()
        cons.close()


def test_directory_and_files_are_private(root):
    os.makedirs(root, mode=0o755)
    os.chmod(root, 0o755)  # made by someone with a loose umask: tightened
    prod = make(root, PRODUCER)
    try:
        prod.put("img", torch.ones(4, 4))
        assert os.stat(root).st_mode & 0o777 == 0o700
        assert os.stat(ns_dir(root)).st_mode & 0o777 == 0o700
        for name in os.listdir(ns_dir(root)):
            assert os.stat(os.path.join(ns_dir(root), name)).st_mode & 0o777 == 0o600, name
    finally:
        prod.close()
    link = root + "-link"
    os.symlink(root, link)
    try:
        with pytest.raises(ShmError, match="symlink"):
            make(link, PRODUCER)
    finally:
        os.unlink(link)
    if os.getuid() == 0:  # a directory of another user is refused
        os.chown(root, 4321, 4321)
        with pytest.raises(ShmError, match="belongs to uid 4321"):
            make(root, PRODUCER)


# -- budget, leases, eviction ------------------------------------------------------------------
def test_a_yielded_lease_frees_its_block_and_is_a_consumer_miss(root):
    """Which lease yields is the lease book's (test_leases.py); here: the arena wires its
    config in, frees the block, removes the record, and counts the eviction."""
    item = torch.zeros(3 * MiB // 2, dtype=torch.bfloat16)  # 3 MiB; the arena holds two
    prod = make(root, PRODUCER, shm_arena_bytes=7 * MiB, shm_lease_ttl_s=60,
                shm_lease_min_s=0.3, shm_put_timeout_s=0.1)
    cons = make(root, CONSUMER)
    try:
        prod.put("a", item)
        prod.put("b", item)
        time.sleep(0.3)
        prod.renew("a")  # promised again: "b" is now the oldest promise
        prod.put("c", item)  # 60 s leases, but "b" was promised over lease_min_s ago
        assert prod.arena.leases_yielded == 1 and prod.events.evictions == 1
        assert cons.get("b", soon(0.1)) is None  # a miss: its consumer encodes it
        assert cons.get("a", soon()) is not None and cons.get("c", soon()) is not None
    finally:
        prod.close()
        cons.close()


def test_budget_eviction_leases_and_pins(root):
    item = torch.zeros(3 * MiB // 2, dtype=torch.bfloat16)  # 3 MiB; the arena holds two
    prod = make(root, PRODUCER, shm_arena_bytes=7 * MiB, shm_lease_ttl_s=0.3,
                shm_put_timeout_s=0.2)
    cons = make(root, CONSUMER)
    try:
        prod.put("a", item)
        prod.put("b", item)
        with pytest.raises(ArenaFull, match="still leased"):  # backpressure, then a clear error
            prod.put("c", item)
        time.sleep(0.35)
        prod.renew("a")  # promised again: "b" is the one to go
        prod.put("c", item)
        assert prod.events.evictions == 1 and cons.get("b", soon(0.1)) is None
        assert cons.get("a", soon()) is not None and cons.get("c", soon()) is not None
        assert sorted(cons.list_keys()) == sorted([item_key("a"), item_key("c")])
        time.sleep(0.35)
        # a consumer in the middle of reading "a" pins it: "c" goes instead
        rec = _record(root, "a")
        fd = os.open(os.path.join(ns_dir(root), rec.arena), os.O_RDONLY)
        try:
            assert range_lock(fd, fcntl.F_RDLCK, rec.offset, BLOCK_HEADER + rec.nbytes)
            prod.put("d", item)
            assert cons.exists("a") and not cons.exists("c")
        finally:
            os.close(fd)
        with pytest.raises(ArenaFull, match="exceeds the whole arena"):
            prod.put("huge", torch.zeros(8 * MiB, dtype=torch.uint8))
        assert prod.health()["items"] == 2
    finally:
        prod.close()
        cons.close()
    assert os.listdir(ns_dir(root)) == []  # a closed producer leaves nothing behind


def test_watch_reports_puts_and_evictions(root):
    prod = make(root, PRODUCER, shm_arena_bytes=4 * MiB, shm_lease_ttl_s=0.01)
    sched = make(root, SCHEDULER)
    watch = sched.watch_keys()
    try:
        prod.put("a", torch.zeros(MiB, dtype=torch.uint8))
        added, _, _ = watch.read(1.0)
        assert added == [item_key("a")]
        time.sleep(0.02)
        prod.put("b", torch.zeros(3 * MiB, dtype=torch.uint8))  # evicts "a"
        seen: tuple[set, set] = (set(), set())

        def both() -> bool:
            a, r, _ = watch.read(0.1)
            seen[0].update(a)
            seen[1].update(r)
            return item_key("a") in seen[1] and item_key("b") in seen[0]

        assert wait_for(both, timeout=2)
    finally:
        watch.close()
        prod.close()
        sched.close()


def test_a_consumer_unmaps_an_arena_once_it_is_gone(root):
    prod, cons = make(root, PRODUCER), make(root, CONSUMER)
    try:
        prod.put("a", torch.ones(256, 256))
        y = cons.get("a", soon())
        assert y is not None and cons.health()["mapped_arenas"] == 1
        prod.close()
        cons.reap()  # y is the producer's block in place: its mapping stays while y lives
        assert cons.health()["mapped_arenas"] == 1
        assert torch.equal(y, torch.ones(256, 256))
        assert cons.get("a", soon(0.1)) is None
        del y
        cons.reap()
        assert cons.health()["mapped_arenas"] == 0
    finally:
        cons.close()


# -- in place: the producer's block, pinned while a tensor lives -----------------------------------
def _evictable(root: str, item_id: str) -> bool:
    """Whether the producer could evict the item's block now (its write lock test)."""
    rec = _record(root, item_id)
    fd = os.open(os.path.join(ns_dir(root), rec.arena), os.O_RDWR)
    try:
        ok = range_lock(fd, fcntl.F_WRLCK, rec.offset, BLOCK_HEADER + rec.nbytes)
        if ok:
            range_lock(fd, fcntl.F_UNLCK, rec.offset, BLOCK_HEADER + rec.nbytes)
        return ok
    finally:
        os.close(fd)


def test_a_loaded_item_is_the_producers_block_pinned_while_its_tensor_lives(root):
    prod, cons = make(root, PRODUCER), make(root, CONSUMER)
    try:
        x = torch.randn(512, 1024).to(torch.bfloat16)  # 1 MiB
        prod.put("a", x)
        y = cons.get("a", soon())
        assert torch.equal(y, x) and cons.health().get("pool_used_bytes", 0) == 0  # no copy
        rec = _record(root, "a")
        assert y.data_ptr() == cons.maps.acquire(rec.arena).addr + rec.offset + BLOCK_HEADER
        cons.maps.release(cons.maps.acquire(rec.arena))
        cons.maps.release(cons.maps.acquire(rec.arena))
        rows = y[100:200]  # what vLLM's gather keeps: a slice, the whole gone
        del y
        assert not _evictable(root, "a") and not prod.delete("a")  # pinned by the slice
        again = cons.get("a", soon())  # a second reader of the same block: counted
        del rows
        assert not _evictable(root, "a")
        del again
        assert _evictable(root, "a") and prod.delete("a")  # the last tensor let go
    finally:
        prod.close()
        cons.close()


def test_a_block_is_never_reused_under_a_live_tensor(root):
    item = (torch.arange(3 * MiB // 2) % 251).to(torch.bfloat16)  # 3 MiB, no NaN
    prod = make(root, PRODUCER, shm_arena_bytes=7 * MiB, shm_lease_ttl_s=0.01,
                shm_lease_min_s=0.01, shm_put_timeout_s=0.2)
    cons = make(root, CONSUMER)
    try:
        prod.put("a", item)
        held = cons.get("a", soon())  # in place: at most half the arena is pinned
        assert held is not None and cons.health().get("pool_used_bytes", 0) == 0
        for i in range(4):  # every later put takes the other block, never "a"'s
            time.sleep(0.02)
            prod.put(f"b{i}", torch.full((3 * MiB // 2,), i, dtype=torch.bfloat16))
            assert cons.exists("a") and torch.equal(held, item)
        second = cons.get("b3", soon())  # over half the arena: copied, "b3" not pinned
        assert second is not None and cons.health()["pool_used_bytes"] > 0
        time.sleep(0.02)
        prod.put("c", item)  # evicts "b3", whose copy the consumer holds
        assert torch.equal(second, torch.full((3 * MiB // 2,), 3, dtype=torch.bfloat16))
        assert torch.equal(held, item)
        del held
        time.sleep(0.02)
        prod.put("d", item)
        prod.put("e", item)  # "a" is evictable now: both blocks were reused
        assert not cons.exists("a")
    finally:
        prod.close()
        cons.close()


def test_a_view_outlives_its_killed_producer(root, peers):
    prod = peers.start(PRODUCER, **conf(root))
    shape = [1024, 4096]  # 8 MiB
    put(prod, "img", 9, shape)
    cons = make(root, CONSUMER)
    try:
        y = cons.get("img", soon())
        os.killpg(prod.proc.pid, signal.SIGKILL)
        prod.proc.wait(10)
        other = make(root, CONSUMER)  # another worker starts and sweeps the dead arena
        other.close()
        assert not any(n.endswith(".shm") for n in os.listdir(ns_dir(root)))
        cons.reap()
        assert cons.health()["mapped_arenas"] == 1  # still mapped under y
        from ec_connectors.transports.base import checksum, tensor_bytes

        assert checksum(tensor_bytes(y)) == expected(9, shape)  # the bytes stay whole
        assert cons.get("img", soon(0.1)) is None  # the record went with the arena
        del y
        cons.reap()
        assert cons.health()["mapped_arenas"] == 0  # unmapped: the memory is free
    finally:
        cons.close()


def test_a_view_outlives_its_consumers_close(root):
    prod, cons = make(root, PRODUCER), make(root, CONSUMER)
    try:
        x = torch.randn(256, 1024)
        prod.put("a", x)
        y = cons.get("a", soon())
        cons.close()  # vLLM may still hold the tensor at shutdown: not unmapped under it
        assert torch.equal(y, x) and not _evictable(root, "a")
        del y
        assert _evictable(root, "a")
    finally:
        prod.close()


def test_a_sealed_read_checks_the_seal_not_the_bytes(root, tmp_path):
    a, b = secret(tmp_path, "a"), secret(tmp_path, "b")
    prod = make(root, PRODUCER, secret_file=a)
    sealed = make(root, CONSUMER, secret_file=a)  # the default: shm_read_verify "seal"
    foreign = make(root, CONSUMER, secret_file=b)
    full = make(root, CONSUMER, secret_file=a, shm_read_verify="bytes")
    try:
        x = torch.randn(256, 1024)
        prod.put("a", x)
        assert torch.equal(sealed.get("a", soon()), x)
        assert foreign.get("a", soon()) is None and foreign.events.corrupt == 1
        rec = _record(root, "a")
        _plant(root, "a", Record(**{**{f: getattr(rec, f) for f in rec.__struct_fields__},
                                   "offset": rec.offset + 4096}))
        assert sealed.get("a", soon()) is None  # the seal binds the block: moved, refused
        _plant(root, "a", rec)
        with open(os.path.join(ns_dir(root), rec.arena), "r+b") as f, \
                mmap.mmap(f.fileno(), 0) as mm:
            mm[rec.offset + BLOCK_HEADER + 7] ^= 0x01
        assert full.get("a", soon()) is None and full.events.corrupt == 1  # bytes: a miss
        # seal: the reader trusts the producer's hash of the bytes it wrote (documented)
        assert sealed.get("a", soon()) is not None
    finally:
        for t in (prod, sealed, foreign, full):
            t.close()


def test_copy_threads_fit_the_cores_this_process_may_use(root):
    cons = make(root, CONSUMER, shm_copy_threads=64)
    try:
        assert cons.threads == len(os.sched_getaffinity(0))
    finally:
        cons.close()


# -- the copy ----------------------------------------------------------------------------------
def test_unhashed_items_are_checked_by_their_seal_and_refused_by_hashing_readers(
        root, tmp_path):
    a, b = secret(tmp_path, "a"), secret(tmp_path, "b")
    prod = make(root, PRODUCER, secret_file=a, shm_verify="none")
    reader = make(root, CONSUMER, secret_file=a, shm_verify="none")
    foreign = make(root, CONSUMER, secret_file=b, shm_verify="none")
    hashing = make(root, CONSUMER, secret_file=a)
    try:
        items = {"large": torch.randn(256, 1024),  # used in place (pinned view)
                 "small": torch.arange(100, dtype=torch.bfloat16),  # copied
                 "empty": torch.empty(0, 16)}
        got = {}
        for name, x in items.items():
            prod.put(name, x)
            got[name] = reader.get(name, soon())
            assert got[name] is not None and torch.equal(got[name], x), name
        assert not _evictable(root, "large")  # the producer's block, pinned: no copy
        assert foreign.get("large", soon()) is None and foreign.events.corrupt == 1
        # a reader that hashes bytes cannot verify an unhashed item: a counted miss
        assert hashing.get("large", soon()) is None and hashing.events.corrupt == 1
        rec = _record(root, "small")
        assert rec.algo == "none"
        _plant(root, "small", Record(**{**{f: getattr(rec, f) for f in rec.__struct_fields__},
                                       "offset": rec.offset + 4096}))
        assert reader.get("small", soon()) is None  # moved: the seal binds the block
    finally:
        for t in (prod, reader, foreign, hashing):
            t.close()


@pytest.mark.parametrize("algo", ["xxh3", "blake3"])
def test_copy_and_hash_agree_for_any_thread_count(algo):
    from concurrent.futures import ThreadPoolExecutor

    n = 5 * MiB + 12345  # not a multiple of the chunk
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    digest = Digest(algo, os.urandom(32))
    results = []
    with ThreadPoolExecutor(3) as pool:
        for threads in (1, 2, 4):
            dst = torch.empty(n, dtype=torch.uint8)
            parts = copy_and_hash(dst.data_ptr(), memoryview(dst.numpy()), src.data_ptr(), n,
                                  MiB, digest, pool, threads)
            assert torch.equal(dst, src)
            results.append(digest.final("id", MiB, parts))
    assert len(set(results)) == 1
    assert Digest(algo, os.urandom(32)).final("id", MiB, parts) != results[0]  # keyed


def test_an_unhashed_copy_copies_every_byte_and_hashes_none():
    from concurrent.futures import ThreadPoolExecutor

    n = 3 * MiB + 77
    src = torch.randint(0, 256, (n,), dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    with ThreadPoolExecutor(1) as pool:
        parts = copy_and_hash(dst.data_ptr(), memoryview(dst.numpy()), src.data_ptr(), n,
                              MiB, Digest("none", None), pool, 2)
    assert torch.equal(dst, src) and parts == []


@pytest.mark.parametrize("what", ["memmove", "xxh3", "blake3"])
def test_copy_and_hash_release_the_gil(what):
    """With forced switches off, this thread runs while the other is inside one call only if
    that call released the GIL."""
    import ctypes

    n = 64 * MiB
    a, b = torch.randint(0, 256, (n,), dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    view = memoryview(a.numpy())
    call = {"memmove": lambda: ctypes.memmove(b.data_ptr(), a.data_ptr(), n),
            "xxh3": lambda: Digest("xxh3", None).chunk(view),
            "blake3": lambda: Digest("blake3", None).chunk(view)}[what]
    inside, done = threading.Event(), threading.Event()

    def run() -> None:
        inside.set()
        call()
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.5)  # longer than the call: no forced switch inside it
    try:
        t = threading.Thread(target=run)
        t.start()
        inside.wait()
        spins = 0
        while not done.is_set():
            spins += 1
        t.join()
    finally:
        sys.setswitchinterval(old)
    # holding the GIL, the call would leave this loop 0 or 1 turns; released, it runs
    # tens of thousands (over 100 even when the machine is busy and deschedules it)
    assert spins > 100, spins
