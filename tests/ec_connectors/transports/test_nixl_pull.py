"""The NIXL transport (ec_connectors/transports/nixl_pull/): consumers READ items out of
producers' registered pools with real NIXL agents (UCX) in two processes, over loopback; a
producer that dies mid-transfer is a miss, a damaged or misplaced item is never handed over;
and the pieces a GPU host needs (VRAM registration) checked without one."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import traceback

import pytest
import torch

from ec_connectors.config import EPDConfig
from ec_connectors.transports import Placement, make_transport
from tests.ec_connectors.transports import forked_peers
from tests.ec_connectors.transports.mooncake_te_helpers import (
    CONSUMER,
    PRODUCER,
    MiB,
    base_ports,
    health,
)
from tests.helpers import expected, wait_for

pytest.importorskip("nixl._api", reason="transport 'nixl' needs NIXL: pip install --no-deps "
                                        "nixl nixl-cu12 (scripts/setup_env.py does)")
from ec_connectors.transports.nixl_pull import agent as nixl_agent  # noqa: E402
from ec_connectors.transports.nixl_pull import host as nixl_host  # noqa: E402
from ec_connectors.transports.nixl_pull import peers as nixl_peers  # noqa: E402
from ec_connectors.transports.nixl_pull import reads as nixl_reads  # noqa: E402
from ec_connectors.transports.nixl_pull.server import ReadPins, RegisteredInPlace  # noqa: E402

peers = forked_peers.fixture()
_ports = base_ports(__name__)


def nx_config(base_port: int, **extra) -> dict:
    return {"transport": "nixl", "host": "127.0.0.1", "base_port": base_port,
            "memory_pool_bytes": 160 * MiB, **extra}


def test_items_move_by_nixl_reads_and_pins_end_with_the_notification(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **nx_config(base))
    cons = peers.start(CONSUMER, **nx_config(base))
    endpoint = prod.info["endpoint"]
    big = [2048, 2048]  # 8 MiB: a NIXL read; the small one rides inline in the reply
    prod.call({"op": "put", "id": "big", "seed": 3, "shape": big, "dtype": "bfloat16"})
    prod.call({"op": "put", "id": "small", "seed": 4, "shape": [64, 64], "dtype": "bfloat16"})
    for _ in range(2):
        got = cons.call({"op": "get", "id": "big", "timeout_s": 10, "location": endpoint})
        assert got["found"] and got["checksum"] == expected(3, big)
    small = cons.call({"op": "get", "id": "small", "timeout_s": 5, "location": endpoint})
    assert small["found"] and small["checksum"] == expected(4, [64, 64])
    h = health(cons)
    assert (h["nixl_reads"], h["inline"], h["nixl_read_errors"]) == (2, 1, 0)
    # one kernel, host memory: each 8 MiB read went out in stripes, one per core's lane
    assert h["nixl_split_reads"] == (2 if len(os.sched_getaffinity(0)) > 1 else 0)
    assert h["transport"] == "nixl" and h["pool_used_bytes"] == 0
    # the reads' notifications (and the warming read's) dropped every pin at once
    assert wait_for(lambda: health(prod)["read_pins"] == 0, timeout=2), health(prod)
    miss = cons.call({"op": "get", "id": "never", "timeout_s": 5, "location": endpoint})
    assert not miss["found"]


def test_a_producer_killed_mid_transfer_is_a_miss(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **nx_config(base))
    cons = peers.start(CONSUMER, **nx_config(base))
    endpoint = prod.info["endpoint"]
    shape = [4096, 4096]  # 32 MiB
    prod.call({"op": "put", "id": "k", "seed": 9, "shape": shape, "dtype": "bfloat16"})
    t0 = time.monotonic()
    cons.send({"op": "get", "id": "k", "timeout_s": 4.0, "location": endpoint,
               "nbytes": 4096 * 4096 * 2})
    threading.Timer(0.01, os.killpg, (prod.proc.pid, signal.SIGKILL)).start()
    got = cons.result(30)
    assert time.monotonic() - t0 < 4.5
    if got["found"]:  # the read won the race: then it must be the right bytes
        assert got["checksum"] == expected(9, shape)
    again = cons.call({"op": "get", "id": "k", "timeout_s": 2.0, "location": endpoint})
    assert not again["found"]
    assert wait_for(lambda: health(cons)["pool_used_bytes"] == 0, timeout=5), health(cons)


def in_child(fn: str, *args) -> None:
    """Run `fn` of this module in a spawned process, its failure raised here.

    A process that made a NIXL agent segfaults at exit (NIXL 1.5.1's teardown, any agent): the
    test process must not make one. The child leaves with os._exit once it reported."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_child, args=(fn, args, q))
    child.start()
    try:
        outcome = q.get(timeout=60)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert outcome == "ok", outcome


def _child(fn: str, args: tuple, q) -> None:
    try:
        globals()[fn](*args)
        q.put("ok")
    except BaseException:  # noqa: BLE001 - reported to the test process
        q.put(traceback.format_exc())
    finally:
        q.close()
        q.join_thread()
        os._exit(0)


def test_damaged_or_misplaced_items_are_misses():
    """In one process: a byte changed in the producer's pool fails the checksum, and a reply
    that places the item outside the producer's registered range is refused unread."""
    in_child("_damaged_or_misplaced", next(_ports))


def _damaged_or_misplaced(base: int) -> None:
    cfg = EPDConfig.from_dict(nx_config(base, memory_pool_bytes=32 * MiB, producer_put="copy"))
    prod = make_transport(cfg, Placement(is_producer=True, is_consumer=False))
    cons = make_transport(cfg, Placement(is_producer=False, is_consumer=True))
    try:
        item = torch.arange(1 << 20, dtype=torch.int32)
        info = prod.put("x", item)
        got = cons.get("x", time.monotonic() + 10, location=prod.endpoint)
        assert got is not None and torch.equal(got, item)
        held = prod.store.get(info.key)
        held.buf.as_tensor(torch.uint8, (info.nbytes,))[100] ^= 0xFF
        assert cons.get("x", time.monotonic() + 5, location=prod.endpoint) is None
        assert cons.events.corrupt == 1
        held.buf.as_tensor(torch.uint8, (info.nbytes,))[100] ^= 0xFF
        link = cons.puller.link(prod.endpoint)
        link.peer = type(link.peer)(**{**{f: getattr(link.peer, f) for f in
                                          link.peer.__struct_fields__},
                                       "length": 4096})  # as if it registered less
        assert cons.get("x", time.monotonic() + 5, location=prod.endpoint) is None
        assert cons.health()["transfer_errors"] >= 1 and cons.health()["nixl_reads"] == 2
    finally:
        cons.close()
        prod.close()


def test_large_items_are_read_where_they_lie():
    """A large host item is registered where it lies and read from there: its bytes are the
    tensor the producer was given (a byte changed in it is a miss), its pool block only
    counts it, eviction ends its registration, and the consumer's view of the producer is
    rebuilt once it holds too many regions; a region must name its producer and carry no
    connection info."""
    in_child("_held_in_place", next(_ports))


def _held_in_place(base: int) -> None:
    nixl_peers.MAX_REMOTE_REGIONS = 2  # the consumer's view is rebuilt at every third region
    cfg = EPDConfig.from_dict(nx_config(base, memory_pool_bytes=20 * MiB, lease_ttl_s=0.05,
                                        lease_min_s=0.05))
    prod = make_transport(cfg, Placement(is_producer=True, is_consumer=False))
    cons = make_transport(cfg, Placement(is_producer=False, is_consumer=True))
    try:
        regions = []
        for i in range(5):  # 8 MiB each, two fit the pool: older ones are evicted
            item = torch.randn(1 << 21)
            info = prod.put(f"x{i}", item)
            held = prod.store.get(info.key)
            assert isinstance(held.buf, RegisteredInPlace) and held.buf.addr == item.data_ptr()
            assert prod.pool.used_bytes <= 16 * MiB
            regions.append(held.buf.region.metadata)
            got = cons.get(f"x{i}", time.monotonic() + 10, location=prod.endpoint)
            assert got is not None and torch.equal(got, item)
            del item, got, held
        assert prod.events.held_in_place == 5 and cons.agent.rebuilds >= 1
        assert prod.events.evictions >= 3 and len(prod.store) <= 2
        item = torch.randn(1 << 21)
        prod.put("d", item)
        item[77] += 1.0  # the producer serves the tensor's own memory: now it is damaged
        assert cons.get("d", time.monotonic() + 5, location=prod.endpoint) is None
        assert cons.events.corrupt == 1
        small = torch.randn(1 << 18)  # 1 MiB: copied into the pool
        info = prod.put("s", small)
        assert not isinstance(prod.store.get(info.key).buf, RegisteredInPlace)
        assert torch.equal(cons.get("s", time.monotonic() + 5, location=prod.endpoint), small)
        # a region that names another agent is refused before NIXL sees it: a miss, unread
        held = next(h for h in map(prod.store.get, prod.store.catalog()[0])
                    if isinstance(h.buf, RegisteredInPlace))
        held.buf.region = nixl_agent.Region(held.buf.region.reg, regions[0].replace(
            prod.agent.name.encode(), cons.agent.name.encode()))
        reads = cons.health()["nixl_reads"]
        assert cons.get(held.info.item_id, time.monotonic() + 5, location=prod.endpoint) is None
        assert cons.health()["nixl_reads"] == reads
        # a consumer of an older release loads no regions: served from the pool, copied once
        older = make_transport(cfg, Placement(is_producer=False, is_consumer=True))
        older.path.loads_regions = False
        try:
            assert not held.buf.copied
            got = older.get(held.info.item_id, time.monotonic() + 10, location=prod.endpoint)
            assert got is not None and held.buf.copied
            assert torch.equal(got.reshape(-1).view(torch.uint8),
                               held.buf.as_tensor(torch.uint8, (held.info.nbytes,)))
        finally:
            older.close()
        name = prod.agent.name
        assert all(nixl_peers.region_of(name, md) for md in regions)
        assert not nixl_peers.region_of(cons.agent.name, regions[0])
        assert not nixl_peers.region_of(name, prod.agent.metadata())  # connection info
        assert not nixl_peers.region_of(name, regions[0] + bytes(64 << 10))  # too large
    finally:
        cons.close()
        prod.close()


class _FakeAgent:
    def __init__(self) -> None:
        self.notes: list[bytes] = []
        self.calls: list[tuple] = []
        self.states: dict[str, str] = {}  # a transfer handle -> its NIXL state
        self.released: list[str] = []
        self._agent = self

    def notifications(self) -> list[bytes]:
        notes, self.notes = self.notes, []
        return notes

    def get_reg_descs(self, descs, mem):
        self.calls.append((descs, mem))
        return (descs, mem)

    def register_memory(self, descs):
        return descs

    def check_xfer_state(self, handle):
        return self.states[handle]

    def release_xfer_handle(self, handle):
        self.released.append(handle)


class _Store:
    def __init__(self) -> None:
        self.unpinned: list[object] = []

    def unpin(self, held) -> None:
        self.unpinned.append(held)


def test_read_pins_end_on_their_notification_or_their_deadline():
    agent, store = _FakeAgent(), _Store()
    pins = ReadPins(agent, store)
    try:
        token = pins.hold("a", time.monotonic() + 30)
        pins.hold("b", time.monotonic() + 0.05)
        agent.notes = [b"not a token", token]
        assert wait_for(lambda: len(pins) == 0, timeout=2)
        assert sorted(store.unpinned) == ["a", "b"] and (pins.done, pins.expired) == (1, 1)
    finally:
        pins.close()


def test_a_stripe_still_writing_keeps_the_whole_read_held():
    """One stripe failed, the other timed out and NIXL could not cancel it: the read reports
    a timeout with that stripe live (the caller holds the buffer until it settles), and no
    notification goes to the producer. The stripes' outcomes are made up; the lanes and the
    bookkeeping around them are the agent's own."""
    fake = _FakeAgent()
    agent = nixl_reads.Reads(fake, None, lanes=2)
    states = {}
    notified: list[bytes] = []
    agent._notify = lambda peer, notif: notified.append(notif)

    def one(into, remote, nbytes, peer, notif, deadline, region_md=b""):
        return states[into[0]]

    agent._read_one = one
    n = nixl_reads.STRIPE_MIN_BYTES * 2
    half = n // 2
    try:
        states.update({0x1000: ("ERR", None), 0x1000 + half: ("TIMEOUT", "h1")})
        state, live = agent.read((0x1000, n, "cpu"), (0x9000, "DRAM", 0), n, "p", b"t",
                                 time.monotonic() + 1)
        assert (state, live) == ("TIMEOUT", ["h1"]) and notified == []
        fake.states = {"h1": "PROC"}
        assert not agent.read_ended(live) and live == ["h1"]
        fake.states = {"h1": "DONE"}
        assert agent.read_ended(live) and live == [] and fake.released == ["h1"]
        states.update({0x1000 + half: ("DONE", None)})  # an error alone: nothing live
        assert agent.read((0x1000, n, "cpu"), (0x9000, "DRAM", 0), n, "p", b"t",
                          time.monotonic() + 1) == ("ERR", None)
        states.update({0x1000: ("DONE", None)})
        assert agent.read((0x1000, n, "cpu"), (0x9000, "DRAM", 0), n, "p", b"t",
                          time.monotonic() + 1) == ("DONE", None) and notified == [b"t"]
    finally:
        for lane in agent.lanes:
            lane.shutdown()


class _RecordingLink:
    """A side channel that records the pulls asked on it and answers each with a miss."""

    broken = False

    def __init__(self) -> None:
        self.asked: list[tuple] = []

    def pull(self, key, session, buf, timeout_s, on_progress=None, namespace=""):
        from ec_connectors.transports.peer_pull.link import PendingPull
        from ec_connectors.transports.peer_pull.messages import PullFailed

        self.asked.append((key, session, namespace))
        return PendingPull(buf, finished=True,
                           reply=PullFailed(pull_id=1, code="unknown"))


def test_a_nixl_link_asks_with_the_session_it_is_given():
    """The side-channel pull of a NIXL link names the session its puller gave it."""
    from ec_connectors.transports.nixl_pull.link import NixlPeerLink
    from ec_connectors.transports.nixl_pull.messages import NixlHello, NixlPeer
    from ec_connectors.transports.nixl_pull.server import NixlCounters

    side = _RecordingLink()
    link = NixlPeerLink("127.0.0.1:1", lambda hello, on_other: side, _FakeAgent(), "cpu",
                        (0, 0), NixlCounters(), NixlHello(agent="c"))
    link.peer = NixlPeer(agent="p", metadata=b"", base=1, length=1, mem="DRAM", device=0,
                         warm=b"")
    link._ready.set()
    buf = type("Buf", (), {"addr": 0, "nbytes": 1 << 20})()
    p = link.pull("k", "127.0.0.1:9", buf, 1.0, namespace="m")
    assert side.asked == [("k", "127.0.0.1:9", "m")] and p.reply.code == "unknown"


def test_reads_are_split_only_where_ucx_may_copy_in_the_kernel(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    assert nixl_host.kernel_identity()
    for tls, split in (("tcp", False), ("rc,tcp", False), ("^cma", False), ("^tcp", True),
                       ("sm,tcp", True), ("cma,tcp", True), ("all", True)):
        monkeypatch.setenv("UCX_TLS", tls)
        assert bool(nixl_host.kernel_identity()) is split, tls


def test_gpu_pools_register_as_vram_and_peer_names_are_checked():
    assert nixl_host.mem_kind("cpu") == ("DRAM", 0)
    assert nixl_host.mem_kind("cuda:1") == ("VRAM", 1)
    with pytest.raises(ValueError):
        nixl_host.mem_kind("mps")
    fake = nixl_agent.NixlAgent.__new__(nixl_agent.NixlAgent)
    fake._agent, fake._regs = _FakeAgent(), []
    fake.register(0x1000, 4096, "cuda:1")
    assert fake._agent.calls == [([(0x1000, 4096, 1, "")], "VRAM")]
    in_child("_peer_names_checked")


def _peer_names_checked() -> None:
    one = nixl_agent.NixlAgent(f"epd-test-{os.getpid()}-a")
    two = nixl_agent.NixlAgent(f"epd-test-{os.getpid()}-b")
    try:
        with pytest.raises(ValueError, match="names"):
            one.add_peer("someone-else", two.metadata())
        with pytest.raises(ValueError, match="bad NIXL agent name"):
            one.add_peer("../x y", two.metadata())
        assert one.add_peer(two.name, two.metadata()) == two.name
    finally:
        one.close()
        two.close()


def test_large_reads_are_split_across_lanes_and_notify_once():
    """A read of several MiB goes out as one stripe per lane (each lane a thread with its own
    UCX worker), lands whole, and its notification reaches the producer once, after all;
    unsplit (a producer on another host), it is one read on the first lane."""
    in_child("_striped_read")


def _striped_read() -> None:
    one = nixl_agent.NixlAgent(f"epd-test-{os.getpid()}-r", lanes=2)
    two = nixl_agent.NixlAgent(f"epd-test-{os.getpid()}-s")
    try:
        n = nixl_reads.STRIPE_MIN_BYTES * 2 + 3  # stripes of unequal length
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        dst = torch.zeros(n, dtype=torch.uint8)
        two.register(src.data_ptr(), n, "cpu")
        one.register(dst.data_ptr(), n, "cpu")
        one.add_peer(two.name, two.metadata())
        stripes: list[tuple[str, int]] = []
        real = one.reads._read_one

        def spy(local, remote, nbytes, *args):
            stripes.append((threading.current_thread().name, nbytes))
            return real(local, remote, nbytes, *args)

        one.reads._read_one = spy
        notes: list[bytes] = []
        stop = threading.Event()

        def serve() -> None:  # the producer's side progresses as its pins thread does
            while not stop.is_set():
                notes.extend(two.notifications())
                time.sleep(0.0005)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        landed: list[int] = []
        state, live = one.read((dst.data_ptr(), n, "cpu"), (src.data_ptr(), "DRAM", 0), n,
                               two.name, b"token-1", time.monotonic() + 30,
                               chunk=nixl_reads.STRIPE_MIN_BYTES * 2, on_chunk=landed.append)
        assert (state, live) == ("DONE", None) and torch.equal(dst, src)
        assert landed == [nixl_reads.STRIPE_MIN_BYTES * 2, n]
        big = [s for s in stripes if s[1] >= nixl_reads.STRIPE_MIN_BYTES]
        assert len(big) == 2 and {name[:14] for name, _ in big} == {"epd-nixl-lane0",
                                                                    "epd-nixl-lane1"}
        assert sum(size for _, size in stripes) == n  # the 3-byte tail: one small read
        assert wait_for(lambda: notes, timeout=5)
        time.sleep(0.2)
        assert notes == [b"token-1"]
        # a producer on another kernel (no cma: TCP, RDMA) gets each read whole, on lane 0
        stripes.clear()
        dst.zero_()
        state, _ = one.read((dst.data_ptr(), n, "cpu"), (src.data_ptr(), "DRAM", 0), n,
                            two.name, b"token-2", time.monotonic() + 30, split=False)
        assert state == "DONE" and torch.equal(dst, src)
        assert [(name[:14], size) for name, size in stripes] == [("epd-nixl-lane0", n)]
        assert wait_for(lambda: notes == [b"token-1", b"token-2"], timeout=5)
        assert nixl_host.kernel_identity()  # what the producer sends, compared by the link
    finally:
        stop.set()
        one.close()
        two.close()
