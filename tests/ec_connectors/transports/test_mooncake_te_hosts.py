"""The Mooncake Transfer Engine transport across hosts and against outsiders: network
namespaces joined by veth pairs or a bridge (root and `ip netns`), the deployment secret on the
side channel and announcements, the range a connection proved, and writes by a process without
the secret."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
import zmq

from tests.ec_connectors.transports import forked_peers
from tests.ec_connectors.transports.mooncake_te_helpers import (
    CONSUMER,
    PRODUCER,
    base_ports,
    health,
    mc_config,
    netns_ok,
    secret_file,
)
from tests.helpers import expected, wait_for

pytest.importorskip("mooncake.engine")
peers = forked_peers.fixture()  # peers forked warm, killed after the test
_ports = base_ports(__name__)


@pytest.mark.skipif(not netns_ok(), reason="needs root and `ip netns` (network namespaces)")
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


@pytest.mark.skipif(not netns_ok(), reason="needs root and `ip netns` (network namespaces)")
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
        outsiders = [peer(CONSUMER, "out", **extra) for extra in (
            {}, {"secret_file": secret_file(tmp_path, b"not-this-deployment-1234")})]
        for outsider in outsiders:  # both at once: each waits out its deadline
            outsider.send({"op": "get", "id": "x", "timeout_s": 1.5, "location": endpoint})
        for outsider in outsiders:
            assert not outsider.result(30)["found"]
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
    strangers = [peers.start(CONSUMER, **config) for config in (mc_config(base), mc_config(
        base, secret_file=secret_file(tmp_path, b"another-deployment-secret-9876543")))]
    for stranger in strangers:  # both at once: each waits out its deadline
        stranger.send({"op": "get", "id": "s", "timeout_s": 1.5, "location": endpoint})
    for stranger in strangers:
        assert not stranger.result(30)["found"]
    # a foreign client speaking the wire format by hand: no handshake, no answer, and the
    # producer never writes anywhere for it
    from ec_connectors.channel import encode
    from ec_connectors.protocol.keys import item_key
    from ec_connectors.transports.peer_pull.messages import Pull

    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        # a send blocks once the producer has refused the handshake (no peer left): bounded
        dealer.setsockopt(zmq.SNDTIMEO, 1500)
        dealer.connect(f"tcp://{endpoint}")
        with contextlib.suppress(zmq.Again):  # refused before the send: nothing went out
            dealer.send_multipart([encode(Pull(pull_id=1, key=item_key("s"),
                                               session="127.0.0.1:1", dst_addr=4096,
                                               capacity=1 << 20))])
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
    from ec_connectors.protocol.curve import curve_keys
    from ec_connectors.protocol.keys import item_key
    from ec_connectors.protocol.secret_file import read_secret
    from ec_connectors.transports.mooncake_te.messages import Register
    from ec_connectors.transports.peer_pull.messages import Pull, PullFailed

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
    from epd_common.net import resolve_host

    outward = resolve_host("auto")
    if outward.startswith("127."):
        pytest.skip("this machine has no non-loopback address")
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base, host=outward))
    assert prod.info["endpoint"] == f"127.0.0.1:{base}"


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
    """On the engine data path (te_data_path engine: RDMA, cuda pools; over TCP with host
    pools no engine runs) the Transfer Engine's handshake and TCP data listeners bind every
    interface and take no credential (Mooncake has no setting for their address:
    docs/trust.md). A process that
    reaches them, without the deployment secret, learns a producer's pool address from the
    handshake and writes into it. The consumer's verification (the xxh3 the producer sent
    over the CURVE side channel) refuses those bytes, asks the next producer, and gets the
    item right; the damaged copy costs one pull, not a loop until the deadline."""
    import json
    import subprocess
    import sys

    secret = secret_file(tmp_path)
    a, b = (peers.start(PRODUCER, **mc_config(next(_ports), secret_file=secret,
                                              te_data_path="engine"))
            for _ in range(2))
    shape = [512, 1024]  # 1 MiB: through the engine, not inline
    puts = [p.call({"op": "put", "id": "x", "seed": 21, "shape": shape, "dtype": "bfloat16"})
            for p in (a, b)]
    assert puts[0]["checksum"] == puts[1]["checksum"] == expected(21, shape)
    cons = peers.start(CONSUMER, **mc_config(next(_ports), secret_file=secret, producers=[
        puts[0]["location"], puts[1]["location"]], te_data_path="engine"))
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
