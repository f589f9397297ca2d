"""Consumer side of the TE socket data path: connections and pulls.

Consumer side of the TE socket data path (stream.py has the protocol): `Connections`
keeps a few warm data connections to one producer, `connect` opens one (ticket, `READY`),
`pull` runs one request and reads the item into the consumer's own pool block."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable

import msgspec

from ec_connectors.transports.memory import PoolBuffer
from ec_connectors.transports.mooncake_te.stream import (
    READY,
    StreamClosed,
    StreamError,
    frame,
    nodelay,
    read_exactly,
    read_frame,
    recv_exactly,
    ticket,
)
from ec_connectors.transports.peer_pull.messages import Pull, Pulled, PullFailed

# recv_into at most this much at a time and hash it at once, while it is still in the cache
# (other sizes measured the same, docs/benchmarks.md; kernel socket buffers are left to
# autotuning: fixed ones did not measurably help either)
RECV_CHUNK = 1 << 20
PER_PRODUCER = 4  # a consumer's data connections to one producer, pulls in parallel
IDLE_S = 30.0  # a consumer closes a connection unused this long (before the producer does)
CONNECT_S = 2.0  # a data connection opens (connect, ticket, READY) within this

_reply_decoder = msgspec.msgpack.Decoder(Pulled | PullFailed)


def connect(host: str, port: int, ticket_: bytes, deadline: float) -> socket.socket | None:
    """Open a served data connection to a producer's stream port.

    A served data connection to a producer's stream port (`ticket_` presented, `READY`
    read); None when nobody listens there or it refused the connection without a byte (a
    producer on the engine path, or one at its connection bound): its pulls go the engine
    way. Raises StreamError when the producer does not answer by `deadline` (frozen)."""
    try:
        conn = socket.create_connection((host, port),
                                        timeout=max(0.001, deadline - time.monotonic()))
    except OSError:  # refused, unreachable, timed out
        return None
    try:
        nodelay(conn)
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        conn.sendall(ticket_)
        if read_exactly(conn, len(READY), deadline) == READY:
            return conn
        conn.close()
        raise StreamError(f"{host}:{port} did not answer its ticket with {READY!r}")
    except StreamClosed:
        conn.close()
        return None
    except (OSError, StreamError) as exc:
        conn.close()
        raise StreamError(f"opening a data connection to {host}:{port}: {exc}") from exc


class Connections:
    """A consumer's pool of warm data connections to one producer.

    A consumer's warm data connections to one producer: at most `limit`, one pull at a
    time each; `acquire` hands out an idle one (or opens one: `announce(ticket)` sends its
    ticket over the side channel first), `release` takes it back (or closes it, unless it
    is still good), idle ones close after `idle_s`."""

    def __init__(self, host: str, port: int, announce: Callable[[bytes], None],
                 limit: int = PER_PRODUCER, idle_s: float = IDLE_S,
                 connect_s: float = CONNECT_S) -> None:
        self.address = (host, port)
        self._announce = announce
        self._limit, self._idle_s, self._connect_s = limit, idle_s, connect_s
        self._cond = threading.Condition()
        self._idle: list[tuple[socket.socket, float]] = []  # (connection, idle since)
        self._busy: set[socket.socket] = set()
        self._opening = 0  # connections being opened (they count against the limit)
        self._closed = False
        self.opened = 0  # connections opened so far (reuse shows as pulls > opened)

    def acquire(self, deadline: float, fresh: bool = False
                ) -> tuple[socket.socket | None, bool]:
        """Take a data connection for one pull, idle or newly opened.

        (a connection, whether it was idle in the pool), or (None, False) when the
        producer takes none (see `connect`). `fresh`: never an idle one. Raises StreamError
        when none is free by `deadline`, or one does not open by it (or `connect_s`)."""
        with self._cond:
            while True:
                self._close_idle(time.monotonic() - self._idle_s)
                if self._closed:
                    raise StreamError("closed")
                while self._idle and not fresh:
                    conn, _ = self._idle.pop()  # the most recently used: warmest
                    if _still_open(conn):
                        self._busy.add(conn)
                        return conn, True
                    conn.close()  # the producer closed it, or it sent something unasked
                if len(self._busy) + len(self._idle) + self._opening < self._limit:
                    break
                if fresh and self._idle:
                    self._idle.pop(0)[0].close()  # the oldest makes room
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StreamError(f"timed out: all {self._limit} data connections to "
                                      f"{self.address[0]}:{self.address[1]} stayed busy")
                self._cond.wait(left)
            self._opening += 1
        conn = None
        try:
            ticket_ = ticket()
            self._announce(ticket_)
            conn = connect(*self.address, ticket_,
                           min(deadline, time.monotonic() + self._connect_s))
            return conn, False
        finally:
            with self._cond:
                self._opening -= 1
                if conn is not None:
                    self.opened += 1
                    self._busy.add(conn)
                self._cond.notify()

    def release(self, conn: socket.socket, good: bool) -> None:
        """Back to the pool when `good` (its last reply read whole), else closed."""
        with self._cond:
            self._busy.discard(conn)
            if good and not self._closed:
                self._idle.append((conn, time.monotonic()))
            else:
                conn.close()
            self._cond.notify()

    def reap(self) -> None:
        """Close the connections idle past `idle_s`."""
        with self._cond:
            self._close_idle(time.monotonic() - self._idle_s)

    def _close_idle(self, cutoff: float) -> None:
        old = [c for c, since in self._idle if since < cutoff]
        self._idle = [(c, since) for c, since in self._idle if since >= cutoff]
        for conn in old:
            conn.close()

    @property
    def idle(self) -> int:
        """Idle connections in the pool now."""
        return len(self._idle)

    def close(self) -> None:
        """Close the idle connections now, the busy ones when their pulls end."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for conn, _ in idle:
            conn.close()


def _still_open(conn: socket.socket) -> bool:
    """An idle connection has nothing to read: readable means closed or garbage."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def pull(conn: socket.socket, request: Pull, buf: PoolBuffer, deadline: float,
         on_chunk: Callable[[int], None] | None = None) -> tuple[Pulled | PullFailed, int]:
    """Run one pull on a served connection, reading the item into a pool block.

    Ask for `request` on a served connection and read the reply; a `Pulled` brings the
    item's bytes, read into `buf` (a CPU pool block; never more than it holds, whatever the
    reply says) with `on_chunk(bytes so far)` as they land. (reply, bytes read). Raises
    StreamClosed (closed before any reply byte), StreamError (garbage, short, oversized,
    timed out) or OSError: the connection is then unusable."""
    conn.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        conn.sendall(frame(request))
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise StreamClosed(f"the connection was closed: {exc}") from exc
    try:
        reply = _reply_decoder.decode(read_frame(conn, deadline))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StreamError(f"a reply that is not one: {exc}") from exc
    if reply.pull_id != request.pull_id:
        raise StreamError(f"a reply to pull {reply.pull_id}, not {request.pull_id}")
    if isinstance(reply, PullFailed):
        return reply, 0
    nbytes = reply.info.nbytes
    if reply.inline or nbytes < 0 or nbytes > buf.nbytes:
        raise StreamError(f"the producer announced {nbytes} bytes for a {buf.nbytes}-byte "
                          "buffer")
    try:
        recv_exactly(conn, buf.as_bytes(), nbytes, deadline, RECV_CHUNK, on_chunk)
    except StreamClosed as exc:  # the reply came: an ended stream is short, not closed
        raise StreamError(str(exc)) from exc
    return reply, nbytes
