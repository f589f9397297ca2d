"""The least a Python hop can cost here: a proxy with no logic, for gateway_hop_bench.py.

uvloop's event loop, httptools' parsers on both sides, one kept-alive upstream connection per
client connection, each answer written in one piece: nothing but the two hops' reads, writes
and wake-ups. What `epd gateway` adds above this is its own work (admission, the chat flow,
routing, metrics, the request's log line) and its HTTP stack's.

    python benchmarks/bare_proxy.py PORT UPSTREAM_PORT"""

from __future__ import annotations

import asyncio
import sys

import httptools
import uvloop


class Upstream(asyncio.Protocol):
    """The kept-alive connection to the stand-in; one request at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.body: list[bytes] = []
        self.answer: asyncio.Future | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(ConnectionError("upstream closed"))

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        self.answer.set_result((self.parser.get_status_code(), body))

    async def post(self, path: bytes, body: bytes) -> tuple[int, bytes]:
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(b"POST %s HTTP/1.1\r\nhost: up\r\ncontent-type: application/json"
                             b"\r\ncontent-length: %d\r\n\r\n%s" % (path, len(body), body))
        return await self.answer


class Front(asyncio.Protocol):
    """A client connection: each whole request is passed on, its answer passed back."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.url = b"/"
        self.up: Upstream | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        asyncio.get_running_loop().create_task(self.relay(self.url, body))

    async def relay(self, url: bytes, body: bytes) -> None:
        if self.up is None or self.up.closed:
            _, self.up = await asyncio.get_running_loop().create_connection(
                Upstream, "127.0.0.1", self.upstream_port)
        status, answer = await self.up.post(url, body)
        self.transport.write(b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (status, len(answer), answer))


async def serve(port: int, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Front(upstream_port), "127.0.0.1", port)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(serve(int(sys.argv[1]), int(sys.argv[2])))
