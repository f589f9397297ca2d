"""The socket data path of the Mooncake TE transport.

The socket data path of the Mooncake TE transport (`te_data_path`: socket, the default over
TCP): a consumer pulls an item over a TCP connection of its own to the producer's stream port
instead of having the engine write it, whose TCP transport (a fresh connection per write,
64 KiB reads) moves less than half what one socket stream does (docs/transports.md). Over
RDMA the engine stays: the network card writes into the consumer's pool with no socket copy
on either host.

Connections are warm: a consumer keeps a few open per producer (`Connections`) and runs one
pull at a time on each, so a pull is one request and one reply on one socket, with no
connect, no accept, no side-channel hop and no serve thread to wake (a 30 MiB pull spent more
waiting for those on a small host than moving its bytes).

Who may use a connection: the consumer sends a fresh random ticket over the side channel
(`messages.StreamOpen`; CURVE with a deployment secret), then connects to the producer's
stream port and presents it first. The producer serves that connection only if the ticket is
live (single use, dead once presented or after `_TICKET_S`); one that presents no live ticket
within `_HANDSHAKE_S` is closed without a byte sent. A served connection gets `READY`, then
carries requests: `<u32 n><msgpack Pull>`, each answered `<u32 n><msgpack Pulled |
PullFailed>`, a `Pulled` followed by exactly the item's bytes, which the consumer reads into
its own pool block (never past the block it allocated, whatever the peer says) and verifies
against the reply's digest before anything uses them. Nothing is written into the consumer's
memory from outside on this path, so its buffer is free again as soon as the pull ends,
whatever the outcome. A connection on which anything goes wrong (a timeout, a short stream,
a frame that is not what was asked) is closed and never used again.

This module holds what both ends share: tickets, framing, reads with deadlines and the
errors. Producer: stream_server.py (`StreamServer`: the listener, tickets, handshakes, a
thread per served connection; `send_reply`). Consumer: stream_client.py (`Connections`,
`pull`). Every socket operation has a timeout.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Callable

import msgspec

from ec_connectors.channel import encode

TICKET_BYTES = 32
READY = b"EPD\x01"  # a served connection's first bytes: its ticket was live
FRAME = struct.Struct("<I")  # a message's size, then its msgpack
MAX_FRAME = 64 << 10  # requests and replies are a few hundred bytes: more is garbage


class StreamError(RuntimeError):
    """A data connection failed, stalled or sent garbage; it is closed, never reused."""


class StreamClosed(StreamError):
    """The peer closed the connection before replying; the request may be retried.

    The peer closed the connection before a byte of its reply: the request may never
    have been read (a warm connection the producer had closed), so it may be asked again on
    a fresh one."""


def ticket() -> bytes:
    """A fresh one-time ticket for one data connection."""
    return os.urandom(TICKET_BYTES)


def nodelay(conn: socket.socket) -> None:
    """Send small writes at once on `conn` (no Nagle delay)."""
    # requests and failure replies are one small write each: never held back for an ACK
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def frame(message: msgspec.Struct) -> bytes:
    """`message` as one `<u32 n><msgpack>` frame."""
    body = encode(message)
    return FRAME.pack(len(body)) + body


def read_frame(conn: socket.socket, deadline: float, then_s: float | None = None) -> bytes:
    """Read one length-prefixed frame by a deadline.

    One `<u32 n><n bytes>` frame by `deadline` (its rest within `then_s` of its first
    byte, when given). StreamClosed when the peer closed before its first byte."""
    head = read_exactly(conn, FRAME.size, deadline)
    n = FRAME.unpack(head)[0]
    if n > MAX_FRAME:
        raise StreamError(f"a {n}-byte message (at most {MAX_FRAME})")
    if then_s is not None:
        deadline = time.monotonic() + then_s
    try:
        return read_exactly(conn, n, deadline)
    except StreamClosed as exc:
        raise StreamError(str(exc)) from exc


def recv_exactly(conn: socket.socket, view: memoryview, n: int, deadline: float,
                 chunk: int | None = None, on_chunk: Callable[[int], None] | None = None
                 ) -> None:
    """Read exactly `n` bytes from a socket into a view by a deadline.

    Read exactly `n` bytes into `view` by `deadline`, at most `chunk` per read, calling
    `on_chunk(bytes so far)` after each. StreamClosed when the peer closed (or reset) before
    the first byte; StreamError when it stalls or ends short."""
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StreamError(f"timed out after {got} of {n} bytes")
        conn.settimeout(left)
        try:
            k = conn.recv_into(view[got:n if chunk is None else min(n, got + chunk)])
        except TimeoutError as exc:
            raise StreamError(f"timed out after {got} of {n} bytes") from exc
        except ConnectionResetError as exc:
            if got == 0:
                raise StreamClosed(f"the connection was reset: {exc}") from exc
            raise
        if k == 0:
            if got == 0:
                raise StreamClosed("the connection was closed")
            raise StreamError(f"the stream ended after {got} of {n} bytes")
        got += k
        if on_chunk is not None:
            on_chunk(got)


def read_exactly(conn: socket.socket, n: int, deadline: float) -> bytes:
    """Exactly `n` bytes from `conn` by `deadline` (recv_exactly's errors)."""
    data = bytearray(n)
    recv_exactly(conn, memoryview(data), n, deadline)
    return bytes(data)
