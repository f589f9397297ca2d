"""The pulling side of the Mooncake Transfer Engine transport (mooncake_te/consumer.py: the
Puller, its deadlines, quarantine and pool) against real producers that miss, refuse, die or
freeze, over TCP loopback: each peer a `peer_process` running a real TransferEngine. Both
data paths: the socket stream (the default over TCP, mooncake_te/stream.py) and the engine's
writes (`te_data_path` engine: quarantine is the engine path's)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ec_connectors.protocol import ports
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


def test_small_items_ride_inline_and_unknown_items_miss_at_once(peers):
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
    miss = cons.call({"op": "get", "id": "never-stored", "timeout_s": 5.0,
                      "location": endpoint})
    assert not miss["found"]
    assert time.monotonic() - t0 < 1.0  # no save of it queued there: a miss now
    asks_all = peers.start(CONSUMER, **mc_config(base, producers=[endpoint]))
    t0 = time.monotonic()  # asked with no location, it may not be made yet: waited for
    miss = asks_all.call({"op": "get", "id": "never-stored", "timeout_s": 1.0})
    assert not miss["found"] and 0.9 < time.monotonic() - t0 < 5
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
    # the stream breaks with the process and its side channel: a failure now, not at the
    # deadline (the next attempt is refused: nobody listens)
    assert time.monotonic() - t0 < 2
    if got["found"]:  # the transfer won the race: then it must be the right bytes
        assert got["checksum"] == expected(9, shape)
    h = health(cons)
    assert h["pool_used_bytes"] == 0 and h["quarantined"] == 0


def test_producer_frozen_with_sigstop(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base, te_data_path="engine"))
    cons = peers.start(CONSUMER, **mc_config(base, te_data_path="engine"))
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
    prod = peers.start(PRODUCER, **mc_config(base, te_data_path="engine"))
    cons = peers.start(CONSUMER, **mc_config(base, te_data_path="engine"))
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


def test_a_streamed_pull_arrives_verified_and_outsiders_get_no_bytes(peers):
    import socket

    from ec_connectors.protocol.ports import stream_port
    from epd_common.net import parse_endpoint

    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    shape = [6144, 4096]  # 48 MiB
    prod.call({"op": "put", "id": "s", "seed": 5, "shape": shape, "dtype": "bfloat16"})
    host, port = parse_endpoint(prod.info["endpoint"])
    # an outsider on the stream port: a ticket of its own, or none at all
    outsiders = [socket.create_connection((host, stream_port(port)), timeout=5)
                 for _ in range(2)]
    outsiders[0].sendall(os.urandom(32))
    for _ in range(2):
        got = cons.call({"op": "get", "id": "s", "timeout_s": 10,
                         "location": prod.info["endpoint"], "nbytes": 48 * MiB})
        assert got["found"] and got["checksum"] == expected(5, shape)
    for conn in outsiders:
        conn.settimeout(5)
        assert conn.recv(1) == b""  # closed without a byte
    h = health(cons)
    assert h["streamed"] == 2 and h["pool_used_bytes"] == 0 and h["quarantined"] == 0
    assert h["stream_connections"] == 1  # the second pull ran on the first one's connection


def test_pulls_on_a_warm_connection_get_the_side_channels_answers(peers):
    """Every answer a pull gets on the side channel, it gets on a data connection too (the
    size known, so the pull goes there at once): found, unknown, pending then found, failed,
    another model's; all on one connection, the consumer's pool empty afterwards."""
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base, namespace="model-a"))
    cons = peers.start(CONSUMER, **mc_config(base, namespace="model-a"))
    other = peers.start(CONSUMER, **mc_config(base, namespace="model-b"))
    endpoint = prod.info["endpoint"]
    shape, nbytes = [1024, 4096], 8 * MiB

    def get(peer, item: str, timeout_s: float = 5) -> tuple[dict, float]:
        t0 = time.monotonic()
        got = peer.call({"op": "get", "id": item, "timeout_s": timeout_s,
                         "location": endpoint, "nbytes": nbytes}, timeout_s=30)
        return got, time.monotonic() - t0

    prod.call({"op": "put", "id": "w", "seed": 3, "shape": shape, "dtype": "bfloat16"})
    for _ in range(3):
        got, _ = get(cons, "w")
        assert got["found"] and got["checksum"] == expected(3, shape)
    got, took = get(cons, "never-stored")
    assert not got["found"] and took < 1.0
    prod.call({"op": "save_failed", "id": "broken"})
    got, took = get(cons, "broken")
    assert not got["found"] and took < 1.0
    prod.call({"op": "expect", "id": "later"})
    cons.send({"op": "get", "id": "later", "timeout_s": 5, "location": endpoint,
               "nbytes": nbytes})
    time.sleep(0.3)  # asked while its save is queued: "pending", asked again
    prod.call({"op": "put", "id": "later", "seed": 4, "shape": shape, "dtype": "bfloat16"})
    got = cons.result(30)
    assert got["found"] and got["checksum"] == expected(4, shape)
    got, took = get(other, "w")
    assert not got["found"] and took < 1.0
    h = health(cons)
    assert h["streamed"] == 4 and h["stream_connections"] == 1 and h["unknown"] >= 2
    assert h["pool_used_bytes"] == 0 and h["quarantined"] == 0
    assert health(other)["pool_used_bytes"] == 0


def test_the_engine_path_works_forced_and_a_process_without_an_engine_says_why_at_once(peers):
    """Only processes off the socket data path start an engine (TCP with a host pool: none,
    so no listener on every interface). Forced to the engine on both sides, items move; a
    socket consumer asking an engine-only producer, or an engine consumer asking a socket
    producer, misses at once with the reason, not at its deadline."""
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base, te_data_path="engine"))
    forced = peers.start(CONSUMER, **mc_config(base, te_data_path="engine"))
    shape = [4096, 4096]
    prod.call({"op": "put", "id": "e", "seed": 6, "shape": shape, "dtype": "bfloat16"})
    got = forced.call({"op": "get", "id": "e", "timeout_s": 10,
                       "location": prod.info["endpoint"], "nbytes": 32 * MiB})
    assert got["found"] and got["checksum"] == expected(6, shape)
    h = health(forced)
    assert h["streamed"] == 0 and h["pool_used_bytes"] == 0
    first, last = ports.ENGINE_PORTS  # its listeners: the port plan's range, not 15000-17000
    assert first <= int(h["session"].rsplit(":", 1)[1]) <= last
    socket_prod = peers.start(PRODUCER, **mc_config(base + 1))
    socket_prod.call({"op": "put", "id": "e", "seed": 6, "shape": shape, "dtype": "bfloat16"})
    assert health(socket_prod)["session"] == ""  # no engine started
    streams = peers.start(CONSUMER, **mc_config(base))
    for cons, producer in ((streams, prod), (forced, socket_prod)):
        got = cons.call({"op": "get", "id": "e", "timeout_s": 10,
                         "location": producer.info["endpoint"], "nbytes": 32 * MiB})
        assert not got["found"] and got["get_s"] < 2.0, got
        assert health(cons)["pool_used_bytes"] == 0
    assert health(streams)["session"] == ""


def test_a_frozen_producer_on_the_stream_path_frees_the_block_at_the_deadline(peers):
    base = next(_ports)
    prod = peers.start(PRODUCER, **mc_config(base))
    cons = peers.start(CONSUMER, **mc_config(base))
    shape = [6144, 4096]
    prod.call({"op": "put", "id": "f", "seed": 4, "shape": shape, "dtype": "bfloat16"})
    endpoint = prod.info["endpoint"]
    assert cons.call({"op": "get", "id": "f", "timeout_s": 5, "location": endpoint})["found"]
    os.killpg(prod.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    got = cons.call({"op": "get", "id": "f", "timeout_s": 1.5, "location": endpoint,
                     "nbytes": 48 * MiB}, timeout_s=30)
    assert not got["found"] and 1.4 < time.monotonic() - t0 < 4
    h = health(cons)  # nothing writes into a consumer's memory on this path: no quarantine
    assert h["quarantined"] == 0 and h["pool_used_bytes"] == 0
    os.killpg(prod.proc.pid, signal.SIGCONT)
    again = cons.call({"op": "get", "id": "f", "timeout_s": 5, "location": endpoint})
    assert again["found"] and again["checksum"] == expected(4, shape)


@pytest.mark.parametrize("how", ["short", "stalls", "garbage"])
def test_a_producer_that_streams_short_fails_the_pull_and_frees_the_block(peers, how):
    """A producer (holding the secret, so trusted on the side channel) whose stream ends or
    stops short of what its `Pulled` says, or that answers with garbage: the pull fails at
    once (short, garbage) or at its deadline (stalls), the block is free again, nothing is
    quarantined, and the connection is not used again."""
    import zmq

    from ec_connectors.channel import Channel, encode
    from ec_connectors.protocol.ports import stream_port
    from ec_connectors.protocol.stored import ItemInfo
    from ec_connectors.transports.mooncake_te import messages, stream, stream_server
    from ec_connectors.transports.mooncake_te.messages import StreamOpen
    from ec_connectors.transports.peer_pull.messages import Pulled

    base = next(_ports)
    nbytes = 8 * MiB
    served = threading.Event()
    connections = []

    def serve(conn) -> None:
        connections.append(conn)
        conn.sendall(stream.READY)
        msg = stream_server.read_request(conn, idle_s=5)
        info = ItemInfo(item_id="bad", key=msg.key, shape=(nbytes // 2,), dtype="bfloat16",
                        nbytes=nbytes, checksum="0" * 16, location=f"127.0.0.1:{base}")
        body = encode(Pulled(pull_id=msg.pull_id, info=info))
        head = len(body).to_bytes(4, "little") + body
        conn.sendall(b"\x05\x00\x00\x00garbage" if how == "garbage"
                     else head + b"x" * (nbytes // 2))
        if how == "stalls":
            time.sleep(3)
        served.set()

    streams = stream_server.StreamServer("127.0.0.1", stream_port(base), serve)
    ctx = zmq.Context()

    def on_message(msg, _peer, _payload) -> None:
        if isinstance(msg, StreamOpen):
            streams.expect(msg.ticket)

    channel = Channel(f"tcp://127.0.0.1:{base}", bind=True, on_message=on_message,
                      name="fake-producer", decode=messages.decode_peer, context=ctx)
    try:
        cons = peers.start(CONSUMER, **mc_config(base))
        t0 = time.monotonic()
        got = cons.call({"op": "get", "id": "bad", "timeout_s": 1.5,
                         "location": f"127.0.0.1:{base}", "nbytes": nbytes}, timeout_s=30)
        elapsed = time.monotonic() - t0
        assert not got["found"] and served.wait(10)
        assert elapsed < (1.0 if how != "stalls" else 4)
        h = health(cons)
        assert h["pool_used_bytes"] == 0 and h["quarantined"] == 0 and h["streamed"] == 0
        assert len(connections) == 1 and wait_for(lambda: streams._open == 0)  # closed
    finally:
        channel.close()
        streams.close()
        ctx.destroy(linger=0)
