"""Producer side of the TE socket data path: the stream listener and its I/O.

Producer side of the TE socket data path (stream.py has the protocol): `StreamServer`
accepts data connections on the stream port, serves each that presents a live ticket on a
thread of its own; `read_request` and `send_reply` are that thread's reads and writes."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch

from ec_connectors.log import get_logger
from ec_connectors.transports.memory import PoolBuffer
from ec_connectors.transports.mooncake_te.stream import (
    TICKET_BYTES,
    StreamError,
    frame,
    nodelay,
    read_frame,
)
from ec_connectors.transports.peer_pull.messages import Pull, Pulled, PullFailed
from epd_common.lru import BoundedLRU

logger = get_logger(__name__)

_HANDSHAKE_S = 2.0  # an accepted connection must present a live ticket within this
_TICKET_S = 10.0  # a ticket sent over the side channel is live this long
_MAX_TICKETS = 4096  # live tickets; the oldest die first beyond this
_MAX_CONNECTIONS = 128  # open data connections (handshaking or served)
_SERVER_IDLE_S = 120.0  # a producer closes a connection that brings no request for this long
_ACCEPT_POLL_S = 0.25  # how often the accept loop looks at handshake deadlines
_HOST_CHUNK = 8 << 20  # a device pool's item goes out through host copies of this size

_request_decoder = msgspec.msgpack.Decoder(Pull)


def _key(ticket_: bytes) -> bytes:
    # the table is looked up by a hash of the ticket, so lookups time nothing of it
    return hashlib.sha256(ticket_).digest()


@dataclass
class _Hello:
    """A connection still presenting its ticket (or waiting for it to become live)."""

    conn: socket.socket
    deadline: float
    ticket: bytearray = field(default_factory=lambda: bytearray(TICKET_BYTES))
    got: int = 0


class StreamServer:
    """A producer's stream listener that serves ticketed data connections.

    A producer's stream listener: accepts data connections and serves each that presents
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
        """Serve accepted connections with `serve(conn)` from now on."""
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
        """Close a data connection and stop counting it."""
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
            nodelay(conn)
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
        """Read a connection's ticket and serve it once the ticket is whole and live.

        Read what there is of `hello`'s ticket; a whole live one gets its connection
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
        """Stop accepting; open connections' requests and sends fail at once."""
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


def read_request(conn: socket.socket, idle_s: float = _SERVER_IDLE_S) -> Pull | None:
    """Read the next pull request on a served connection.

    The next request on a served connection (waited for up to `idle_s`), or None when
    the connection is over: closed, idle, or garbage (not a Pull); the caller closes it."""
    try:
        return _request_decoder.decode(read_frame(conn, time.monotonic() + idle_s,
                                                   _HANDSHAKE_S))
    except (OSError, StreamError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def send_reply(conn: socket.socket, reply: Pulled | PullFailed, deadline: float,
               buf: PoolBuffer | None = None) -> None:
    """Send a reply and, for a `Pulled`, the item's bytes.

    `reply`, then (a `Pulled` with `buf`) the item's `reply.info.nbytes` bytes from `buf`
    (a CPU pool block: straight from its memory, no copy; a device pool's through host
    copies), all by `deadline`. Raises OSError or StreamError."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise StreamError("the pull's deadline passed before its reply was sent")
    conn.settimeout(left)  # sendall's timeout bounds the whole call
    head = frame(reply)
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
