"""The serving side of the Mooncake Transfer Engine transport (mooncake_te/producer.py: the
PullServer, the ProducerStore's budget and leases, the Announcer) with real processes over TCP
loopback: each peer a `peer_process` running a real TransferEngine and registered pool."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import zmq

from ec_connectors.config import EPDConfig
from ec_connectors.transports import Placement
from ec_connectors.transports.mooncake_te.catalog import MooncakeCatalog
from tests.ec_connectors.transports import forked_peers
from tests.ec_connectors.transports.mooncake_te_helpers import (
    CONSUMER,
    PRODUCER,
    MiB,
    base_ports,
    health,
    mc_config,
)
from tests.helpers import expected, wait_for

pytest.importorskip("mooncake.engine")
peers = forked_peers.fixture()  # peers forked warm, killed after the test
_ports = base_ports(__name__)


def test_one_producer_two_consumers_same_48mb_item(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = [peers.start(CONSUMER, **mc_config(base)) for _ in range(2)]
    shape = [6144, 4096]  # 48 MiB of bf16
    put = prod.call({"op": "put", "id": "img-48", "seed": 7, "shape": shape,
                     "dtype": "bfloat16"})
    assert put["nbytes"] == 48 * MiB and put["checksum"] == expected(7, shape)
    endpoint = prod.info["endpoint"]
    assert put["location"] == endpoint == f"127.0.0.1:{base}"
    # Both consumers at once, then again: no delete-on-first-pull.
    for sized in (False, True):  # size unknown (asks first), then known from params
        for c in cons:
            c.send({"op": "get", "id": "img-48", "timeout_s": 20, "location": endpoint,
                    "nbytes": put["nbytes"] if sized else 0})
        for c in cons:
            got = c.result(30)
            assert got["found"], got
            assert got["checksum"] == put["checksum"]
            assert got["shape"] == shape and got["dtype"] == "bfloat16"
    assert health(prod)["held_items"] == 1
    for c in cons:
        h = health(c)
        assert h["pool_used_bytes"] == 0  # received tensors were dropped: blocks are back
        assert h["inline"] == 0


def test_close_tears_everything_down_and_frees_the_ports(peers):
    base = next(_ports)
    first = peers.start(PRODUCER, **mc_config(base))
    first.call({"op": "put", "id": "c", "seed": 1, "shape": [1024, 1024], "dtype": "bfloat16"})
    t0 = time.monotonic()
    first.close()
    assert first.proc.returncode == 0 and time.monotonic() - t0 < 10
    # Listener, announcer and engine are gone: a new producer binds the same ports at once.
    second = peers.start(PRODUCER, **mc_config(base))
    assert second.info["endpoint"] == f"127.0.0.1:{base}"


def test_catalog_learns_items_from_announcements_and_forgets_a_dead_producer(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base, announce_interval_s=0.3))
    cfg = EPDConfig.from_dict(mc_config(base, producers=[f"127.0.0.1:{base}"],
                                        announce_interval_s=0.3, namespace="default"))
    foreign = MooncakeCatalog(cfg.model_copy(update={"namespace": "another-model"}),
                              Placement(role="scheduler", is_producer=False))
    catalog = MooncakeCatalog(cfg, Placement(role="scheduler", is_producer=False))
    try:
        put = prod.call({"op": "put", "id": "a1", "seed": 3, "shape": [300, 1024],
                         "dtype": "bfloat16"})
        from ec_connectors.protocol.keys import item_key

        key = item_key("a1")
        assert wait_for(lambda: catalog.locate(key) is not None, timeout=5)
        assert catalog.locate(key) == (f"127.0.0.1:{base}", put["nbytes"])
        assert key in set(catalog.list_keys())
        assert foreign.locate(key) is None and not list(foreign.list_keys())
        os.killpg(prod.proc.pid, signal.SIGKILL)
        assert wait_for(lambda: catalog.locate(key) is None, timeout=5)
    finally:
        catalog.close()
        foreign.close()


def test_producer_pool_budget_leases_eviction_and_backpressure(peers):
    base = next(_ports)
    # 8 MiB pool, 3 MiB items: two fit. Leases last 1.5 s; a save waits at most 0.5 s.
    prod = peers.start(PRODUCER, **mc_config(base, memory_pool_bytes=8 * MiB,
                                               lease_ttl_s=1.5, save_queue_timeout_s=0.5))
    cons = peers.start(CONSUMER, **mc_config(base))
    endpoint = prod.info["endpoint"]
    shape = [1536, 1024]  # 3 MiB bf16
    prod.call({"op": "put", "id": "e1", "seed": 1, "shape": shape, "dtype": "bfloat16"})
    prod.call({"op": "put", "id": "e2", "seed": 2, "shape": shape, "dtype": "bfloat16"})
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="producer pool full.*leased"):
        prod.call({"op": "put", "id": "e3", "seed": 3, "shape": shape, "dtype": "bfloat16"})
    assert 0.4 < time.monotonic() - t0 < 3  # backpressure: waited, then a clear error
    # Both promised items are intact and pullable by anyone while leased.
    for seed, item in ((1, "e1"), (2, "e2")):
        got = cons.call({"op": "get", "id": item, "timeout_s": 5, "location": endpoint})
        assert got["checksum"] == expected(seed, shape)
    time.sleep(1.0)
    # e1 is promised again (the same id saved again renews its lease, stores nothing)
    prod.call({"op": "put", "id": "e1", "seed": 1, "shape": shape, "dtype": "bfloat16"})
    assert cons.call({"op": "get", "id": "e2", "timeout_s": 5, "location": endpoint})["found"]
    time.sleep(0.6)  # e2 is now the most recently used, but only e1 holds a lease:
    # the lease, not recency, decides: e2 makes room
    prod.call({"op": "put", "id": "e3", "seed": 3, "shape": shape, "dtype": "bfloat16"})
    ph = prod.call({"op": "health"})
    assert ph["health"]["held_items"] == 2 and ph["events"]["evictions"] == 1
    t0 = time.monotonic()
    gone = cons.call({"op": "get", "id": "e2", "timeout_s": 5, "location": endpoint})
    assert not gone["found"] and time.monotonic() - t0 < 2  # evicted: fails fast
    assert health(cons)["evicted"] == 1
    for seed, item in ((1, "e1"), (3, "e3")):
        got = cons.call({"op": "get", "id": item, "timeout_s": 5, "location": endpoint})
        assert got["checksum"] == expected(seed, shape)


def test_producer_store_keeps_pinned_items_and_remembers_evicted_ones():
    """Which lease yields is the lease book's (test_leases.py); here: the store's own part,
    pins (a pull reading an item keeps it), freed buffers, and `absent` after an eviction."""
    from ec_connectors.protocol.stored import ItemInfo
    from ec_connectors.transports.memory import MemoryPool, PoolExhausted
    from ec_connectors.transports.peer_pull.producer_store import ProducerStore

    pool = MemoryPool(8 * MiB)
    store = ProducerStore(pool, lease_ttl_s=60, lease_min_s=0.01)  # every lease yields soon

    def save(name: str, timeout_s: float = 0.1) -> None:
        buf, _ = store.reserve(3 * MiB, time.monotonic() + timeout_s)
        store.add(ItemInfo(item_id=name, key=name, shape=(3 * MiB,), dtype="uint8",
                           nbytes=3 * MiB, checksum=""), buf)

    save("a")
    save("b")
    time.sleep(0.02)
    held_a = store.pin("a")  # promised first, but a pull is reading it
    save("c")
    assert store.absent("b") == "evicted" and store.leases_yielded == 1
    held_c = store.pin("c")
    with pytest.raises(PoolExhausted, match="producer pool full.*still leased"):
        save("d", timeout_s=0.05)  # everything is pinned
    store.unpin(held_a)
    save("d")
    assert held_a.buf.released and store.absent("a") == "evicted"
    assert store.get("c") is held_c and not held_c.buf.released
    assert store.catalog() == (["c", "d"], [3 * MiB, 3 * MiB])
    assert pool.used_bytes == 6 * MiB
    store.unpin(held_c)
    store.clear()
    assert pool.used_bytes == 0


def test_producer_store_keeps_the_first_copy_when_two_saves_of_one_key_race():
    """Both saves found the key absent and reserved a block: the second block is freed, the
    first copy (a pull may be reading it) stays, and both saves answer with it."""
    from ec_connectors.protocol.stored import ItemInfo
    from ec_connectors.transports.memory import MemoryPool
    from ec_connectors.transports.peer_pull.producer_store import ProducerStore

    pool = MemoryPool(8 * MiB)
    store = ProducerStore(pool, lease_ttl_s=60)
    first, _ = store.reserve(MiB, time.monotonic() + 0.1)
    second, _ = store.reserve(MiB, time.monotonic() + 0.1)
    infos = [ItemInfo(item_id="k", key="k", shape=(MiB,), dtype="uint8", nbytes=MiB,
                      checksum=c) for c in ("one", "two")]
    assert store.add(infos[0], first) is infos[0]
    assert store.add(infos[1], second) is infos[0]
    assert second.released and not first.released
    assert store.get("k").buf is first and pool.used_bytes == MiB
    store.clear()
    assert pool.used_bytes == 0


def test_garbled_control_messages_are_dropped_and_service_goes_on(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    put = prod.call({"op": "put", "id": "g", "seed": 5, "shape": [1024, 1024],
                     "dtype": "bfloat16"})
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{base}")
    garbage = [b"\x00\xffnot msgpack", b"", b"\x82\xa4type\xa4Pull\xa3key\x05",
               b"\xc1" * 1000, os.urandom(4096)]
    for frame in garbage:
        sock.send(frame)
    # A well-formed pull with a forged session must be refused, not attempted.
    from ec_connectors.channel import encode
    from ec_connectors.transports.mooncake_te import messages
    from ec_connectors.transports.peer_pull.messages import Pull, PullFailed

    sock.send(encode(Pull(pull_id=1, key="x", session="not an endpoint",
                                  dst_addr=0, capacity=0)))
    assert sock.poll(5000)
    reply = messages.decode_peer(sock.recv())
    assert isinstance(reply, PullFailed) and reply.code == "bad_request"
    sock.close()
    got = cons.call({"op": "get", "id": "g", "timeout_s": 5, "location": prod.info["endpoint"]})
    assert got["found"] and got["checksum"] == put["checksum"]


def test_a_pull_past_its_deadline_is_dropped_and_frees_the_consumers_buffer(peers):
    """One serve thread busy with a large transfer; a second consumer's pull with a short
    deadline waits behind it and is answered `expired` (never written): the consumer's
    buffer is free again at once instead of quarantined for minutes. (The engine path's serve
    queue: on the socket path each data connection's pulls are served by its own thread.)"""
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base, serve_threads=1, te_data_path="engine",
                                            transfer_chunk_bytes=4 * MiB))
    big, small = [peers.start(CONSUMER, **mc_config(base, te_data_path="engine"))
                  for _ in range(2)]
    shape = [12288, 4096]  # 96 MiB: keeps the one serve thread busy for a while
    put = prod.call({"op": "put", "id": "big", "seed": 5, "shape": shape, "dtype": "bfloat16"})
    prod.call({"op": "put", "id": "mid", "seed": 6, "shape": [1024, 1024],
               "dtype": "bfloat16"})  # 2 MiB: beyond the inline limit
    endpoint = put["location"]
    big.send({"op": "get", "id": "big", "timeout_s": 30, "location": endpoint,
              "nbytes": put["nbytes"]})
    time.sleep(0.02)
    got = small.call({"op": "get", "id": "mid", "timeout_s": 0.02, "location": endpoint,
                      "nbytes": 2 * MiB})
    assert not got["found"]
    assert big.result(60)["found"]
    assert wait_for(lambda: health(prod)["expired"] >= 1, 10, 0.05)
    assert wait_for(lambda: health(small)["quarantined"] == 0, 10, 0.05)
    assert health(small)["pool_used_bytes"] == 0


def test_a_failed_save_is_answered_so_the_consumer_stops_waiting(peers):
    """Asked where it should be: unknown there (no save of it queued: a stale hint, a
    restarted producer) and failed are misses at once; pending (its save is queued) is
    waited for, until it lands."""
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    endpoint = prod.info["endpoint"]
    t0 = time.monotonic()
    got = cons.call({"op": "get", "id": "never", "timeout_s": 5.0, "location": endpoint})
    assert not got["found"] and time.monotonic() - t0 < 1.0  # unknown: no 5 s wait
    prod.call({"op": "expect", "id": "queued"})
    t0 = time.monotonic()
    got = cons.call({"op": "get", "id": "queued", "timeout_s": 1.0, "location": endpoint})
    assert not got["found"] and time.monotonic() - t0 >= 0.9  # pending: waited it out
    cons.send({"op": "get", "id": "queued", "timeout_s": 10.0, "location": endpoint})
    time.sleep(0.3)
    prod.call({"op": "put", "id": "queued", "seed": 3, "shape": [64, 64], "dtype": "bfloat16"})
    assert cons.result(15)["found"]  # landed while the consumer waited
    prod.call({"op": "save_failed", "id": "gone"})
    t0 = time.monotonic()
    got = cons.call({"op": "get", "id": "gone", "timeout_s": 5.0, "location": endpoint})
    assert not got["found"] and time.monotonic() - t0 < 1.0  # told: no 5 s wait
    prod.call({"op": "put", "id": "gone", "seed": 2, "shape": [64, 64], "dtype": "bfloat16"})
    assert cons.call({"op": "get", "id": "gone", "timeout_s": 5.0,
                      "location": endpoint})["found"]  # stored later: served again


def test_port_scheme_and_host_detection():
    from ec_connectors.protocol.ports import PURPOSE_ANNOUNCE, PURPOSE_SERVE, port_for
    from epd_common.net import resolve_host

    # dp 0..1 x tp 0..3 on one node: eight distinct ports per purpose, no cross-purpose clash
    serve = {port_for(15500, PURPOSE_SERVE, 0, dp, 4, tp) for dp in range(2) for tp in range(4)}
    announce = {port_for(15500, PURPOSE_ANNOUNCE, 0, dp, 4, tp) for dp in range(2)
                for tp in range(4)}
    assert len(serve) == 8 and len(announce) == 8 and not serve & announce
    assert port_for(15500, PURPOSE_SERVE, 100, 1, 4, 2) == 15500 + 100 + 4 + 2
    with pytest.raises(ValueError):
        port_for(15500, PURPOSE_SERVE, 999, 1, 4, 2)
    host = resolve_host("auto")
    socket.inet_aton(host)  # an IPv4 address, whatever the machine
    assert resolve_host("10.1.2.3") == "10.1.2.3"


def test_config_rejects_bad_producers_and_unknown_keys():
    from ec_connectors.config import ConfigError

    with pytest.raises(ConfigError, match="producers"):
        EPDConfig.from_dict({"transport": "mooncake", "producers": ["no-port"]})
    with pytest.raises(ConfigError, match="Known keys"):
        EPDConfig.from_dict({"transport": "mooncake", "mooncake_protocol": "tcp"})
    cfg = EPDConfig.from_dict({"transport": "mooncake", "producers": ["10.0.0.5:15500"]})
    assert cfg.protocol == "tcp" and cfg.memory_pool_device == "cpu"


class _ScriptedEngine:
    """transfer_submit_write / transfer_check_status with chunk writes that land after a few
    checks (or fail: `fail_at` chunk index), recording what is in flight."""

    def __init__(self, fail_at: int = -1, checks: int = 3) -> None:
        self.fail_at, self.checks = fail_at, checks
        self.flying: dict[int, list[int]] = {}  # batch -> [checks left, chunk index]
        self.submitted = 0

    def transfer_submit_write(self, session, src, dst, n) -> int:
        self.submitted += 1
        self.flying[self.submitted] = [self.checks, self.submitted - 1]
        return self.submitted

    def transfer_check_status(self, batch) -> int:
        left = self.flying[batch]
        left[0] -= 1
        if left[0] > 0:
            return 0
        del self.flying[batch]
        return -1 if left[1] == self.fail_at else 1


def _bare_server(engine, chunk: int):
    """The engine path's writes with a side channel that only records its replies."""
    from ec_connectors.transports.mooncake_te.engine import EnginePath
    from ec_connectors.transports.peer_pull.data_path import PullCounters
    from ec_connectors.transports.peer_pull.server import PullServer

    server = PullServer.__new__(PullServer)  # no sockets: only the writes are exercised
    server.counters, server.endpoint = PullCounters(), "127.0.0.1:2"
    server.config = EPDConfig.from_dict({"transport": "mooncake",
                                         "transfer_chunk_bytes": chunk})
    server.replies = []
    server.reply = lambda peer, msg, payload=None: server.replies.append(
        (msg, dict(engine.flying)))
    path = EnginePath.__new__(EnginePath)  # no engine started: the scripted one
    path.engine, path.config = engine, server.config
    return server, path


def _held(nbytes: int):
    from types import SimpleNamespace

    return SimpleNamespace(info=SimpleNamespace(nbytes=nbytes), buf=SimpleNamespace(addr=0))


@pytest.mark.parametrize("fail_at", [-1, 0])
def test_chunk_writes_report_in_order_and_reply_with_nothing_in_flight(fail_at):
    """Chunks are submitted two ahead and checked without spinning; Progress follows the
    order they land in; a failed chunk stops further submits, and the failure is answered
    only once every submitted chunk finished (none may still write into the buffer)."""
    from ec_connectors.transports.peer_pull import messages

    engine = _ScriptedEngine(fail_at=fail_at)
    server, path = _bare_server(engine, chunk=4 * MiB)
    pull = messages.Pull(pull_id=1, key="k", session="127.0.0.1:1", dst_addr=0,
                         capacity=10 * MiB, timeout_s=30)
    ok = path.write(server, pull, b"p", _held(10 * MiB), time.monotonic() + 30)
    assert engine.flying == {}
    if fail_at < 0:
        assert ok and engine.submitted == 3
        assert [m.done for m, _ in server.replies] == [4 * MiB, 8 * MiB]
    else:
        assert not ok and engine.submitted == 2  # the second was in flight; no third
        (msg, flying), = server.replies  # no Progress: the first chunk failed
        assert isinstance(msg, messages.PullFailed) and msg.code == "transfer"
        assert flying == {}  # answered once the second had landed too


def test_a_pull_that_expires_between_chunks_is_answered_expired_after_they_land():
    from ec_connectors.transports.peer_pull import messages

    engine = _ScriptedEngine()
    server, path = _bare_server(engine, chunk=4 * MiB)
    pull = messages.Pull(pull_id=1, key="k", session="127.0.0.1:1", dst_addr=0,
                         capacity=10 * MiB, timeout_s=30)
    assert not path.write(server, pull, b"p", _held(10 * MiB), time.monotonic() - 1)
    assert engine.submitted == 0 and server.counters.expired == 1
    (msg, flying), = server.replies
    assert isinstance(msg, messages.PullFailed) and msg.code == "expired"


def test_large_items_are_sent_from_where_they_lie():
    """On the socket path a large host item is held where it lies: the bytes sent are the
    tensor the producer was given (a byte changed in it is a miss), its pool block only
    counts it (eviction as for copies, which drops the tensor), and `copy` copies."""
    import torch

    from ec_connectors.transports import make_transport
    from ec_connectors.transports.peer_pull.producer_store import HeldInPlace

    base = next(_ports)
    cfg = mc_config(base, memory_pool_bytes=20 * MiB, lease_ttl_s=0.05, lease_min_s=0.05)
    prod = make_transport(EPDConfig.from_dict(cfg), Placement(is_consumer=False))
    cons = make_transport(EPDConfig.from_dict(cfg), Placement(is_producer=False))
    try:
        first = torch.randn(1 << 21)  # 8 MiB
        info = prod.put("a", first)
        held = prod.store.get(info.key).buf
        assert isinstance(held, HeldInPlace) and held.addr == first.data_ptr()
        assert torch.equal(cons.get("a", time.monotonic() + 10, location=prod.endpoint), first)
        first[5] += 1.0  # what is sent is the tensor itself: now it fails the checksum
        assert cons.get("a", time.monotonic() + 5, location=prod.endpoint) is None
        assert cons.events.corrupt == 1
        for i in range(3):  # two fit the pool: "a" is evicted, its tensor let go
            prod.put(f"b{i}", torch.randn(1 << 21))
        assert held.released and held.tensor is None and prod.events.evictions >= 2
        assert prod.events.held_in_place == 4 and prod.pool.used_bytes <= 16 * MiB
    finally:
        cons.close()
        prod.close()
    copying = make_transport(EPDConfig.from_dict({**cfg, "producer_put": "copy"}),
                             Placement(is_consumer=False))
    try:
        info = copying.put("c", torch.randn(1 << 21))
        assert not isinstance(copying.store.get(info.key).buf, HeldInPlace)
    finally:
        copying.close()
