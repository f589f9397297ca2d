"""The Mooncake Store transport and tiers with a real `mooncake_master` and real store clients
(each a `peer_process` subprocess) over TCP loopback."""

from __future__ import annotations

import os
import signal
import time

import pytest

from encoder_service.local.mooncake_master import MasterServer, master_server
from tests.ec_connectors.transports import forked_peers
from tests.helpers import MASTER, WORK, expected, free_port, port_block, wait_for

pytest.importorskip("mooncake.store")
peers = forked_peers.fixture()  # peers forked warm, killed after the test
MiB = 1 << 20
_ports = iter(port_block(__name__, MASTER)[::5])  # master: rpc, +1 metadata, +2 metrics
PRODUCER = {"is_producer": True, "is_consumer": False}
CONSUMER = {"is_producer": False, "is_consumer": True}
SCHEDULER = {"role": "scheduler", "is_producer": False, "is_consumer": True}


def _kill(m: MasterServer) -> None:
    """SIGKILL: nothing is asserted about a throwaway master's own shutdown."""
    if m.proc is not None and m.proc.poll() is None:
        os.killpg(m.proc.pid, signal.SIGKILL)
        m.proc.wait(10)
    m.stop()


@pytest.fixture(scope="module")
def spare_master():
    """The next test's master, booting while this one runs (a master takes ~1.1 s to serve)."""
    spare: list[MasterServer] = []

    def take() -> MasterServer:
        def start() -> MasterServer:
            port = free_port(_ports)
            return master_server(WORK / "test-store", port, name=f"mooncake-master-{port}"
                                 ).start()  # a log per master: two run at once

        m = spare.pop() if spare else start()
        spare.append(start())
        return m

    yield take
    for m in spare:
        _kill(m)


@pytest.fixture
def master(spare_master):
    """A fresh master of this test's own (its clients are killed with it: nothing carries
    over)."""
    m = spare_master()
    wait_for(m.healthy, timeout=10, interval=0.02)  # wait() polls every 0.5 s; this is
    m.wait()  # only its quick path (and its error, with the log, when the master fails)
    yield m
    _kill(m)


def store_config(m: MasterServer, **extra) -> dict:
    return {"transport": "mooncake_store", "host": "127.0.0.1", "store_master": m.address,
            "store_metadata": m.metadata_url, "store_segment_bytes": 256 * MiB,
            "store_buffer_bytes": 160 * MiB, "namespace": "llava-a",
            "embedding_dtype": "bfloat16", "store_health_interval_s": 0.5, **extra}


def put(peer, item_id: str, seed: int, shape: list[int]) -> dict:
    return peer.call({"op": "put", "id": item_id, "seed": seed, "shape": shape,
                      "dtype": "bfloat16"})


def get(peer, item_id: str, timeout_s: float = 5.0) -> dict:
    return peer.call({"op": "get", "id": item_id, "timeout_s": timeout_s})


def test_put_get_round_trip_sizes_bytes_verified(master, peers):
    prod = peers.start(PRODUCER, **store_config(master))
    cons = peers.start(CONSUMER, **store_config(master, store_segment_bytes=0))
    for seed, shape in ((1, [8, 64]), (2, [1024, 4096]), (3, [6144, 4096])):  # 1 KiB-48 MiB
        stored = put(prod, f"img-{seed}", seed, shape)
        assert stored["checksum"] == expected(seed, shape)
        got = get(cons, f"img-{seed}")
        assert got["found"] and got["shape"] == shape and got["dtype"] == "bfloat16"
        assert got["checksum"] == expected(seed, shape)
    # Nothing stays held in the consumer's registered buffer once the tensors are gone.
    assert cons.call({"op": "health"})["health"]["buffer_used_bytes"] == 0


def test_two_encoder_clients_share_one_item(master, peers):
    """Encoder A stores an item; encoder B (another instance) finds it through the scheduler's
    non-blocking probe and fetches it instead of encoding it again."""
    a = peers.start(PRODUCER, **store_config(master))
    b = peers.start(PRODUCER, **store_config(master))
    b_sched = peers.start(SCHEDULER, **store_config(master, store_probe_ttl_s=0.3))
    assert b_sched.call({"op": "probe", "id": "shared"})["found"] is False
    put(a, "shared", 11, [512, 4096])
    time.sleep(0.4)  # the "no" above is cached for store_probe_ttl_s; then asked again
    assert b_sched.call({"op": "probe", "id": "shared"})["found"] is True
    got = get(b, "shared")
    assert got["found"] and got["checksum"] == expected(11, [512, 4096])


def test_only_rank_zero_of_a_tensor_parallel_producer_writes(master, peers):
    rank1 = peers.start({**PRODUCER, "rank": 1, "world_size": 2}, **store_config(master))
    rank0 = peers.start({**PRODUCER, "rank": 0, "world_size": 2}, **store_config(master))
    put(rank1, "tp", 61, [64, 4096])
    assert rank1.call({"op": "probe", "id": "tp"})["exists"] is False
    put(rank0, "tp", 61, [64, 4096])
    assert rank1.call({"op": "probe", "id": "tp"})["exists"] is True


def test_namespaces_and_dtypes_never_share_items(master, peers):
    a = peers.start(PRODUCER, **store_config(master))
    other_model = peers.start(CONSUMER, **store_config(master, namespace="llava-b"))
    other_dtype = peers.start(CONSUMER, **store_config(master, embedding_dtype="float16"))
    same = peers.start(CONSUMER, **store_config(master))
    put(a, "uuid-reused", 21, [64, 4096])
    for peer in (other_model, other_dtype):
        assert peer.call({"op": "probe", "id": "uuid-reused"})["found"] is False
        assert not get(peer, "uuid-reused", timeout_s=0.3)["found"]
    assert get(same, "uuid-reused")["checksum"] == expected(21, [64, 4096])


def test_damaged_object_is_a_miss_never_wrong_data(master, peers):
    a = peers.start(PRODUCER, **store_config(master))
    cons = peers.start(CONSUMER, **store_config(master, store_segment_bytes=0))
    put(a, "img-bad", 31, [256, 4096])
    assert a.call({"op": "tamper", "id": "img-bad"})["tampered"]
    assert not get(cons, "img-bad", timeout_s=1)["found"]
    assert cons.call({"op": "health"})["events"]["corrupt"] == 1
    put(a, "img-bad", 31, [256, 4096])  # a newer put wins (upsert), and reads verify again
    assert get(cons, "img-bad")["checksum"] == expected(31, [256, 4096])


def test_eviction_under_a_small_segment_is_a_miss_not_corruption(master, peers):
    prod = peers.start(PRODUCER, **store_config(master, store_segment_bytes=64 * MiB,
                                                  store_retries=1))
    cons = peers.start(CONSUMER, **store_config(master, store_segment_bytes=0))
    shape = [1024, 4096]  # 8 MiB: 16 of them cannot all fit in 64 MiB
    stored = []
    for seed in range(16):
        try:
            put(prod, f"ev-{seed}", 100 + seed, shape)
            stored.append(seed)
        except RuntimeError as exc:  # a full segment refuses a put (-200) until it evicts
            assert "no space" in str(exc) or "-200" in str(exc)
    found = {}
    for seed in range(16):
        got = get(cons, f"ev-{seed}", timeout_s=0.5)
        if got["found"]:
            assert got["checksum"] == expected(100 + seed, shape)  # never another's bytes
            found[seed] = True
    assert found, "nothing survived"
    assert len(found) < 16, "nothing was evicted: the segment was not small enough"
    assert cons.call({"op": "health"})["events"]["corrupt"] == 0


def tiered_config(m: MasterServer, storage: str, **extra) -> dict:
    return store_config(m, transport=["mooncake_store", "safetensors"],
                        storage_path=storage, **extra)


def test_one_requests_items_in_one_batch_across_tiers(master, peers, tmp_path):
    """get_many: one batch_get_into for what the store has, the next tier for the rest."""
    storage = str(tmp_path / "shared")
    both = peers.start(PRODUCER, **tiered_config(master, storage))
    store_only = peers.start(PRODUCER, **store_config(master))
    dir_only = peers.start(PRODUCER, **{"transport": "safetensors", "storage_path": storage,
                                        "namespace": "llava-a"})
    cons = peers.start(CONSUMER, **tiered_config(master, storage, store_segment_bytes=0))
    put(both, "x", 51, [256, 4096])
    put(store_only, "y", 52, [128, 4096])
    put(dir_only, "z", 53, [64, 4096])
    got = cons.call({"op": "get_many", "ids": ["x", "y", "z", "w"], "timeout_s": 0.5})
    assert got["checksums"] == [expected(51, [256, 4096]), expected(52, [128, 4096]),
                                expected(53, [64, 4096]), None]
    counters = cons.call({"op": "health"})["health"]["counters"]
    assert counters["tier_mooncake_store_hits"] == 2
    assert counters["tier_mooncake_store_misses"] == 2
    assert counters["tier_safetensors_hits"] == 1
    assert counters["tier_safetensors_misses"] == 1


def test_master_killed_mid_run_other_tiers_answer(master, peers, tmp_path):
    storage = str(tmp_path / "shared")
    prod = peers.start(PRODUCER, **tiered_config(master, storage))
    cons = peers.start(CONSUMER, **tiered_config(master, storage, store_segment_bytes=0))
    put(prod, "before", 41, [512, 4096])
    put(prod, "small", 43, [16, 64])
    assert get(cons, "before")["checksum"] == expected(41, [512, 4096])
    counters = cons.call({"op": "health"})["health"]["counters"]
    assert counters["tier_mooncake_store_hits"] == 1
    # A scheduler's inline read keeps the tiers' order: the store comes first and only the
    # workers read it, so the directory (which has the item too) is not read around it.
    assert not cons.call({"op": "get_small", "id": "small"})["found"]
    master.proc.kill()
    t0 = time.monotonic()
    assert wait_for(lambda: not cons.call({"op": "health"})["health"]["tiers"][0]["ok"], 5,
                    interval=0.1), "the consumer did not notice the dead master"
    detected_s = time.monotonic() - t0
    assert detected_s < 3.0
    # Old and new items still load, through the shared directory, without waiting on the
    # dead master.
    got = get(cons, "before")
    assert got["found"] and got["checksum"] == expected(41, [512, 4096])
    assert got["get_s"] < 1.0
    put(prod, "after", 42, [512, 4096])
    got = get(cons, "after")
    assert got["found"] and got["checksum"] == expected(42, [512, 4096])
    # With the store down the directory is first: the inline read takes it, and counts.
    small = cons.call({"op": "get_small", "id": "small"})
    assert small["found"] and small["checksum"] == expected(43, [16, 64])
    health = cons.call({"op": "health"})["health"]
    assert health["counters"]["tier_safetensors_hits"] == 3
    assert health["counters"]["tier_mooncake_store_skipped"] >= 1
    assert prod.call({"op": "health"})["health"]["counters"][
        "tier_mooncake_store_put_failures"] == 1


def test_frozen_master_is_reported_down_then_up_again(master, peers):
    cons = peers.start(CONSUMER, **store_config(master, store_segment_bytes=0))
    os.kill(master.proc.pid, signal.SIGSTOP)
    try:
        assert wait_for(lambda: not cons.call({"op": "health"})["health"]["ok"], 5,
                        interval=0.1), "a frozen master was reported healthy"
        t0 = time.monotonic()
        assert not get(cons, "anything", timeout_s=5)["found"]
        assert time.monotonic() - t0 < 1.0  # a down tier misses at once
    finally:
        os.kill(master.proc.pid, signal.SIGCONT)
    assert wait_for(lambda: cons.call({"op": "health"})["health"]["ok"], 10, interval=0.1)


def test_unreachable_master_clear_error_bounded_and_tiers_start_without_it(peers, tmp_path):
    dead = {"store_master": "127.0.0.1:1", "store_metadata": "http://127.0.0.1:2/metadata"}
    base = {"transport": "mooncake_store", "host": "127.0.0.1", **dead}
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="not reachable"):
        peers.start(CONSUMER, **base)
    assert time.monotonic() - t0 < 15
    tiered = peers.start(CONSUMER, **{**base, "transport": ["mooncake_store", "safetensors"],
                                      "storage_path": str(tmp_path)})
    tiers = tiered.call({"op": "health"})["health"]["tiers"]
    assert [t["transport"] for t in tiers] == ["safetensors"]


def test_master_launcher_refuses_a_taken_port(master):
    with pytest.raises(RuntimeError, match="already in use"):
        master_server(WORK / "test-store", master.port).start()


def test_with_the_secret_a_planted_store_object_is_a_miss(master, peers, tmp_path):
    """Anyone who reaches the master can upsert a well-formed object under an item's key;
    consumers holding the deployment secret take only objects sealed with it."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"store-deployment-secret-0123456789")
    secret.chmod(0o600)
    sealed = store_config(master, secret_file=str(secret))
    prod = peers.start(PRODUCER, **sealed)
    cons = peers.start(CONSUMER, **{**sealed, "store_segment_bytes": 0})
    ours = put(prod, "img", 1, [64, 128])
    assert get(cons, "img")["checksum"] == ours["checksum"]
    intruder = peers.start(PRODUCER, **store_config(master))  # no secret, same master
    theirs = put(intruder, "img", 2, [64, 128])  # upsert: replaces ours under the same key
    assert theirs["checksum"] != ours["checksum"]
    assert get(intruder, "img")["checksum"] == theirs["checksum"]  # well-formed, unsealed
    got = cons.call({"op": "get", "id": "img", "timeout_s": 1.0})
    assert not got["found"]  # a miss (then a local encode), never the planted embedding
