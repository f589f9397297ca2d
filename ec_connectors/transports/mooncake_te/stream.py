"""The socket data path of the Mooncake TE transport (`te_data_path`: socket, the default over
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

Producer: `StreamServer` (the listener, tickets, handshakes, a thread per served connection)
and `send_reply`. Consumer: `Connections` and `pull`. Every socket operation has a timeout.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import select
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch

from ec_connectors.channel import encode
from ec_connectors.log import get_logger
from ec_connectors.protocol.lru import BoundedLRU
from ec_connectors.transports.memory import PoolBuffer
from ec_connectors.transports.mooncake_te.messages import Pull, Pulled, PullFailed

logger = get_logger(__name__)

TICKET_BYTES = 32
READY = b"EPD\x01"  # a served connection's first bytes: its ticket was live
_FRAME = struct.Struct("<I")  # a message's size, then its msgpack
_MAX_FRAME = 64 << 10  # requests and replies are a few hundred bytes: more is garbage
_HANDSHAKE_S = 2.0  # an accepted connection must present a live ticket within this
_TICKET_S = 10.0  # a ticket sent over the side channel is live this long
_MAX_TICKETS = 4096  # live tickets; the oldest die first beyond this
_MAX_CONNECTIONS = 128  # open data connections (handshaking or served)
_SERVER_IDLE_S = 120.0  # a producer closes a connection that brings no request for this long
_ACCEPT_POLL_S = 0.25  # how often the accept loop looks at handshake deadlines
# recv_into at most this much at a time and hash it at once, while it is still in the cache
# (256 KiB, 1 and 4 MiB measured the same within this host's noise at 30 MiB; kernel socket
# buffers left to autotuning: fixed 4 MiB ones did not measurably help either)
RECV_CHUNK = 1 << 20
_HOST_CHUNK = 8 << 20  # a device pool's item goes out through host copies of this size
PER_PRODUCER = 4  # a consumer's data connections to one producer, pulls in parallel
IDLE_S = 30.0  # a consumer closes a connection unused this long (before the producer does)
CONNECT_S = 2.0  # a data connection opens (connect, ticket, READY) within this

_reply_decoder = msgspec.msgpack.Decoder(Pulled | PullFailed)
_request_decoder = msgspec.msgpack.Decoder(Pull)


class StreamError(RuntimeError):
    """A data connection failed, stalled or sent garbage; it is closed, never reused."""


class StreamClosed(StreamError):
    """The peer closed the connection before a byte of its reply: the request may never
    have been read (a warm connection the producer had closed), so it may be asked again on
    a fresh one."""


def ticket() -> bytes:
    """A fresh one-time ticket for one data connection."""
    return os.urandom(TICKET_BYTES)


def _key(ticket_: bytes) -> bytes:
    # the table is looked up by a hash of the ticket, so lookups time nothing of it
    return hashlib.sha256(ticket_).digest()


def _nodelay(conn: socket.socket) -> None:
    # requests and failure replies are one small write each: never held back for an ACK
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclass
class _Hello:
    """A connection still presenting its ticket (or waiting for it to become live)."""

    conn: socket.socket
    deadline: float
    ticket: bytearray = field(default_factory=lambda: bytearray(TICKET_BYTES))
    got: int = 0


class StreamServer:
    """A producer's stream listener: accepts data connections and serves each that presents
    a live ticket (`expect` makes one live) with `serve(conn)` on a thread of its own until
    it returns; at most `_MAX_CONNECTIONS` open at once. One thread accepts and reads every
    ticket (non-blocking, a selector): no thread per connection that has not proved one."""

    def __init__(self, host: str, port: int,
                 serve: Callable[[socket.socket], None] | None = None) -> None:
        self._serve = serve
        self._sock = socket.create_server((host, port), backlog=128)
        self._sock.setblocking(False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]  # port 0: the one given
        self._tickets: BoundedLRU[bytes, tuple[bytes, float]] = BoundedLRU(_MAX_TICKETS)
        self._presented: dict[bytes, _Hello] = {}  # full tickets not live yet (StreamOpen lags)
        self._lock = threading.Lock()
        self._open = 0
        self._active: set[socket.socket] = set()  # served
        self._stop = False
        self.refused = 0  # connections closed without data: no live ticket, or too many
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._wake, self._waker = socket.socketpair()  # close() interrupts the select
        self._sel.register(self._wake, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="epd-stream-accept",
                                        daemon=True)
        self._thread.start()

    def set_serve(self, serve: Callable[[socket.socket], None]) -> None:
        self._serve = serve

    def expect(self, ticket_: bytes, ttl_s: float = _TICKET_S) -> None:
        """Make `ticket_` live for `ttl_s` (or until a connection presents it)."""
        if len(ticket_) != TICKET_BYTES:
            return
        key = _key(ticket_)
        with self._lock:
            hello = self._presented.pop(key, None)
            if hello is None or not hmac.compare_digest(bytes(hello.ticket), ticket_):
                if hello is not None:
                    self._presented[key] = hello
                self._tickets[key] = (ticket_, time.monotonic() + ttl_s)
                return
        self._start(hello.conn)  # it came before its StreamOpen

    def release(self, conn: socket.socket) -> None:
        with self._lock:
            self._open -= 1
            self._active.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    def _refuse(self, conn: socket.socket) -> None:
        self.refused += 1
        self.release(conn)

    def _start(self, conn: socket.socket) -> None:
        with self._lock:
            if self._stop or self._serve is None:
                refuse = True
            else:
                refuse = False
                self._active.add(conn)
        if refuse:
            self._refuse(conn)
            return
        conn.setblocking(True)  # it was read without blocking; its user sets timeouts
        threading.Thread(target=self._run_serve, args=(conn,), name="epd-stream-serve",
                         daemon=True).start()

    def _run_serve(self, conn: socket.socket) -> None:
        try:
            _nodelay(conn)
            self._serve(conn)
        except Exception:  # a bug must not leak the connection; the consumer sees it close
            logger.exception("EPD: serving a data connection failed")
        finally:
            self.release(conn)

    def _run(self) -> None:
        hellos: dict[socket.socket, _Hello] = {}
        try:
            while not self._stop:
                soonest = min((h.deadline for h in hellos.values()), default=float("inf"))
                with self._lock:
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
            with self._lock:
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
        """Read what there is of `hello`'s ticket; a whole live one gets its connection
        served (or it waits for its StreamOpen), a closed or broken connection is dropped."""
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
        self._sel.unregister(hello.conn)  # its serve thread reads it from now on
        presented = bytes(hello.ticket)
        key = _key(presented)
        with self._lock:
            live = self._tickets.pop(key, None)
            if live is None and key not in self._presented:
                self._presented[key] = hello  # its StreamOpen may still be on its way
                return
        if live is not None and hmac.compare_digest(live[0], presented) \
                and time.monotonic() <= live[1]:
            self._start(hello.conn)
        else:
            self._refuse(hello.conn)

    def _expire(self, hellos: dict[socket.socket, _Hello]) -> None:
        now = time.monotonic()
        for conn in [c for c, h in hellos.items() if h.deadline <= now]:
            del hellos[conn]
            self._sel.unregister(conn)
            self._refuse(conn)
        with self._lock:
            late = [k for k, h in self._presented.items() if h.deadline <= now]
            stale = [self._presented.pop(k) for k in late]
            for k in [k for k, (_, until) in self._tickets.items() if until < now]:
                del self._tickets[k]
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
        with self._lock:
            presented, self._presented = list(self._presented.values()), {}
            self._tickets.clear()
            for conn in self._active:  # a request or send in flight fails at once
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        for hello in presented:
            self.release(hello.conn)


# -- producer: a served connection ------------------------------------------------------------
def read_request(conn: socket.socket, idle_s: float = _SERVER_IDLE_S) -> Pull | None:
    """The next request on a served connection (waited for up to `idle_s`), or None when
    the connection is over: closed, idle, or garbage (not a Pull); the caller closes it."""
    try:
        return _request_decoder.decode(_read_frame(conn, time.monotonic() + idle_s,
                                                   _HANDSHAKE_S))
    except (OSError, StreamError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def send_reply(conn: socket.socket, reply: Pulled | PullFailed, deadline: float,
               buf: PoolBuffer | None = None) -> None:
    """`reply`, then (a `Pulled` with `buf`) the item's `reply.info.nbytes` bytes from `buf`
    (a CPU pool block: straight from its memory, no copy; a device pool's through host
    copies), all by `deadline`. Raises OSError or StreamError."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise StreamError("the pull's deadline passed before its reply was sent")
    conn.settimeout(left)  # sendall's timeout bounds the whole call
    body = encode(reply)
    head = _FRAME.pack(len(body)) + body
    if buf is None:
        conn.sendall(head)
        return
    nbytes = reply.info.nbytes
    raw = buf.as_tensor(torch.uint8, (nbytes,))
    if raw.device.type == "cpu":
        data = buf.as_bytes()[:nbytes]
        sent = conn.sendmsg([head, data])  # one call for the reply and the first bytes
        if sent < len(head):
            conn.sendall(head[sent:])
            sent = len(head)
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        conn.sendall(data[sent - len(head):])
    else:
        conn.sendall(head)
        for start in range(0, nbytes, _HOST_CHUNK):
            host = raw[start:start + _HOST_CHUNK].cpu().numpy()
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            conn.sendall(memoryview(host))


# -- consumer -----------------------------------------------------------------------------------
def connect(host: str, port: int, ticket_: bytes, deadline: float) -> socket.socket | None:
    """A served data connection to a producer's stream port (`ticket_` presented, `READY`
    read); None when nobody listens there or it refused the connection without a byte (a
    producer on the engine path, or one at its connection bound): its pulls go the engine
    way. Raises StreamError when the producer does not answer by `deadline` (frozen)."""
    try:
        conn = socket.create_connection((host, port),
                                        timeout=max(0.001, deadline - time.monotonic()))
    except OSError:  # refused, unreachable, timed out
        return None
    try:
        _nodelay(conn)
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        conn.sendall(ticket_)
        if _read_exactly(conn, len(READY), deadline) == READY:
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
    """A consumer's warm data connections to one producer: at most `limit`, one pull at a
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
        """(a connection, whether it was idle in the pool), or (None, False) when the
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
        with self._cond:
            self._close_idle(time.monotonic() - self._idle_s)

    def _close_idle(self, cutoff: float) -> None:
        old = [c for c, since in self._idle if since < cutoff]
        self._idle = [(c, since) for c, since in self._idle if since >= cutoff]
        for conn in old:
            conn.close()

    @property
    def idle(self) -> int:
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
    """Ask for `request` on a served connection and read the reply; a `Pulled` brings the
    item's bytes, read into `buf` (a CPU pool block; never more than it holds, whatever the
    reply says) with `on_chunk(bytes so far)` as they land. (reply, bytes read). Raises
    StreamClosed (closed before any reply byte), StreamError (garbage, short, oversized,
    timed out) or OSError: the connection is then unusable."""
    body = encode(request)
    conn.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        conn.sendall(_FRAME.pack(len(body)) + body)
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise StreamClosed(f"the connection was closed: {exc}") from exc
    try:
        reply = _reply_decoder.decode(_read_frame(conn, deadline))
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
    return reply, got


def _read_frame(conn: socket.socket, deadline: float, then_s: float | None = None) -> bytes:
    """One `<u32 n><n bytes>` frame by `deadline` (its rest within `then_s` of its first
    byte, when given). StreamClosed when the peer closed before its first byte."""
    head = _read_exactly(conn, _FRAME.size, deadline)
    n = _FRAME.unpack(head)[0]
    if n > _MAX_FRAME:
        raise StreamError(f"a {n}-byte message (at most {_MAX_FRAME})")
    if then_s is not None:
        deadline = time.monotonic() + then_s
    try:
        return _read_exactly(conn, n, deadline)
    except StreamClosed as exc:
        raise StreamError(str(exc)) from exc


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
        except ConnectionResetError as exc:
            if got == 0:
                raise StreamClosed(f"the connection was reset: {exc}") from exc
            raise
        if k == 0:
            if got == 0:
                raise StreamClosed("the connection was closed")
            raise StreamError(f"the stream ended after {got} of {n} bytes")
        got += k
    return bytes(data)
