"""The socket data path of the Mooncake TE transport (mooncake_te/stream.py) on its own, over
real loopback sockets on ephemeral ports: who gets an item's bytes (one-time tickets), and
what a consumer does with a stream that is short, oversized or stalls. With real producers
and consumers: test_mooncake_te_puller.py."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest
import torch
import xxhash

from ec_connectors.transports.memory import MemoryPool
from ec_connectors.transports.mooncake_te import stream
from tests.helpers import wait_for

MiB = 1 << 20


@pytest.fixture
def server():
    srv = stream.StreamServer("127.0.0.1", 0)
    yield srv
    srv.close()


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
    return buf, xxhash.xxh3_64(data.numpy().tobytes()).hexdigest()


def _nothing_sent(conn: socket.socket, timeout_s: float = 5.0) -> bool:
    """The producer closed `conn` without a byte of data."""
    conn.settimeout(timeout_s)
    try:
        return conn.recv(1) == b""
    except ConnectionResetError:
        return True


def _serve_once(server: stream.StreamServer, ticket: bytes, buf, nbytes: int) -> threading.Thread:
    """A serve thread: the pull with `ticket` sends `buf` once its connection arrives."""
    def run() -> None:
        conn = server.take(ticket, time.monotonic() + 5)
        if conn is not None:
            try:
                stream.send(conn, buf, nbytes, time.monotonic() + 5)
            finally:
                server.release(conn)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_live_ticket_gets_the_bytes_verified_as_they_land(server, pool):
    src, digest = _item(pool, 9 * MiB + 123)
    dst = pool.allocate(10 * MiB, time.monotonic() + 1)
    ticket = stream.ticket()
    server.expect(ticket, time.monotonic() + 10)
    serve = _serve_once(server, ticket, src, src.nbytes)
    conn = stream.connect(*server.address, ticket, time.monotonic() + 2)
    assert conn is not None
    hasher, seen = xxhash.xxh3_64(), [0]
    view = dst.as_bytes()

    def landed(upto: int) -> None:
        hasher.update(view[seen[0]:upto])
        seen[0] = upto

    assert stream.receive(conn, dst, time.monotonic() + 5, landed) == src.nbytes
    serve.join(5)
    assert hasher.hexdigest() == digest and seen[0] == src.nbytes
    conn.close()
    assert wait_for(lambda: server._open == 0)


def test_the_connection_may_arrive_before_the_pull_makes_its_ticket_live(server, pool):
    src, _ = _item(pool, 2 * MiB)
    dst = pool.allocate(2 * MiB, time.monotonic() + 1)
    ticket = stream.ticket()
    conn = stream.connect(*server.address, ticket, time.monotonic() + 2)
    time.sleep(0.2)  # the Pull is still on its way over the side channel
    server.expect(ticket, time.monotonic() + 10)
    _serve_once(server, ticket, src, src.nbytes).join(5)
    assert stream.receive(conn, dst, time.monotonic() + 5) == src.nbytes
    assert bytes(dst.as_bytes()) == bytes(src.as_bytes())


def test_wrong_absent_reused_and_expired_tickets_get_no_bytes(server, pool, monkeypatch):
    monkeypatch.setattr(stream, "_HANDSHAKE_S", 0.3)
    src, _ = _item(pool, 1 * MiB)
    dst = pool.allocate(1 * MiB, time.monotonic() + 1)
    ticket = stream.ticket()
    server.expect(ticket, time.monotonic() + 10)
    wrong = stream.connect(*server.address, stream.ticket(), time.monotonic() + 2)
    near = stream.connect(*server.address, ticket[:-1] + bytes([ticket[-1] ^ 1]),
                          time.monotonic() + 2)
    silent = socket.create_connection(server.address, timeout=2)  # presents nothing
    short = socket.create_connection(server.address, timeout=2)
    short.sendall(ticket[:16])  # half a ticket, then nothing
    t0 = time.monotonic()
    for conn in (wrong, near, silent, short):
        assert _nothing_sent(conn)
    assert time.monotonic() - t0 < 2  # closed after the handshake deadline, not held open
    # the pull still works with its own ticket, once
    _serve_once(server, ticket, src, src.nbytes)
    first = stream.connect(*server.address, ticket, time.monotonic() + 2)
    assert stream.receive(first, dst, time.monotonic() + 5) == src.nbytes
    reused = stream.connect(*server.address, ticket, time.monotonic() + 2)
    assert _nothing_sent(reused)
    stale = stream.ticket()
    server.expect(stale, time.monotonic() - 0.01)  # its pull's deadline has passed
    late = stream.connect(*server.address, stale, time.monotonic() + 2)
    assert _nothing_sent(late)
    assert server.refused == 6
    assert wait_for(lambda: server._open == 0)


def test_a_dropped_ticket_closes_its_waiting_connection(server):
    ticket = stream.ticket()
    server.expect(ticket, time.monotonic() + 10)
    conn = stream.connect(*server.address, ticket, time.monotonic() + 2)
    assert wait_for(lambda: server._slots and next(iter(server._slots.values())).conn)
    server.drop(ticket)  # its pull failed (unknown item, ...): no bytes
    assert _nothing_sent(conn)
    assert server.take(ticket, time.monotonic() + 0.05) is None
    assert server._open == 0


def test_open_data_connections_are_bounded(server, monkeypatch):
    monkeypatch.setattr(stream, "_MAX_CONNECTIONS", 2)
    monkeypatch.setattr(stream, "_HANDSHAKE_S", 3.0)
    held = [socket.create_connection(server.address, timeout=2) for _ in range(2)]
    assert wait_for(lambda: server._open == 2)
    extra = socket.create_connection(server.address, timeout=2)
    t0 = time.monotonic()
    assert _nothing_sent(extra) and time.monotonic() - t0 < 1  # at once, not after 3 s
    for conn in held:
        conn.close()


def _fake_producer(script):
    """A listener that runs `script(conn)` on the first connection (after its ticket)."""
    lsock = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        conn, _ = lsock.accept()
        conn.recv(stream.TICKET_BYTES)
        try:
            script(conn)
        finally:
            conn.close()
            lsock.close()

    threading.Thread(target=run, daemon=True).start()
    return lsock.getsockname()


@pytest.mark.parametrize("case", ["short", "oversized", "stalls"])
def test_a_bad_stream_fails_the_read_and_never_writes_past_the_buffer(pool, case):
    dst = pool.allocate(1 * MiB, time.monotonic() + 1)
    guard = pool.allocate(1 * MiB, time.monotonic() + 1)  # the next block: must stay intact
    guard.write(torch.full((1 * MiB,), 7, dtype=torch.uint8))
    stalls = threading.Event()

    def script(conn: socket.socket) -> None:
        if case == "short":
            conn.sendall(struct.pack("<Q", 1 * MiB) + b"x" * 1000)
        elif case == "oversized":
            conn.sendall(struct.pack("<Q", 2 * MiB) + b"x" * (2 * MiB))
        else:
            conn.sendall(struct.pack("<Q", 1 * MiB) + b"x" * 1000)
            stalls.wait(5)

    addr = _fake_producer(script)
    conn = stream.connect(*addr, stream.ticket(), time.monotonic() + 2)
    t0 = time.monotonic()
    with pytest.raises(stream.StreamError,
                       match={"short": "ended after 1000 of", "oversized": "announced",
                              "stalls": "timed out"}[case]):
        stream.receive(conn, dst, time.monotonic() + 0.5)
    stalls.set()
    assert time.monotonic() - t0 < 1.5
    assert bytes(guard.as_bytes()) == b"\x07" * MiB


def test_nobody_listening_means_an_engine_pull():
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    lsock.close()
    assert stream.connect("127.0.0.1", port, stream.ticket(), time.monotonic() + 1) is None
