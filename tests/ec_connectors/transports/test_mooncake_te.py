"""The Mooncake Transfer Engine transport with real processes over TCP loopback: each peer is
a `peer_process` subprocess running a real TransferEngine and registered pool."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq

from ec_connectors.config import EPDConfig
from ec_connectors.testing.peer_process import PeerClient
from ec_connectors.transports import Placement
from ec_connectors.transports.mooncake_te.catalog import MooncakeCatalog
from tests.ec_connectors.transports import forked_peers
from tests.helpers import expected, wait_for

pytest.importorskip("mooncake.engine")
peers = forked_peers.fixture()  # peers forked warm, killed after the test
MiB = 1 << 20
PRODUCER = {"is_producer": True, "is_consumer": False}
CONSUMER = {"is_producer": False, "is_consumer": True}
_ports = iter(range(21000, 21700, 10))  # announcements +1000: clear of the 184xx test servers


def mc_config(base_port: int, **extra) -> dict:
    return {"transport": "mooncake", "protocol": "tcp", "host": "127.0.0.1",
            "base_port": base_port, "memory_pool_bytes": 256 * MiB, **extra}


def health(peer: PeerClient) -> dict:
    return peer.call({"op": "health"})["health"]


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


def test_small_items_ride_inline_and_unknown_items_miss_by_the_deadline(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    endpoint = prod.info["endpoint"]
    put = prod.call({"op": "put", "id": "tiny", "seed": 1, "shape": [64, 128],
                     "dtype": "bfloat16"})
    got = cons.call({"op": "get", "id": "tiny", "timeout_s": 5, "location": endpoint})
    assert got["found"] and got["checksum"] == put["checksum"]
    assert health(cons)["inline"] == 1
    t0 = time.monotonic()
    miss = cons.call({"op": "get", "id": "never-stored", "timeout_s": 1.0,
                      "location": endpoint})
    assert not miss["found"]
    assert 0.9 < time.monotonic() - t0 < 5
    h = health(cons)
    assert h["unknown"] >= 1 and h["pool_used_bytes"] == 0


def test_items_of_another_model_are_refused(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base, namespace="model-a"))
    other = peers.start(CONSUMER, **mc_config(base, namespace="model-b"))
    same = peers.start(CONSUMER, **mc_config(base, namespace="model-a"))
    endpoint = prod.info["endpoint"]
    put = prod.call({"op": "put", "id": "shared-uuid", "seed": 8, "shape": [1024, 1024],
                     "dtype": "bfloat16"})
    t0 = time.monotonic()
    refused = other.call({"op": "get", "id": "shared-uuid", "timeout_s": 5,
                          "location": endpoint})
    assert not refused["found"] and time.monotonic() - t0 < 2  # refused at once, not retried
    got = same.call({"op": "get", "id": "shared-uuid", "timeout_s": 5, "location": endpoint})
    assert got["found"] and got["checksum"] == put["checksum"]
    # the same served name on other weights (another model fingerprint) is another model
    retrained = peers.start(CONSUMER, **mc_config(base, namespace="model-a",
                                                  model_fingerprint="0123456789abcdef"))
    refused = retrained.call({"op": "get", "id": "shared-uuid", "timeout_s": 5,
                              "location": endpoint})
    assert not refused["found"]


def test_consumer_finds_items_through_configured_producers(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base, producers=[f"127.0.0.1:{base}"]))
    put = prod.call({"op": "put", "id": "p1", "seed": 2, "shape": [512, 1024],
                     "dtype": "float16"})
    got = cons.call({"op": "get", "id": "p1", "timeout_s": 5})  # no location given
    assert got["found"] and got["checksum"] == put["checksum"]


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


def test_consumer_pool_exhaustion_fails_the_pull_in_time(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base, memory_pool_bytes=4 * MiB))
    endpoint = prod.info["endpoint"]
    prod.call({"op": "put", "id": "big", "seed": 1, "shape": [4096, 1024],
               "dtype": "bfloat16"})  # 8 MiB: larger than the consumer's whole pool
    t0 = time.monotonic()
    got = cons.call({"op": "get", "id": "big", "timeout_s": 5, "location": endpoint})
    assert not got["found"] and time.monotonic() - t0 < 2
    assert health(cons)["pool_used_bytes"] == 0


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

    sock.send(encode(messages.Pull(pull_id=1, key="x", session="not an endpoint",
                                  dst_addr=0, capacity=0)))
    assert sock.poll(5000)
    reply = messages.decode_peer(sock.recv())
    assert isinstance(reply, messages.PullFailed) and reply.code == "bad_request"
    sock.close()
    got = cons.call({"op": "get", "id": "g", "timeout_s": 5, "location": prod.info["endpoint"]})
    assert got["found"] and got["checksum"] == put["checksum"]


def test_producer_killed_mid_transfer(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    shape = [16000, 4096]  # 125 MB
    prod.call({"op": "put", "id": "k", "seed": 9, "shape": shape, "dtype": "bfloat16"})
    deadline_s = 4.0
    t0 = time.monotonic()
    cons.send({"op": "get", "id": "k", "timeout_s": deadline_s, "location": prod.info["endpoint"],
               "nbytes": 16000 * 4096 * 2})
    threading.Timer(0.01, os.killpg, (prod.proc.pid, signal.SIGKILL)).start()
    got = cons.result(30)
    assert time.monotonic() - t0 < deadline_s + 2  # deadline honoured, no hang
    if got["found"]:  # the transfer won the race: then it must be the right bytes
        assert got["checksum"] == expected(9, shape)
    h = health(cons)
    assert h["pool_used_bytes"] == 0 and h["quarantined"] == 0


def test_producer_frozen_with_sigstop(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    shape = [6144, 4096]
    prod.call({"op": "put", "id": "f", "seed": 4, "shape": shape, "dtype": "bfloat16"})
    endpoint = prod.info["endpoint"]
    warm = cons.call({"op": "get", "id": "f", "timeout_s": 5, "location": endpoint})
    assert warm["found"]
    os.killpg(prod.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    got = cons.call({"op": "get", "id": "f", "timeout_s": 1.5, "location": endpoint,
                     "nbytes": 48 * MiB}, timeout_s=30)
    elapsed = time.monotonic() - t0
    assert not got["found"] and 1.4 < elapsed < 4  # deadline honoured, no hang
    h = health(cons)
    # The frozen producer may still write into that block: it is held, not reused.
    assert h["quarantined"] == 1 and h["pool_used_bytes"] == 48 * MiB
    os.killpg(prod.proc.pid, signal.SIGCONT)  # it wakes, finishes, answers late: block freed
    assert wait_for(lambda: health(cons)["pool_used_bytes"] == 0, timeout=10, interval=0.1)
    assert health(cons)["quarantined"] == 0
    again = cons.call({"op": "get", "id": "f", "timeout_s": 5, "location": endpoint})
    assert again["found"] and again["checksum"] == expected(4, shape)


def test_frozen_then_killed_producer_releases_quarantine(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    prod.call({"op": "put", "id": "z", "seed": 4, "shape": [2048, 4096], "dtype": "bfloat16"})
    endpoint = prod.info["endpoint"]
    warm = cons.call({"op": "get", "id": "z", "timeout_s": 10, "location": endpoint})
    assert warm["found"], warm
    os.killpg(prod.proc.pid, signal.SIGSTOP)
    got = cons.call({"op": "get", "id": "z", "timeout_s": 1.0, "location": endpoint,
                     "nbytes": 2048 * 4096 * 2})
    h = health(cons)
    assert not got["found"] and h["quarantined"] == 1, (got, h)
    os.killpg(prod.proc.pid, signal.SIGKILL)
    assert wait_for(lambda: health(cons)["pool_used_bytes"] == 0, timeout=15, interval=0.1), \
        health(cons)


def _netns_ok() -> bool:
    if os.geteuid() != 0:
        return False
    name = f"epd-probe-{os.getpid()}"  # per process: xdist workers collect at the same time
    return os.system(f"ip netns add {name} >/dev/null 2>&1 && ip netns del {name}") == 0


@pytest.mark.skipif(not _netns_ok(), reason="needs root and `ip netns` (network namespaces)")
def test_transfer_across_a_veth_pair_between_two_namespaces(peers, tmp_path):
    """Producer and consumer in two network namespaces joined by a veth pair: the bytes cross
    a real interface, not loopback."""
    tag = f"{os.getpid() % 10000}"
    ns_a, ns_b = f"epd-a{tag}", f"epd-b{tag}"
    veth_a, veth_b = f"epdva{tag}", f"epdvb{tag}"
    setup = [
        f"ip netns add {ns_a}", f"ip netns add {ns_b}",
        f"ip link add {veth_a} type veth peer name {veth_b}",
        f"ip link set {veth_a} netns {ns_a}", f"ip link set {veth_b} netns {ns_b}",
        f"ip -n {ns_a} addr add 10.77.0.1/24 dev {veth_a}",
        f"ip -n {ns_b} addr add 10.77.0.2/24 dev {veth_b}",
        f"ip -n {ns_a} link set {veth_a} up", f"ip -n {ns_b} link set {veth_b} up",
        f"ip -n {ns_a} link set lo up", f"ip -n {ns_b} link set lo up",
    ]
    try:
        for cmd in setup:
            assert os.system(cmd) == 0, cmd
        base = next(_ports)
        secret = secret_file(tmp_path)  # beyond loopback only with the deployment secret
        prod = peers.start(PRODUCER, prefix=["ip", "netns", "exec", ns_a],
                           **mc_config(base, host="10.77.0.1", secret_file=secret))
        cons = peers.start(CONSUMER, prefix=["ip", "netns", "exec", ns_b],
                           **mc_config(base, host="10.77.0.2", secret_file=secret))
        shape = [2048, 4096]  # 16 MiB
        put = prod.call({"op": "put", "id": "ns", "seed": 11, "shape": shape,
                         "dtype": "bfloat16"})
        assert put["location"] == f"10.77.0.1:{base}"
        got = cons.call({"op": "get", "id": "ns", "timeout_s": 20, "location": put["location"]})
        assert got["found"] and got["checksum"] == put["checksum"]
        # The veth carried it: its byte counter grew by at least the item's size.
        dev = Path(f"/proc/{cons.proc.pid}/net/dev").read_text()
        rx = int(dev.split(f"{veth_b}:")[1].split()[0])
        assert rx >= put["nbytes"]
    finally:
        peers.close()
        peers.all.clear()
        os.system(f"ip netns del {ns_a} >/dev/null 2>&1; ip netns del {ns_b} >/dev/null 2>&1")


def test_port_scheme_and_host_detection():
    from ec_connectors.protocol.net import resolve_host
    from ec_connectors.protocol.ports import PURPOSE_ANNOUNCE, PURPOSE_SERVE, port_for

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


def secret_file(directory: Path, value: bytes = b"epd-test-secret-0123456789abcdef") -> str:
    path = directory / f"secret-{value[-4:].hex()}"
    path.write_bytes(value)
    path.chmod(0o600)
    return str(path)


def test_side_channel_and_announcements_need_the_deployment_secret(peers, tmp_path):
    base = next(_ports)
    secret = secret_file(tmp_path)
    prod = peers.start(PRODUCER, **mc_config(base, secret_file=secret))
    friend = peers.start(CONSUMER, **mc_config(base, secret_file=secret))
    put = prod.call({"op": "put", "id": "s", "seed": 3, "shape": [64, 64], "dtype": "bfloat16"})
    endpoint = put["location"]
    got = friend.call({"op": "get", "id": "s", "timeout_s": 10, "location": endpoint})
    assert got["found"] and got["checksum"] == put["checksum"]
    # a consumer without the secret, or with another one, gets nothing
    for config in (mc_config(base), mc_config(base, secret_file=secret_file(
            tmp_path, b"another-deployment-secret-9876543"))):
        stranger = peers.start(CONSUMER, **config)
        got = stranger.call({"op": "get", "id": "s", "timeout_s": 1.5, "location": endpoint})
        assert not got["found"]
    # a foreign client speaking the wire format by hand: no handshake, no answer, and the
    # producer never writes anywhere for it
    from ec_connectors.channel import encode
    from ec_connectors.protocol.keys import item_key
    from ec_connectors.transports.mooncake_te.messages import Pull

    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{endpoint}")
        dealer.send_multipart([encode(Pull(pull_id=1, key=item_key("s"), session="127.0.0.1:1",
                                           dst_addr=4096, capacity=1 << 20))])
        assert dealer.poll(1500) == 0
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{base + 1000}")
        time.sleep(0.3)
        prod.call({"op": "put", "id": "s2", "seed": 4, "shape": [64, 64], "dtype": "bfloat16"})
        assert sub.poll(1500) == 0  # announcements are for holders of the secret only
    finally:
        ctx.destroy(linger=0)
    assert health(prod)["held_items"] == 2


def test_a_producer_writes_only_into_the_range_its_connection_proved(peers, tmp_path):
    """A peer holding the deployment secret still cannot aim the producer at another
    consumer's memory: a pull is written only into the range its own connection registered
    and proved by a nonce the producer reads back from that memory."""
    from ec_connectors.channel import encode
    from ec_connectors.protocol.keys import item_key
    from ec_connectors.protocol.secret import curve_keys, read_secret
    from ec_connectors.transports.mooncake_te.messages import Pull, PullFailed, Register

    base = next(_ports)
    secret = secret_file(tmp_path)
    prod = peers.start(PRODUCER, **mc_config(base, secret_file=secret))
    victim = peers.start(CONSUMER, **mc_config(base, secret_file=secret))
    shape = [512, 1024]  # 1 MiB: written through the engine, not inline
    put = prod.call({"op": "put", "id": "r", "seed": 5, "shape": shape, "dtype": "bfloat16"})
    endpoint = put["location"]
    got = victim.call({"op": "get", "id": "r", "timeout_s": 10, "location": endpoint})
    assert got["found"] and got["checksum"] == put["checksum"]  # the victim's own pulls work
    v = health(victim)
    ctx = zmq.Context()
    try:
        def attempt(pull_id: int, hello: Register | None) -> PullFailed:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            curve_keys(read_secret(secret)).client(dealer)
            dealer.connect(f"tcp://{endpoint}")
            if hello is not None:
                dealer.send(encode(hello))
            dealer.send(encode(Pull(pull_id=pull_id, key=item_key("r"), session=v["session"],
                                    dst_addr=v["pool_addr"], capacity=put["nbytes"],
                                    timeout_s=1.0)))
            assert dealer.poll(8000), "the producer must answer a refused pull"
            from ec_connectors.transports.mooncake_te.messages import decode_peer

            reply = decode_peer(dealer.recv())
            dealer.close()
            return reply

        # no registration at all; then the victim's session and range claimed with a guessed
        # nonce (the producer reads the victim's real one and refuses)
        for i, hello in enumerate((None, Register(
                session=v["session"], base=v["pool_addr"], length=v["pool_bytes"],
                proof_addr=v["pool_addr"], nonce=os.urandom(16)))):
            reply = attempt(i + 1, hello)
            assert isinstance(reply, PullFailed) and reply.code == "unregistered", reply
    finally:
        ctx.destroy(linger=0)
    assert health(prod)["unregistered"] == 2
    # the victim still pulls correctly, and nothing was written into its pool meanwhile
    got = victim.call({"op": "get", "id": "r", "timeout_s": 10, "location": endpoint})
    assert got["found"] and got["checksum"] == put["checksum"]
    assert health(victim)["pool_used_bytes"] == 0


def test_without_a_secret_the_data_plane_stays_on_loopback(peers):
    from ec_connectors.protocol.net import resolve_host

    outward = resolve_host("auto")
    if outward.startswith("127."):
        pytest.skip("this machine has no non-loopback address")
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base, host=outward))
    assert prod.info["endpoint"] == f"127.0.0.1:{base}"


def test_a_pull_past_its_deadline_is_dropped_and_frees_the_consumers_buffer(peers):
    """One serve thread busy with a large transfer; a second consumer's pull with a short
    deadline waits behind it and is answered `expired` (never written): the consumer's
    buffer is free again at once instead of quarantined for minutes."""
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base, serve_threads=1,
                                            transfer_chunk_bytes=4 * MiB))
    big, small = [peers.start(CONSUMER, **mc_config(base)) for _ in range(2)]
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


@pytest.mark.skipif(not _netns_ok(), reason="needs root and `ip netns` (network namespaces)")
def test_three_hosts_secret_partition_and_a_killed_host(peers, tmp_path):
    """An encoder host, a decode host and an outsider, each a network namespace with its own
    address on a bridge (in a fourth namespace: nothing touches the machine's own network).
    The decode host pulls across the bridge with the deployment secret; the outsider, without
    it or with another one, gets nothing; a partition (link down) and a killed encoder host
    each cost a pull at most its deadline, and the link coming back heals it."""
    tag = f"{os.getpid() % 10000}"
    sw, hosts = f"epd-sw{tag}", {name: f"epd-{name}{tag}" for name in ("enc", "dec", "out")}
    addr = {"enc": "10.78.0.1", "dec": "10.78.0.2", "out": "10.78.0.3"}
    setup = [f"ip netns add {sw}", f"ip -n {sw} link add br0 type bridge",
             f"ip -n {sw} link set br0 up"]
    for i, (name, ns) in enumerate(hosts.items()):
        dev, port = f"epdh{i}{tag}", f"epds{i}{tag}"
        setup += [f"ip netns add {ns}", f"ip link add {dev} type veth peer name {port}",
                  f"ip link set {dev} netns {ns}", f"ip link set {port} netns {sw}",
                  f"ip -n {sw} link set {port} master br0", f"ip -n {sw} link set {port} up",
                  f"ip -n {ns} addr add {addr[name]}/24 dev {dev}",
                  f"ip -n {ns} link set {dev} up", f"ip -n {ns} link set lo up"]
    dec_port = f"epds1{tag}"
    try:
        for cmd in setup:
            assert os.system(cmd) == 0, cmd
        base = next(_ports)
        secret = secret_file(tmp_path)

        def peer(placement, name, **extra):
            return peers.start(placement, prefix=["ip", "netns", "exec", hosts[name]],
                               **mc_config(base, host=addr[name], **extra))

        prod = peer(PRODUCER, "enc", secret_file=secret)
        cons = peer(CONSUMER, "dec", secret_file=secret)
        shape = [1024, 4096]  # 8 MiB
        put = prod.call({"op": "put", "id": "x", "seed": 21, "shape": shape,
                         "dtype": "bfloat16"})
        endpoint = put["location"]
        assert endpoint == f"{addr['enc']}:{base}"
        got = cons.call({"op": "get", "id": "x", "timeout_s": 10, "location": endpoint})
        assert got["found"] and got["checksum"] == put["checksum"]
        for extra in ({}, {"secret_file": secret_file(tmp_path, b"not-this-deployment-1234")}):
            outsider = peer(CONSUMER, "out", **extra)
            got = outsider.call({"op": "get", "id": "x", "timeout_s": 1.5,
                                 "location": endpoint})
            assert not got["found"]
        # partition: the decode host's link goes down mid-deployment
        assert os.system(f"ip -n {sw} link set {dec_port} down") == 0
        t0 = time.monotonic()
        got = cons.call({"op": "get", "id": "x", "timeout_s": 2.0, "location": endpoint,
                         "nbytes": put["nbytes"]}, timeout_s=30)
        assert not got["found"] and time.monotonic() - t0 < 2.0 + 3.0
        assert os.system(f"ip -n {sw} link set {dec_port} up") == 0
        assert wait_for(lambda: cons.call({"op": "get", "id": "x", "timeout_s": 3,
                                            "location": endpoint})["found"], 30, 0.5)
        # the encoder host dies: the next pull fails within its deadline, nothing hangs
        prod.proc.kill()
        prod.proc.wait(10)
        t0 = time.monotonic()
        got = cons.call({"op": "get", "id": "x", "timeout_s": 2.0, "location": endpoint},
                        timeout_s=30)
        assert not got["found"] and time.monotonic() - t0 < 2.0 + 3.0
        assert health(cons)["pool_used_bytes"] == 0  # nothing leaked on any of these paths
    finally:
        peers.close()
        peers.all.clear()
        for ns in (*hosts.values(), sw):
            os.system(f"ip netns del {ns} >/dev/null 2>&1")


def test_a_failed_save_is_answered_so_the_consumer_stops_waiting(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    endpoint = prod.info["endpoint"]
    t0 = time.monotonic()
    got = cons.call({"op": "get", "id": "never", "timeout_s": 1.0, "location": endpoint})
    waited = time.monotonic() - t0
    assert not got["found"] and waited >= 0.9  # unknown: maybe still queued, so it waits
    prod.call({"op": "save_failed", "id": "gone"})
    t0 = time.monotonic()
    got = cons.call({"op": "get", "id": "gone", "timeout_s": 5.0, "location": endpoint})
    assert not got["found"] and time.monotonic() - t0 < 1.0  # told: no 5 s wait
    prod.call({"op": "put", "id": "gone", "seed": 2, "shape": [64, 64], "dtype": "bfloat16"})
    assert cons.call({"op": "get", "id": "gone", "timeout_s": 5.0,
                      "location": endpoint})["found"]  # stored later: served again


def test_a_dead_producer_costs_a_pull_milliseconds_not_its_deadline(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    put = prod.call({"op": "put", "id": "d", "seed": 9, "shape": [256, 2048],
                     "dtype": "bfloat16"})
    endpoint = put["location"]
    assert cons.call({"op": "get", "id": "d", "timeout_s": 5, "location": endpoint})["found"]
    prod.proc.kill()
    prod.proc.wait(10)
    time.sleep(0.3)  # the consumer's link sees the disconnect
    for _ in range(2):  # nobody listens there now: refused at once, not 5 s of waiting
        t0 = time.monotonic()
        got = cons.call({"op": "get", "id": "d", "timeout_s": 5, "location": endpoint,
                         "nbytes": put["nbytes"]})
        assert not got["found"] and time.monotonic() - t0 < 1.5
    assert health(cons)["pool_used_bytes"] == 0


_OUTSIDER = """
import ctypes, json, sys
from mooncake.engine import TransferEngine
session, size = sys.argv[1], int(sys.argv[2])
engine = TransferEngine()  # no deployment secret: an outsider who found the port
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
junk = ctypes.create_string_buffer(b"\\xa5" * size, size)
assert engine.register_memory(ctypes.addressof(junk), size) == 0
target = engine.get_first_buffer_address(session)  # the handshake tells anyone
rc = engine.transfer_sync_write(session, ctypes.addressof(junk), target, size)
print(json.dumps({"target": target, "rc": rc}))
"""


def test_an_outsiders_write_into_a_registered_pool_is_caught_and_the_item_refetched(
        peers, tmp_path):
    """The Transfer Engine's handshake and TCP data listeners bind every interface and take
    no credential (Mooncake has no setting for their address: docs/trust.md). A process that
    reaches them, without the deployment secret, learns a producer's pool address from the
    handshake and writes into it. The consumer's verification (the xxh3 the producer sent
    over the CURVE side channel) refuses those bytes, asks the next producer, and gets the
    item right; the damaged copy costs one pull, not a loop until the deadline."""
    import json
    import subprocess
    import sys

    secret = secret_file(tmp_path)
    a, b = (peers.start(PRODUCER, **mc_config(next(_ports), secret_file=secret))
            for _ in range(2))
    shape = [512, 1024]  # 1 MiB: through the engine, not inline
    puts = [p.call({"op": "put", "id": "x", "seed": 21, "shape": shape, "dtype": "bfloat16"})
            for p in (a, b)]
    assert puts[0]["checksum"] == puts[1]["checksum"] == expected(21, shape)
    cons = peers.start(CONSUMER, **mc_config(next(_ports), secret_file=secret, producers=[
        puts[0]["location"], puts[1]["location"]]))
    ha = health(a)
    run = subprocess.run([sys.executable, "-c", _OUTSIDER, ha["session"], "4096"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
    assert run.returncode == 0, run.stderr[-2000:]
    wrote = json.loads(run.stdout.strip().splitlines()[-1])
    assert wrote == {"target": ha["pool_addr"], "rc": 0}  # the write landed: the limit
    # from the damaged producer alone: refused at once (a size query, then the one pull),
    # no wrong embedding
    got = cons.call({"op": "get", "id": "x", "timeout_s": 5, "location": puts[0]["location"]})
    assert not got["found"] and got["get_s"] < 2.0, got
    assert health(cons)["pulls"] <= 2
    # from any producer: the damaged copy is passed over, the other one's is right
    got = cons.call({"op": "get", "id": "x", "timeout_s": 5, "nbytes": puts[0]["nbytes"]})
    assert got["found"] and got["checksum"] == expected(21, shape), got
    assert health(cons)["pulls"] <= 4
