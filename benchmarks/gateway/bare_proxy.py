"""The least a Python hop can cost here: a proxy with no logic, for gateway/hop.py.

uvloop's event loop, httptools' parsers on both sides, one kept-alive upstream connection per
client connection, each answer written in one piece: nothing but the two hops' reads, writes
and wake-ups. What `epd gateway` adds above this is its own work (admission, the chat flow,
routing, metrics, the request's log line) and its HTTP stack's.

With a third argument, one of the gateway's layers in turn on top of it (where the gateway's
time goes, docs/benchmarks.md): `http1`, the same front relaying through the gateway's
upstream client (`upstreams/http1.py`); `uvicorn`, uvicorn as the gateway runs it (httptools,
uvloop, its proxy-headers middleware) and a raw ASGI app relaying through that client.

    python -m benchmarks.gateway.bare_proxy PORT UPSTREAM_PORT [bare|http1|uvicorn]"""

from __future__ import annotations

import argparse
import asyncio

import httptools
import uvloop

from encoder_service.gateway.upstreams.http1 import Http1Pool


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


class Http1Relay:
    """The gateway's upstream client in place of `Upstream` (modes http1 and uvicorn)."""

    def __init__(self, upstream_port: int) -> None:
        self.url = f"http://127.0.0.1:{upstream_port}"
        self.pool = Http1Pool(5.0, 60.0)

    async def post(self, path: bytes, body: bytes) -> tuple[int, bytes]:
        r = await self.pool.request("POST", self.url, path.decode(), body,
                                    {"content-type": "application/json"})
        try:
            return r.status, await r.read(60.0)
        finally:
            r.release()


def asgi_app(relay: Http1Relay):
    """A raw ASGI app: each request's body relayed, its answer sent back (mode uvicorn)."""

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status, answer = await relay.post(scope["path"].encode(), body)
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    return app


class Front(asyncio.Protocol):
    """A client connection: each whole request is passed on, its answer passed back."""

    def __init__(self, upstream_port: int, relay: Http1Relay | None = None) -> None:
        self.upstream_port = upstream_port
        self.relay_to = relay
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
        if self.relay_to is not None:
            status, answer = await self.relay_to.post(url, body)
        else:
            if self.up is None or self.up.closed:
                _, self.up = await asyncio.get_running_loop().create_connection(
                    Upstream, "127.0.0.1", self.upstream_port)
            status, answer = await self.up.post(url, body)
        self.transport.write(b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (status, len(answer), answer))


async def serve(port: int, upstream_port: int, mode: str) -> None:
    loop = asyncio.get_running_loop()
    relay = Http1Relay(upstream_port) if mode == "http1" else None
    server = await loop.create_server(lambda: Front(upstream_port, relay), "127.0.0.1", port)
    await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("port", type=int)
    p.add_argument("upstream_port", type=int)
    p.add_argument("mode", nargs="?", default="bare", choices=["bare", "http1", "uvicorn"])
    a = p.parse_args(argv)
    if a.mode == "uvicorn":
        import uvicorn

        uvicorn.run(asgi_app(Http1Relay(a.upstream_port)), host="127.0.0.1", port=a.port,
                    log_level="warning", access_log=False, lifespan="off")
    else:
        uvloop.run(serve(a.port, a.upstream_port, a.mode))


if __name__ == "__main__":
    main()
