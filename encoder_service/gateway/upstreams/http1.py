"""A lean HTTP/1.1 client for the decode hop: kept-alive connections, httptools' parser.

The decode hop sits on every request's path, and a general client (aiohttp) spends more per
request in its own Python than a proxy's whole hop (docs/benchmarks.md, gateway hop). This
client does only what the hop needs: one request per connection at a time over asyncio
protocols, answers parsed by httptools (a uvicorn dependency, C), bodies read whole or as
they arrive (streams), connections kept alive per origin for `keepalive_s` (less than the
servers' own keep-alive, so a request is never sent on one the server is closing).

Errors say what the caller may retry: `ConnectFailed` (nothing was sent), `Disconnected` (a
kept-alive connection closed before any answer: the server may have closed it as we sent),
`ProtocolFailed` (a broken answer or connection after the request went out), `Stalled`
(nothing of the body for `read_s`), and `TimeoutError` (connect, the answer's head within
`read_s`, or a whole body's deadline).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

# Buffered body bytes above which the connection stops reading (a slow client downstream).
HIGH_WATER = 1 << 20
MAX_HEAD = 64 << 10  # bytes of answer headers


class HttpError(Exception):
    """The decode hop's connection failed (a subclass says how)."""


class ConnectFailed(HttpError):
    """No connection: nothing was sent."""


class Disconnected(HttpError):
    """The server closed the connection before answering."""


class ProtocolFailed(HttpError):
    """The answer was malformed or broke off."""


class Stalled(HttpError):
    """Nothing of the body arrived for `read_s`."""


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Conn(asyncio.Protocol):
    """One connection and the answer now arriving on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._waiter: asyncio.Future | None = None
        self._start()

    def _start(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = self.done = self.any_data = False
        self.error: HttpError | None = None
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.reusable = False
        self.head_bytes = 0

    # -- asyncio.Protocol --------------------------------------------------------------------
    def close(self) -> None:
        """Close the connection (idempotent)."""
        if not self.closed:
            self.closed = True
            self.transport.close()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.done and self.error is None:
            self.error = (ProtocolFailed(f"connection broke off: {exc or 'closed'}")
                          if self.any_data else Disconnected("closed before answering"))
        self._wake()

    def data_received(self, data: bytes) -> None:
        self.any_data = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:  # a callback's own error rides inside
            inner = exc.__context__
            self.error = inner if isinstance(inner, ProtocolFailed) else ProtocolFailed(
                f"malformed answer: {exc}")
            self.transport.close()
        self._wake()

    # -- httptools callbacks -----------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value)
        if self.head_bytes > MAX_HEAD:  # an upstream is not trusted with our memory either
            raise ProtocolFailed(f"answer headers over {MAX_HEAD} bytes")
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.done = True
        self.reusable = self.parser.should_keep_alive()

    # -- waiting -----------------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, timeout_s: float | None) -> None:
        """Until something arrives or the connection ends; TimeoutError after `timeout_s`.

        A timer on the waiter rather than `asyncio.timeout`: no task cancellation to undo,
        the cheaper of the two on a path taken twice per request."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = None if timeout_s is None else loop.call_later(timeout_s, _expire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def take(self) -> bytes:
        data = b"".join(self.body) if len(self.body) != 1 else self.body[0]
        self.body.clear()
        self.buffered = 0
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data


class Response:
    """An answer whose head arrived; its body is read with `read()` or `chunks()`.

    The caller must `release()` it: the connection goes back to the pool when the body was
    read to the end, else it is closed (the server then aborts the request)."""

    def __init__(self, pool: Http1Pool, key: tuple, conn: _Conn, read_s: float | None) -> None:
        self._pool, self._key, self._conn, self._read_s = pool, key, conn, read_s
        self.status = conn.status
        self.headers = conn.headers
        self._released = False

    async def chunks(self, deadline: float | None = None) -> AsyncIterator[bytes]:
        """The body as it arrives, until its end; raises `HttpError` or `TimeoutError`.

        `deadline` (time.monotonic()): the whole body's, beside `read_s` between arrivals."""
        c = self._conn
        while True:
            if c.body:
                yield c.take()
                continue
            if c.done:
                return
            if c.error is not None:
                raise c.error
            wait, stalled = self._read_s, True
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError()
                if wait is None or left < wait:
                    wait, stalled = left, False
            try:
                await c.wait(wait)
            except TimeoutError:
                if stalled:
                    raise Stalled(f"nothing arrived for {wait:g} s") from None
                raise

    async def read(self, timeout_s: float | None = None) -> bytes:
        """The whole body, within `timeout_s` (None: `read_s` between arrivals only)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        parts = [chunk async for chunk in self.chunks(deadline)]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Back to the pool when read to the end (and kept alive), else closed; idempotent."""
        if self._released:
            return
        self._released = True
        c = self._conn
        if c.done and not c.body and c.reusable and not c.closed:
            self._pool._give_back(self._key, c)
        else:
            c.close()


class Http1Pool:
    """Kept-alive HTTP/1.1 connections per origin (scheme, host, port); one event loop.

    `headers`: sent with every request (the servers' API key); `read_s`: the longest wait for
    the answer's head and between body arrivals, None for none."""

    def __init__(self, connect_s: float, read_s: float | None, keepalive_s: float = 4.0,
                 headers: dict[str, str] | None = None) -> None:
        self.connect_s, self.read_s, self.keepalive_s = connect_s, read_s, keepalive_s
        self._fixed = b"".join(b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1"))
                               for k, v in (headers or {}).items())
        self._idle: dict[tuple, list[_Conn]] = {}
        self._origins: dict[str, tuple] = {}
        self._live: dict[tuple, int] = {}  # origin -> how many of the URLs above name it

    def _origin(self, url: str) -> tuple:
        """(scheme, host, port, host header) of a base URL, cached."""
        key = self._origins.get(url)
        if key is None:
            u = urlsplit(url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ConnectFailed(f"not an http(s) URL: {url!r}")
            port = u.port or (443 if u.scheme == "https" else 80)
            key = (u.scheme, u.hostname, port, u.netloc.encode("idna"))
            self._origins[url] = key
            self._live[key] = self._live.get(key, 0) + 1
        return key

    async def _connect(self, key: tuple) -> _Conn:
        scheme, host, port, _ = key
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await loop.create_connection(
                    _Conn, host, port, ssl=ssl.create_default_context()
                    if scheme == "https" else None)
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {host}:{port}: {exc}") from None
        return conn

    def _reuse(self, key: tuple) -> _Conn | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    def _give_back(self, key: tuple, conn: _Conn) -> None:
        if key not in self._live:  # its origin left while this answer was out
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(key, []).append(conn)

    async def request(self, method: str, base_url: str, path: str, body: bytes | None,
                      headers: dict[str, str]) -> Response:
        """Send a request and return once the answer's head arrived.

        Raises `ConnectFailed`, `Disconnected` (a reused connection closed before answering),
        `ProtocolFailed` or `TimeoutError`."""
        key = self._origin(base_url)
        conn = self._reuse(key) or await self._connect(key)
        conn._start()
        head = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method.encode(), path.encode(), key[3]),
                self._fixed]
        head.extend(b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1"))
                    for k, v in headers.items())
        if body is not None:
            head.append(b"content-length: %d\r\n\r\n" % len(body))
            head.append(body)
        else:
            head.append(b"\r\n")
        conn.transport.write(b"".join(head))
        try:
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait(self.read_s)
        except BaseException:
            conn.close()
            raise
        return Response(self, key, conn, self.read_s)

    def forget(self, base_url: str) -> None:
        """Close the idle connections to an origin that left the pool, and forget its URL.

        (Answers still out from it close when released.)"""
        key = self._origins.pop(base_url, None)
        if key is None:
            return  # never used
        self._live[key] -= 1
        if self._live[key]:
            return  # another URL names the same origin
        del self._live[key]
        for conn in self._idle.pop(key, []):
            conn.close()

    def close(self) -> None:
        """Close every idle connection (answers still out close when released)."""
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
