"""The socket data path of the Mooncake TE transport (mooncake_te/stream.py) on its own, over
real loopback sockets on ephemeral ports: who gets a data connection served (one-time
tickets), warm connections reused pull after pull and replaced when broken, and what either
end does with garbage, short streams and stalls. A consumer's SocketReader against an in-process
producer (a side channel that makes tickets live, a stream listener) checks the pull path
above them. With real producers and consumers: test_mooncake_te_puller.py."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch
import xxhash
import zmq

from ec_connectors.channel import Channel, encode
from ec_connectors.protocol.stored import ItemInfo
from ec_connectors.transports.memory import MemoryPool
from ec_connectors.transports.mooncake_te import messages, stream, stream_client, stream_server
from ec_connectors.transports.mooncake_te.messages import StreamOpen
from ec_connectors.transports.mooncake_te.socket_path import SocketReader
from ec_connectors.transports.peer_pull.link import PeerLink
from ec_connectors.transports.peer_pull.messages import Pull, Pulled, PullFailed
from tests.helpers import wait_for

MiB = 1 << 20


@pytest.fixture
def pool():
    p = MemoryPool(64 * MiB)
    yield p
    p.close()


def _item(pool: MemoryPool, nbytes: int, seed: int = 1):
    buf = pool.allocate(nbytes, time.monotonic() + 1)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    buf.write(data)
    info = ItemInfo(item_id=f"i{seed}", key=f"k{seed}", shape=(nbytes,), dtype="uint8",
                    nbytes=nbytes, checksum=xxhash.xxh3_64(data.numpy().tobytes()).hexdigest())
    return buf, info


class _Producer:
    """A stream listener serving `items` (key -> (buf, info)) the producer's way: each
    request answered on its connection; `requests` counts them."""

    def __init__(self, items: dict, serve=None) -> None:
        self.items = items
        self.requests = 0
        self.server = stream_server.StreamServer("127.0.0.1", 0, serve or self.serve)

    def serve(self, conn: socket.socket) -> None:
        conn.settimeout(2)
        conn.sendall(stream.READY)
        while (msg := stream_server.read_request(conn, idle_s=10)) is not None:
            self.requests += 1
            buf, info = self.items.get(msg.key, (None, None))
            if info is None:
                stream_server.send_reply(conn, PullFailed(pull_id=msg.pull_id, code="unknown"),
                                  time.monotonic() + 2)
            else:
                stream_server.send_reply(conn, Pulled(pull_id=msg.pull_id, info=info),
                                  time.monotonic() + 5, buf)


@pytest.fixture
def producer(pool):
    items = [_item(pool, n, seed) for seed, n in ((1, 9 * MiB + 123), (2, 2 * MiB))]
    prod = _Producer({info.key: (buf, info) for buf, info in items})
    yield prod
    prod.server.close()


def _request(key: str, pull_id: int = 1, capacity: int = 10 * MiB) -> Pull:
    return Pull(pull_id=pull_id, key=key, session="", dst_addr=0, capacity=capacity,
                timeout_s=5)


def _nothing_sent(conn: socket.socket, timeout_s: float = 5.0) -> bool:
    """The producer closed `conn` without a byte."""
    conn.settimeout(timeout_s)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def _connect_raw(server: stream_server.StreamServer, ticket: bytes) -> socket.socket:
    conn = socket.create_connection(server.address, timeout=2)
    conn.sendall(ticket)
    return conn


def test_a_warm_connection_serves_pull_after_pull_verified_as_bytes_land(producer, pool):
    conns = stream_client.Connections(*producer.server.address, producer.server.expect)
    dst = pool.allocate(10 * MiB, time.monotonic() + 1)
    for i, key in enumerate(("k1", "k2", "k1")):
        conn, reused = conns.acquire(time.monotonic() + 2)
        assert conn is not None and reused == (i > 0)
        hasher, seen = xxhash.xxh3_64(), [0]
        view = dst.as_bytes()

        def landed(upto: int, hasher=hasher, seen=seen, view=view) -> None:
            hasher.update(view[seen[0]:upto])
            seen[0] = upto

        reply, got = stream_client.pull(conn, _request(key), dst, time.monotonic() + 5, landed)
        conns.release(conn, good=True)
        assert isinstance(reply, Pulled) and got == reply.info.nbytes == seen[0]
        assert hasher.hexdigest() == reply.info.checksum
    conn, _ = conns.acquire(time.monotonic() + 2)
    reply, got = stream_client.pull(conn, _request("nope"), dst, time.monotonic() + 5)
    conns.release(conn, good=True)
    assert isinstance(reply, PullFailed) and reply.code == "unknown" and got == 0
    assert conns.opened == 1 and producer.requests == 4  # one connection, four pulls
    conns.close()
    assert wait_for(lambda: producer.server._open == 0)


def test_the_connection_may_arrive_before_its_ticket_is_live(producer, pool):
    def late(ticket: bytes) -> None:  # the StreamOpen lags on the side channel
        threading.Timer(0.2, producer.server.expect, (ticket,)).start()

    conns = stream_client.Connections(*producer.server.address, late)
    dst = pool.allocate(10 * MiB, time.monotonic() + 1)
    conn, reused = conns.acquire(time.monotonic() + 2)
    assert conn is not None and not reused
    reply, _ = stream_client.pull(conn, _request("k2"), dst, time.monotonic() + 5)
    assert isinstance(reply, Pulled)
    conns.release(conn, good=False)


def test_wrong_absent_reused_and_expired_tickets_get_no_bytes(producer, monkeypatch):
    monkeypatch.setattr(stream_server, "_HANDSHAKE_S", 0.3)
    server = producer.server
    ticket = stream.ticket()
    server.expect(ticket)
    wrong = _connect_raw(server, stream.ticket())
    near = _connect_raw(server, ticket[:-1] + bytes([ticket[-1] ^ 1]))
    silent = socket.create_connection(server.address, timeout=2)  # presents nothing
    short = socket.create_connection(server.address, timeout=2)
    short.sendall(ticket[:16])  # half a ticket, then nothing
    t0 = time.monotonic()
    for conn in (wrong, near, silent, short):
        assert _nothing_sent(conn)
    assert time.monotonic() - t0 < 2  # closed after the handshake deadline, not held open
    # the ticket still opens one connection, once
    first = stream_client.connect(*server.address, ticket, time.monotonic() + 2)
    assert first is not None
    reused = _connect_raw(server, ticket)
    assert _nothing_sent(reused)
    stale = stream.ticket()
    server.expect(stale, ttl_s=-0.01)  # not presented in time
    late = _connect_raw(server, stale)
    assert _nothing_sent(late)
    assert server.refused == 6 and producer.requests == 0
    first.close()
    assert wait_for(lambda: server._open == 0)


def test_a_refused_or_absent_listener_means_an_engine_pull(producer, monkeypatch):
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    lsock.close()  # nobody listens
    assert stream_client.connect("127.0.0.1", port, stream.ticket(), time.monotonic() + 1) is None
    monkeypatch.setattr(stream_server, "_MAX_CONNECTIONS", 0)  # a listener at its bound
    assert stream_client.connect(*producer.server.address, stream.ticket(),
                          time.monotonic() + 1) is None


def test_open_data_connections_are_bounded(producer, monkeypatch):
    monkeypatch.setattr(stream_server, "_MAX_CONNECTIONS", 2)
    monkeypatch.setattr(stream_server, "_HANDSHAKE_S", 3.0)
    server = producer.server
    held = [socket.create_connection(server.address, timeout=2) for _ in range(2)]
    assert wait_for(lambda: server._open == 2)
    extra = socket.create_connection(server.address, timeout=2)
    t0 = time.monotonic()
    assert _nothing_sent(extra) and time.monotonic() - t0 < 1  # at once, not after 3 s
    for conn in held:
        conn.close()


@pytest.mark.parametrize("garbage", [b"\xff\xff\xff\x7f", struct.pack("<I", 3) + b"abc",
                                     struct.pack("<I", 9) + encode(StreamOpen(ticket=b"x"))[:9]])
def test_garbage_from_a_consumer_closes_its_connection(producer, garbage):
    ticket = stream.ticket()
    producer.server.expect(ticket)
    conn = stream_client.connect(*producer.server.address, ticket, time.monotonic() + 2)
    conn.sendall(garbage)  # too long a frame, not msgpack, not a Pull
    assert _nothing_sent(conn) and producer.requests == 0
    assert wait_for(lambda: producer.server._open == 0)


def test_a_warm_connection_the_producer_closed_is_never_handed_out(pool):
    buf, info = _item(pool, 1 * MiB)
    once = _Producer({})

    def serve_one(conn: socket.socket) -> None:  # answers one pull, then closes
        conn.sendall(stream.READY)
        msg = stream_server.read_request(conn, idle_s=5)
        stream_server.send_reply(conn, Pulled(pull_id=msg.pull_id, info=info), time.monotonic() + 5,
                          buf)

    once.server.set_serve(serve_one)
    dst = pool.allocate(1 * MiB, time.monotonic() + 1)
    conns = stream_client.Connections(*once.server.address, once.server.expect)
    try:
        for _ in range(2):
            conn, reused = conns.acquire(time.monotonic() + 2)
            assert not reused  # the idle one was seen closed: a fresh one instead
            assert isinstance(stream_client.pull(conn, _request(info.key), dst,
                                          time.monotonic() + 5)[0], Pulled)
            conns.release(conn, good=True)
            assert wait_for(lambda: once.server._open == 0)
        assert conns.opened == 2
    finally:
        conns.close()
        once.server.close()


def _reply_then(script):
    """A fake producer's listener: READY after the ticket, then `script(conn, request)`."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = lsock.accept()
        conn.recv(stream.TICKET_BYTES)
        conn.sendall(stream.READY)
        try:
            script(conn, stream_server.read_request(conn, idle_s=5))
        finally:
            conn.close()
            lsock.close()

    threading.Thread(target=run, daemon=True).start()
    return lsock.getsockname()


def _frame(msg) -> bytes:
    body = encode(msg)
    return struct.pack("<I", len(body)) + body


def _info(nbytes: int) -> ItemInfo:
    return ItemInfo(item_id="x", key="k", shape=(nbytes,), dtype="uint8", nbytes=nbytes,
                    checksum="0" * 16)


@pytest.mark.parametrize("case", ["short", "oversized", "stalls", "wrong_pull", "not_a_reply",
                                  "closed"])
def test_a_bad_reply_fails_the_pull_and_never_writes_past_the_buffer(pool, case):
    dst = pool.allocate(1 * MiB, time.monotonic() + 1)
    guard = pool.allocate(1 * MiB, time.monotonic() + 1)  # the next block: must stay intact
    guard.write(torch.full((1 * MiB,), 7, dtype=torch.uint8))
    stalls = threading.Event()

    def script(conn: socket.socket, req: Pull) -> None:
        if case == "short":
            conn.sendall(_frame(Pulled(pull_id=req.pull_id, info=_info(MiB))) + b"x" * 1000)
        elif case == "oversized":
            conn.sendall(_frame(Pulled(pull_id=req.pull_id, info=_info(2 * MiB)))
                         + b"x" * (2 * MiB))
        elif case == "stalls":
            conn.sendall(_frame(Pulled(pull_id=req.pull_id, info=_info(MiB))) + b"x" * 1000)
            stalls.wait(5)
        elif case == "wrong_pull":
            conn.sendall(_frame(Pulled(pull_id=req.pull_id + 1, info=_info(MiB)))
                         + b"x" * MiB)
        elif case == "not_a_reply":
            conn.sendall(_frame(req))

    addr = _reply_then(script)
    conn = stream_client.connect(*addr, stream.ticket(), time.monotonic() + 2)
    t0 = time.monotonic()
    error = {"short": stream.StreamError, "oversized": stream.StreamError,
             "stalls": stream.StreamError, "wrong_pull": stream.StreamError,
             "not_a_reply": stream.StreamError, "closed": stream.StreamClosed}[case]
    with pytest.raises(error, match={"short": "ended after 1000 of", "oversized": "announced",
                                     "stalls": "timed out", "wrong_pull": "a reply to pull 2",
                                     "not_a_reply": "not one", "closed": "closed"}[case]):
        stream_client.pull(conn, _request("k", capacity=MiB), dst, time.monotonic() + 0.5)
    stalls.set()
    assert time.monotonic() - t0 < 1.5
    assert bytes(guard.as_bytes()) == b"\x07" * MiB


# -- a consumer's SocketReader against an in-process producer ----------------------------------
@pytest.fixture
def link(producer):
    """A SocketReader whose side channel makes tickets live at `producer`'s listener."""
    ctx = zmq.Context()
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()

    def on_message(msg, _peer, _payload) -> None:
        if isinstance(msg, StreamOpen):
            producer.server.expect(msg.ticket)

    side = Channel(f"tcp://127.0.0.1:{port}", bind=True, on_message=on_message,
                   name="fake-producer", decode=messages.decode_peer, context=ctx)
    endpoint = f"127.0.0.1:{port}"
    peer = SocketReader(endpoint, lambda hello, on_other: PeerLink(
        endpoint, ctx, messages.decode_peer, hello=hello, on_other=on_other))
    peer.streams = stream_client.Connections(*producer.server.address, peer._open_stream)
    yield peer
    peer.close()
    side.close()
    ctx.destroy(linger=0)


def test_a_link_reuses_its_connection_and_replaces_one_broken_under_it(link, producer, pool,
                                                                       monkeypatch):
    dst = pool.allocate(10 * MiB, time.monotonic() + 1)
    for _ in range(3):
        p = link.pull("k2", "", dst, 5)
        assert isinstance(p.reply, Pulled) and not p.stream_error
    assert link.streams.opened == 1 and producer.requests == 3
    # the producer drops its end while the connection sits idle, and the consumer does not
    # see it before it asks: asked again on a fresh connection, once
    with producer.server._lock:
        served = list(producer.server._active)
    for conn in served:
        conn.shutdown(socket.SHUT_RDWR)
    assert wait_for(lambda: producer.server._open == 0)
    monkeypatch.setattr(stream_client, "_still_open", lambda conn: True)
    p = link.pull("k2", "", dst, 5)
    assert isinstance(p.reply, Pulled) and not p.stream_error and p.opened == 1
    assert link.streams.opened == 2


def test_a_frozen_producer_fails_the_pull_at_its_deadline_and_the_connection_goes(
        link, producer, pool, monkeypatch):
    dst = pool.allocate(10 * MiB, time.monotonic() + 1)
    assert isinstance(link.pull("k2", "", dst, 5).reply, Pulled)
    frozen = threading.Event()
    producer.items["k3"] = (None, None)
    real = stream_server.send_reply

    def freeze(conn, reply, deadline, buf=None):  # the serve thread stops answering
        frozen.wait(10)
        real(conn, reply, deadline, buf)

    monkeypatch.setattr(stream_server, "send_reply", freeze)
    t0 = time.monotonic()
    p = link.pull("k3", "", dst, 0.5)
    frozen.set()
    assert time.monotonic() - t0 < 1.5
    assert p.reply is None and "timed out" in p.stream_error
    assert link.streams.idle == 0  # the connection is closed, not pooled


def test_garbage_on_an_idle_connection_closes_it(link, producer, pool):
    dst = pool.allocate(10 * MiB, time.monotonic() + 1)
    assert isinstance(link.pull("k2", "", dst, 5).reply, Pulled)
    with producer.server._lock:
        (served,) = producer.server._active
    served.sendall(b"unasked")  # bytes nobody asked for on an idle connection
    time.sleep(0.05)
    p = link.pull("k2", "", dst, 5)
    assert isinstance(p.reply, Pulled) and p.opened == 1  # not reused: a fresh one
    assert link.streams.opened == 2
