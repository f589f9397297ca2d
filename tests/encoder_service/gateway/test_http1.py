"""The decode hop's HTTP/1.1 client (http1.py) against raw asyncio servers on loopback that
answer as scripted, byte for byte: connections kept alive and reused, chunked streams as they
arrive, and each failure named for what the caller may retry (nothing sent, closed before
answering, broke off, stalled, oversized headers, a whole-body deadline)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from encoder_service.gateway.upstreams.http1 import (
    ConnectFailed,
    Disconnected,
    Http1Pool,
    ProtocolFailed,
    Stalled,
)

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], "asyncio.Future | None"]


@contextlib.asynccontextmanager
async def server(answer) -> AsyncIterator[tuple[str, list[bytes], list[int]]]:
    """A server that reads each request whole and lets `answer(writer, n)` reply to the n-th
    request on the connection; yields (url, requests seen, connections accepted)."""
    seen: list[bytes] = []
    conns: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(1)
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                seen.append(head + await reader.readexactly(length))
                if await answer(writer, n) is False:
                    break
                n += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", seen, conns
    finally:
        srv.close()


async def ok(writer, n):
    writer.write(OK)
    await writer.drain()


def run(coro):
    return asyncio.run(coro)


def test_connections_are_kept_alive_and_headers_sent():
    async def go():
        async with server(ok) as (url, seen, conns):
            pool = Http1Pool(1.0, 1.0, headers={"authorization": "Bearer k"})
            for _ in range(3):
                r = await pool.request("POST", url, "/v1/chat/completions", b'{"a":1}',
                                       {"x-request-id": "r1"})
                assert (r.status, r.headers["content-type"], await r.read()) == (
                    200, "application/json", b"{}")
                r.release()
            pool.close()
            assert len(conns) == 1  # one connection for all three
            assert seen[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
            assert b"authorization: Bearer k\r\n" in seen[0]
            assert b"x-request-id: r1\r\n" in seen[0] and seen[0].endswith(b'{"a":1}')
    run(go())


def test_a_chunked_stream_arrives_in_pieces_and_an_unread_one_is_not_reused():
    async def stream(writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def go():
        async with server(stream) as (url, _, conns):
            pool = Http1Pool(1.0, 1.0)
            r = await pool.request("POST", url, "/s", b"{}", {})
            got = [c async for c in r.chunks()]
            assert b"".join(got) == b"data: 1\n\ndata: 2\n\n" and len(got) >= 2
            r.release()
            r = await pool.request("POST", url, "/s", b"{}", {})  # reused: read to the end
            assert len(conns) == 1
            async for _ in r.chunks():
                break  # left unread: its connection must be closed, not reused
            r.release()
            r = await pool.request("POST", url, "/s", b"{}", {})
            assert await r.read() == b"data: 1\n\ndata: 2\n\n"
            r.release()
            assert len(conns) == 2
            pool.close()
    run(go())


def test_failures_are_named_for_what_may_be_retried():
    async def close_at_once(writer, n):
        return False

    async def break_off(writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nhalf")
        await writer.drain()
        return False

    async def stall(writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nhalf")
        await writer.drain()
        await asyncio.sleep(5)

    async def garbage(writer, n):
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()

    async def huge_headers(writer, n):
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"x-pad: " + b"a" * 70000 + b"\r\n\r\n")
        await writer.drain()

    async def silent(writer, n):
        await asyncio.sleep(5)

    async def go():
        pool = Http1Pool(1.0, 0.3)
        with pytest.raises(ConnectFailed):  # nothing listens there
            srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
            port = srv.sockets[0].getsockname()[1]
            srv.close()
            await srv.wait_closed()
            await pool.request("POST", f"http://127.0.0.1:{port}", "/", b"", {})
        async with server(close_at_once) as (url, _, _):
            with pytest.raises(Disconnected):
                await pool.request("POST", url, "/", b"{}", {})
        async with server(break_off) as (url, _, _):
            r = await pool.request("POST", url, "/", b"{}", {})
            with pytest.raises(ProtocolFailed):
                await r.read()
            r.release()
        async with server(stall) as (url, _, _):
            r = await pool.request("POST", url, "/", b"{}", {})
            with pytest.raises(Stalled):  # nothing for read_s
                await r.read()
            r.release()
            r = await pool.request("POST", url, "/", b"{}", {})
            with pytest.raises(TimeoutError):  # the whole body's deadline comes first
                await r.read(timeout_s=0.1)
            r.release()
        async with server(garbage) as (url, _, _):
            with pytest.raises(ProtocolFailed):
                await pool.request("POST", url, "/", b"{}", {})
        async with server(huge_headers) as (url, _, _):
            with pytest.raises(ProtocolFailed, match="headers over"):
                await pool.request("POST", url, "/", b"{}", {})
        async with server(silent) as (url, _, _):
            with pytest.raises(TimeoutError):  # no head within read_s
                await pool.request("POST", url, "/", b"{}", {})
        with pytest.raises(ConnectFailed, match="not an http"):
            await pool.request("POST", "ftp://127.0.0.1:1", "/", b"", {})
        pool.close()
    run(go())


def test_a_connection_idle_past_keepalive_is_not_reused():
    async def go():
        async with server(ok) as (url, _, conns):
            pool = Http1Pool(1.0, 1.0, keepalive_s=0.05)
            for _ in range(2):
                r = await pool.request("GET", url, "/health", None, {})
                await r.read()
                r.release()
                await asyncio.sleep(0.1)
            assert len(conns) == 2
            pool.close()
    run(go())


def test_a_forgotten_origin_keeps_no_connection_even_one_answering_then():
    closed: list[bool] = []

    async def go():
        async with server(ok) as (url, _, conns):
            pool = Http1Pool(1.0, 1.0)
            r = await pool.request("GET", url, "/health", None, {})
            await r.read()
            r.release()  # idle, kept alive
            out = await pool.request("GET", url, "/health", None, {})  # reuses it
            pool.forget(url)  # the instance leaves while an answer is out
            await out.read()
            out.release()  # closed, not kept: nothing of the origin stays
            closed.append(out._conn.closed)
            assert pool._idle == {} and pool._origins == {} and pool._live == {}
            r = await pool.request("GET", url, "/health", None, {})  # it comes back
            await r.read()
            r.release()
            assert len(conns) == 2 and pool._live and pool._idle  # a new, kept connection
            pool.close()
    run(go())
    assert closed == [True]
