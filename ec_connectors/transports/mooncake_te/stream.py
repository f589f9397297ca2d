"""The socket data path of the Mooncake TE transport (`te_data_path`: socket, the default over
TCP): a producer streams an item's bytes over a TCP connection of the consumer's instead of
writing them with the engine, whose TCP transport (a fresh connection per write, 64 KiB reads)
moves less than half what one socket stream does (docs/transports.md). Over RDMA the engine
stays: the network card writes into the consumer's pool with no socket copy on either host.

Who may take an item's bytes: the consumer puts a fresh random ticket into its `Pull`, which
travels over the side channel (CURVE with a deployment secret), then connects to the
producer's stream port and sends the ticket first. The producer hands that connection to the
one pull in flight with that exact ticket (single use, dead once the pull is served or its
deadline passed); a connection that presents no live ticket within `_HANDSHAKE_S` is closed
without a byte sent. The data connection carries nothing else: no commands, only
`<u64 nbytes>` and the item's bytes, which the consumer verifies against the digest the
side channel's `Pulled` carries. Nothing is written into the consumer's memory from outside
on this path, so its buffer is free again as soon as the pull ends, whatever the outcome.

Producer: `StreamServer` (the listener, tickets, handshakes) and `send`. Consumer: `connect`
and `receive`. Every socket operation has a timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ec_connectors.log import get_logger
from ec_connectors.transports.memory import PoolBuffer

logger = get_logger(__name__)

TICKET_BYTES = 32
_HEADER = struct.Struct("<Q")  # the item's size, then its bytes
_HANDSHAKE_S = 2.0  # an accepted connection must present a live ticket within this
_MAX_CONNECTIONS = 128  # open data connections (handshaking, waiting for a serve thread, sending)
_ACCEPT_POLL_S = 0.25  # how often the accept loop looks at handshake deadlines
# recv_into at most this much at a time and hash it at once, while it is still in the cache
# (256 KiB, 1 and 4 MiB measured the same within this host's noise at 30 MiB; kernel socket
# buffers left to autotuning: fixed 4 MiB ones did not measurably help either)
RECV_CHUNK = 1 << 20
_HOST_CHUNK = 8 << 20  # a device pool's item goes out through host copies of this size


class StreamError(RuntimeError):
    """A data connection failed or ended early; the pull fails, nothing is retried on it."""


def ticket() -> bytes:
    """A fresh one-time ticket for one pull."""
    return os.urandom(TICKET_BYTES)


def _key(ticket_: bytes) -> bytes:
    # the table is looked up by a hash of the ticket, so lookups time nothing of it
    return hashlib.sha256(ticket_).digest()


@dataclass
class _Slot:
    ticket: bytes
    expires: float
    conn: socket.socket | None = None


@dataclass
class _Hello:
    """A connection still presenting its ticket (or waiting for it to become live)."""

    conn: socket.socket
    deadline: float
    ticket: bytearray = field(default_factory=lambda: bytearray(TICKET_BYTES))
    got: int = 0


class StreamServer:
    """A producer's stream listener: accepts data connections, matches each to the pull whose
    ticket it presents (`expect` makes a ticket live, `take` waits for its connection, `drop`
    kills it), at most `_MAX_CONNECTIONS` open at once. One thread accepts and reads every
    ticket (non-blocking, a selector): no thread per connection, none to wake per pull."""

    def __init__(self, host: str, port: int) -> None:
        self._sock = socket.create_server((host, port), backlog=128)
        self._sock.setblocking(False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]  # port 0: the one given
        self._slots: dict[bytes, _Slot] = {}
        self._presented: dict[bytes, _Hello] = {}  # full tickets not live yet (the Pull lags)
        self._cond = threading.Condition()
        self._open = 0
        self._active: set[socket.socket] = set()  # taken by serve threads
        self._stop = False
        self.refused = 0  # connections closed without data: no live ticket, or too many
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._wake, self._waker = socket.socketpair()  # close() interrupts the select
        self._sel.register(self._wake, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="epd-stream-accept",
                                        daemon=True)
        self._thread.start()

    def expect(self, ticket_: bytes, expires: float) -> None:
        """Make `ticket_` live until `expires` (or until taken or dropped)."""
        if len(ticket_) != TICKET_BYTES:
            return
        key = _key(ticket_)
        with self._cond:
            slot = self._slots[key] = _Slot(ticket_, expires)
            hello = self._presented.pop(key, None)
            if hello is not None and hmac.compare_digest(bytes(hello.ticket), ticket_):
                slot.conn = hello.conn  # it came before its Pull
            elif hello is not None:
                self._presented[key] = hello
            self._cond.notify_all()

    def take(self, ticket_: bytes, deadline: float) -> socket.socket | None:
        """The connection that presented `ticket_`, waited for until `deadline`; the ticket is
        dead afterwards either way. The caller owns the socket: `release` it."""
        key = _key(ticket_)
        with self._cond:
            self._cond.wait_for(lambda: (s := self._slots.get(key)) is None or s.conn is not None,
                                max(0.0, deadline - time.monotonic()))
            slot = self._slots.pop(key, None)
            if slot is None or slot.conn is None:
                return None
            self._active.add(slot.conn)
        slot.conn.setblocking(True)  # it was read without blocking; its user sets timeouts
        return slot.conn

    def drop(self, ticket_: bytes) -> None:
        """Kill `ticket_` (its pull is over); a connection that presented it is closed."""
        with self._cond:
            slot = self._slots.pop(_key(ticket_), None)
        if slot is not None and slot.conn is not None:
            self.release(slot.conn)

    def release(self, conn: socket.socket) -> None:
        with self._cond:
            self._open -= 1
            self._active.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    def _refuse(self, conn: socket.socket) -> None:
        self.refused += 1
        self.release(conn)

    def _run(self) -> None:
        hellos: dict[socket.socket, _Hello] = {}
        try:
            while not self._stop:
                soonest = min((h.deadline for h in hellos.values()), default=float("inf"))
                with self._cond:
                    soonest = min([soonest, *(h.deadline for h in self._presented.values())])
                timeout = min(_ACCEPT_POLL_S, max(0.0, soonest - time.monotonic()))
                for key, _ in self._sel.select(timeout):
                    if key.fileobj is self._sock:
                        self._accept(hellos)
                    elif key.fileobj is self._wake:
                        return
                    else:
                        self._read_ticket(hellos.pop(key.fileobj), hellos)
                self._expire(hellos)
        finally:
            for hello in hellos.values():
                self._sel.unregister(hello.conn)
                self.release(hello.conn)
            self._sel.close()
            self._wake.close()

    def _accept(self, hellos: dict[socket.socket, _Hello]) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # e.g. out of descriptors: the next select tries again
                return
            with self._cond:
                full = self._open >= _MAX_CONNECTIONS
                self._open += 1
            if full:
                self._refuse(conn)
                continue
            conn.setblocking(False)
            hellos[conn] = _Hello(conn, time.monotonic() + _HANDSHAKE_S)
            self._sel.register(conn, selectors.EVENT_READ, None)
            self._read_ticket(hellos.pop(conn), hellos)  # usually there already

    def _read_ticket(self, hello: _Hello, hellos: dict[socket.socket, _Hello]) -> None:
        """Read what there is of `hello`'s ticket; a whole one goes to its pull (or waits for
        it to become live), a closed or broken connection is dropped."""
        try:
            n = hello.conn.recv_into(memoryview(hello.ticket)[hello.got:])
        except (BlockingIOError, InterruptedError):
            hellos[hello.conn] = hello
            return
        except OSError:
            n = 0
        if n == 0:
            self._sel.unregister(hello.conn)
            self._refuse(hello.conn)
            return
        hello.got += n
        if hello.got < TICKET_BYTES:
            hellos[hello.conn] = hello
            return
        self._sel.unregister(hello.conn)  # the connection carries nothing more inbound
        presented = bytes(hello.ticket)
        key = _key(presented)
        with self._cond:
            slot = self._slots.get(key)
            if slot is not None and slot.conn is None and not self._stop \
                    and hmac.compare_digest(slot.ticket, presented) \
                    and time.monotonic() <= slot.expires:
                slot.conn = hello.conn
                self._cond.notify_all()
                return
            if slot is None and key not in self._presented:
                self._presented[key] = hello  # its Pull may still be on its way
                return
        self._refuse(hello.conn)

    def _expire(self, hellos: dict[socket.socket, _Hello]) -> None:
        now = time.monotonic()
        for conn in [c for c, h in hellos.items() if h.deadline <= now]:
            del hellos[conn]
            self._sel.unregister(conn)
            self._refuse(conn)
        with self._cond:
            late = [k for k, h in self._presented.items() if h.deadline <= now]
            stale = [self._presented.pop(k) for k in late]
        for hello in stale:
            self._refuse(hello.conn)

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._waker.send(b"\0")
        self._thread.join(timeout=2 * _ACCEPT_POLL_S + 1)
        self._waker.close()
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._cond:
            slots, self._slots = list(self._slots.values()), {}
            presented, self._presented = list(self._presented.values()), {}
            for conn in self._active:  # a send in flight fails at once
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            self._cond.notify_all()
        for conn in [s.conn for s in slots if s.conn is not None] + [h.conn for h in presented]:
            self.release(conn)


def send(conn: socket.socket, buf: PoolBuffer, nbytes: int, deadline: float) -> None:
    """`<u64 nbytes>` and the first `nbytes` of `buf` (a CPU pool block: straight from its
    memory, no copy; a device pool's through host copies), by `deadline`. Raises OSError or
    StreamError."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise StreamError("the pull's deadline passed before its bytes were sent")
    conn.settimeout(left)  # sendall's timeout bounds the whole call
    header = _HEADER.pack(nbytes)
    raw = buf.as_tensor(torch.uint8, (nbytes,))
    if raw.device.type == "cpu":
        data = buf.as_bytes()[:nbytes]
        sent = conn.sendmsg([header, data])  # one call for the header and the first bytes
        if sent < len(header):
            conn.sendall(header[sent:])
            sent = len(header)
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        conn.sendall(data[sent - len(header):])
    else:
        conn.sendall(header)
        for start in range(0, nbytes, _HOST_CHUNK):
            host = raw[start:start + _HOST_CHUNK].cpu().numpy()
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            conn.sendall(memoryview(host))
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)  # the consumer reads to the count; a FIN, not a reset


def connect(host: str, port: int, ticket_: bytes, deadline: float) -> socket.socket | None:
    """A data connection to a producer's stream port, its ticket sent; None when nobody
    listens there (a producer on the engine path, or an older one): its pull goes on as an
    engine pull."""
    try:
        conn = socket.create_connection((host, port),
                                        timeout=max(0.001, deadline - time.monotonic()))
    except OSError:  # refused, unreachable, timed out
        return None
    try:
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        conn.sendall(ticket_)
    except OSError:
        conn.close()
        return None
    return conn


def receive(conn: socket.socket, buf: PoolBuffer, deadline: float,
            on_chunk: Callable[[int], None] | None = None) -> int:
    """Read the item's size and then exactly that many bytes into `buf` (a CPU pool block;
    never more than it holds, whatever the peer says), calling `on_chunk(bytes so far)` as
    they land; the item's size. Raises StreamError (short, oversized, timed out) or OSError."""
    nbytes = _HEADER.unpack(_read_exactly(conn, _HEADER.size, deadline))[0]
    if nbytes > buf.nbytes:
        raise StreamError(f"the producer announced {nbytes} bytes for a {buf.nbytes}-byte "
                          "buffer")
    view = buf.as_bytes()
    got = 0
    while got < nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StreamError(f"timed out after {got} of {nbytes} bytes")
        conn.settimeout(left)
        try:
            n = conn.recv_into(view[got:min(nbytes, got + RECV_CHUNK)])
        except TimeoutError as exc:
            raise StreamError(f"timed out after {got} of {nbytes} bytes") from exc
        if n == 0:
            raise StreamError(f"the stream ended after {got} of {nbytes} bytes")
        got += n
        if on_chunk is not None:
            on_chunk(got)
    return nbytes


def _read_exactly(conn: socket.socket, n: int, deadline: float) -> bytes:
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StreamError(f"timed out after {got} of {n} bytes")
        conn.settimeout(left)
        try:
            k = conn.recv_into(view[got:])
        except TimeoutError as exc:
            raise StreamError(f"timed out after {got} of {n} bytes") from exc
        if k == 0:
            raise StreamError(f"the stream ended after {got} of {n} bytes")
        got += k
    return bytes(data)
