"""Prefill/decode instances (decoders.py) against real HTTP servers on loopback: which answers
before the first byte are asked again, where, and how often (DecodePool.open against aiohttp
servers; a real gateway in front of a dead instance and a stub, stubs.py). A plain 500 from
the only eligible instance is asked once more on it (vLLM answers 500 when its processor
caches drift, and heals them first: the e2e test_encoder_killed_mid_run_answers_stay_correct
once failed on exactly that); a reasoned 503 or a 502 is not; with another instance, the
retry goes there."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web

from ec_connectors.protocol.keys import content_item_id
from encoder_service.gateway.config import GatewayConfig
from encoder_service.gateway.telemetry.metrics import GatewayMetrics
from encoder_service.gateway.upstreams.decoders import DecodePool
from encoder_service.gateway.upstreams.routing import rendezvous
from encoder_service.gateway.wire import GatewayError
from encoder_service.local.requests import chat_body, image_part, sample_image_png
from tests.encoder_service.gateway.stubs import MODEL, Lab, metric, parts_request, post
from tests.helpers import ROOT, port_block, wait_for

LAB = Lab(port_block(__name__))
gateway = LAB.gateway


class Scripted:
    """A decode instance that answers the statuses of `script` in turn, then 200."""

    def __init__(self, *script: int) -> None:
        self.script = list(script)
        self.calls: list[str] = []  # the x-request-id of each request
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.calls.append(request.headers.get("x-request-id", ""))
        status = self.script.pop(0) if self.script else 200
        if status >= 400:
            return web.json_response({"error": {"message": "Internal server error",
                                                "code": status}}, status=status)
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})


@contextlib.asynccontextmanager
async def pool_of(*instances: Scripted, dead: int = 0) -> AsyncIterator[DecodePool]:
    """`dead`: that many more instances whose port refuses connections (listed first)."""
    runners = []
    try:
        for inst in instances:
            app = web.Application()
            app.router.add_post("/v1/chat/completions", inst.handle)
            runner = web.AppRunner(app)
            await runner.setup()
            runners.append(runner)
            port = LAB.port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            inst.url = f"http://127.0.0.1:{port}"
        urls = [f"http://127.0.0.1:{LAB.port()}" for _ in range(dead)]
        cfg = GatewayConfig.build({"decoders": urls + [i.url for i in instances],
                                   "routing": {"probe_interval_s": 0}})
        pool = DecodePool(cfg.pool("decode"), GatewayMetrics())
        await pool.start()
        try:
            yield pool
        finally:
            await pool.close()
    finally:
        for runner in runners:
            await runner.cleanup()


async def ask(pool: DecodePool, key: str | None = None) -> tuple[int, int, bytes]:
    """(status, retries, body) of one request through `request()` (the chat flow's call)."""
    up = await pool.request("POST", "/v1/chat/completions", b"{}", "r", key=key)
    try:
        return up.status_code, up.retries, await up.read()
    finally:
        await up.release()


@pytest.mark.parametrize(("script", "calls", "status"), [
    ((500,), 2, 200),  # processor-cache drift: healed, the second answer is the answer
    ((500, 500), 2, 500),  # once more only: the second 500 is relayed
    ((503,), 1, 503),  # a reasoned refusal (server guard: embedding_unavailable, ...)
    ((502,), 1, 502),
    ((), 1, 200),
])
def test_a_lone_instance_is_asked_once_more_only_after_a_plain_500(script, calls, status):
    async def run() -> None:
        inst = Scripted(*script)
        async with pool_of(inst) as pool:
            got, retries, body = await ask(pool)
            assert (got, retries, len(inst.calls)) == (status, calls - 1, calls)
            assert inst.calls == [f"r-dec{i}" for i in range(calls)]
            if status == 200:
                assert b"ok" in body
            retried = pool.metrics.registry.get_sample_value(
                "epd_gateway_retries_total", {"target": "decode"})
            assert (retried or 0) == calls - 1  # counted as a decode retry
            assert pool.inflight[inst.url] == 0  # both answers released

    asyncio.run(run())


def test_with_another_instance_a_500_is_asked_there_and_not_again_on_the_first():
    async def run() -> None:
        sick, well = Scripted(500), Scripted()
        async with pool_of(sick, well) as pool:
            key = next(k for k in (f"item-{n}" for n in range(100))
                       if pool.order(k)[0] == sick.url)
            got, retries, _ = await ask(pool, key)
            assert (got, retries, len(sick.calls), len(well.calls)) == (200, 1, 1, 1)
            assert pool.down_until[sick.url] > 0  # cooling down, as before
        both = (Scripted(500), Scripted(500))
        async with pool_of(*both) as pool:  # the one retry went elsewhere: no third call
            got, retries, _ = await ask(pool)
            assert (got, retries, [len(s.calls) for s in both]) == (500, 1, [1, 1])

    asyncio.run(run())


def test_refused_connections_cost_no_retry_every_instance_is_tried_before_a_502():
    """Two instances killed at once: their refusals sent nothing, so the request still has
    its retry; a 500 after them is asked once more elsewhere (the supervision e2e's 502)."""
    async def run() -> None:
        well = Scripted()
        async with pool_of(well, dead=2) as pool:
            for _ in range(3):  # whichever order the policy picks
                got, _, body = await ask(pool)
                assert got == 200 and b"ok" in body
            assert all(v == 0 for v in pool.inflight.values())
        sick, well = Scripted(500), Scripted()
        async with pool_of(sick, well, dead=2) as pool:
            for u in pool.urls:  # let the dead go first, then the sick one
                pool.down_until[u] = 0.0
            key = next(k for k in (f"item-{n}" for n in range(500))
                       if pool.order(k)[:2] == pool.urls[:2] and pool.order(k)[2] == sick.url)
            got, _, _ = await ask(pool, key)
            assert (got, len(sick.calls), len(well.calls)) == (200, 1, 1)
        sick = Scripted(500)  # a 500, the others dead: asked once more on the sick one
        async with pool_of(sick, dead=2) as pool:
            key = next(k for k in (f"item-{n}" for n in range(500))
                       if pool.order(k)[0] == sick.url)
            got, _, _ = await ask(pool, key)
            assert (got, sick.calls) == (200, ["r-dec0", "r-dec3"])
        async with pool_of(dead=3) as pool:  # nobody: a 502 after trying each once
            with pytest.raises(GatewayError) as err:
                await ask(pool)
            assert err.value.status == 502 and "no prefill/decode instance" in str(err.value)

    asyncio.run(run())


def test_a_connection_the_instance_drops_unanswered_is_tried_once_more_on_it():
    """A server that closes a kept-alive connection just as a request goes out on it (vLLM's
    5 s keep-alive: the video benchmark's 502 'Broken pipe' to its only decode instance):
    the request is sent again on a new connection to the same instance; a second drop is a
    failure like any other."""
    async def run() -> None:
        drops = {"left": 1}

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            if drops["left"]:
                drops["left"] -= 1
                writer.transport.abort()  # no answer: the connection is gone
                return
            body = b'{"choices": [{"message": {"content": "ok"}}]}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            writer.close()

        port = LAB.port()
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        url = f"http://127.0.0.1:{port}"
        cfg = GatewayConfig.build({"decoders": [url], "routing": {"probe_interval_s": 0}})
        pool = DecodePool(cfg.pool("decode"), GatewayMetrics())
        await pool.start()
        try:
            got, retries, body = await ask(pool)
            assert (got, retries, drops["left"]) == (200, 1, 0) and b"ok" in body
            assert pool.down_until[url] == 0.0  # not held against it
            drops["left"] = 2  # dropped twice: a 502
            with pytest.raises(GatewayError) as err:
                await ask(pool)
            assert err.value.status == 502
            assert "Disconnected: closed before answering" in str(err.value)
            assert pool.inflight[url] == 0
        finally:
            await pool.close()
            server.close()

    asyncio.run(run())


def test_decoder_failure_before_first_byte_retries_on_another(stubs):
    enc, dec = stubs
    dead = f"http://127.0.0.1:{LAB.port()}"
    g = gateway([enc.url], [dead, dec.url])
    try:
        # the first image's decode instance (by affinity) is the dead one: retried on the
        # other; the dead one then cools down, so the second is not retried
        first = next(im for im in (sample_image_png(seed) for seed in range(31, 200))
                     if rendezvous(content_item_id(im, MODEL), [dead, dec.url])[0] == dead)
        for img in (first, sample_image_png(300)):
            assert post(g, chat_body(MODEL, img, "x")).status_code == 200
        assert metric(g, 'epd_gateway_retries_total{target="decode"}') == 1
    finally:
        g.stop()
    g = gateway([enc.url], [dead])
    try:
        r = post(g, chat_body(MODEL, sample_image_png(33), "x"))
        assert r.status_code == 502 and "no prefill/decode instance" in r.text
        assert r.json()["error"]["code"] == "decode_unavailable"
    finally:
        g.stop()


# -- in flight per instance: what routing by load reads -------------------------------------
def test_an_upstream_released_twice_counts_once_and_a_count_never_goes_below_zero():
    async def run() -> None:
        inst = Scripted()
        async with pool_of(inst) as pool:
            up = await pool.request("POST", "/v1/chat/completions", b"{}", "r")
            assert pool.inflight[inst.url] == 1
            await up.read()
            await up.release()
            await up.release()  # a second release (a failover's, the relay's) changes nothing
            assert pool.inflight[inst.url] == 0

    asyncio.run(run())


def test_a_client_gone_during_the_metadata_only_check_leaves_no_request_counted():
    """A metadata-only answer is read up to its first token before it is relayed (it may fail
    there and go again with the raw media). A client that disconnects meanwhile cancels the
    handler: the decode request is closed (vLLM aborts it) and no longer counted in flight
    (it once stayed counted for good, and kept its connection open)."""
    enc, dec = LAB.stub("encoder"), LAB.stub("decoder")
    enc.metadata, dec.stall_s = {"image_grid_thw": [1, 8, 8]}, 30.0
    g = gateway([enc.url], [dec.url])
    try:
        body = {**parts_request(image_part(sample_image_png(41))), "stream": True}
        with pytest.raises(httpx.ReadTimeout):  # gone before any answer byte
            httpx.post(g.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(
                10, read=1.5))
        assert dec.calls and "image_embeds" in json.dumps(dec.calls[-1])  # metadata-only
        pool = g.gateway.decoders
        assert wait_for(lambda: pool.inflight[dec.url] == 0, timeout=5), pool.inflight
    finally:
        g.stop()
        enc.stop()
        dec.stop()


TOKENS = 300  # 15 s a stream (slow_decoder.py: 50 ms a token)


class SlowDecoders:
    """Two slow_decoder.py processes (SIGKILLed and started again on the same port) behind a
    real gateway, and client streams on threads: `open` is what is really open per instance
    (the instance each stream's answer comes from now)."""

    def __init__(self) -> None:
        self.ports = [LAB.port(), LAB.port()]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs = [self.start(i) for i in range(2)]
        self.gw = gateway([], self.urls)  # text only: no encoder
        self.pool = self.gw.gateway.decoders
        self.threads: list[threading.Thread] = []
        self.failures: list[str] = []

    def start(self, i: int) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "tests.encoder_service.gateway."
                                 "slow_decoder", str(self.ports[i]), str(TOKENS)], cwd=ROOT)

        def up() -> bool:
            try:
                return httpx.get(self.urls[i] + "/health", timeout=0.5).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_for(up, timeout=20), "slow_decoder did not start"
        return proc

    def kill(self, i: int, restart: bool = True) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()
        self.gw.call_soon(self.gw.gateway.outages.down, self.urls[i])
        if restart:
            self.procs[i] = self.start(i)
            self.gw.call_soon(self.gw.gateway.outages.back, self.urls[i])

    def stream(self, n: int, cut_after: int | None = None) -> None:
        """`n` greedy streams on threads (each ends after `cut_after` events: a client that
        hangs up), each checked: every token once, in order."""
        def one() -> None:
            body = {"model": MODEL, "stream": True, "temperature": 0.0, "max_tokens": TOKENS,
                    "return_token_ids": True,
                    "messages": [{"role": "user", "content": "hi"}]}
            got: list[int] = []
            try:
                with httpx.stream("POST", self.gw.url + "/v1/chat/completions", json=body,
                                  timeout=60) as r:
                    for events, line in enumerate(r.iter_lines()):
                        if cut_after is not None and events >= cut_after:
                            return
                        if line.startswith("data: {"):
                            for ch in json.loads(line[6:]).get("choices") or ():
                                got += ch.get("token_ids") or []
                if got != [100 + i for i in range(TOKENS)]:
                    self.failures.append(f"tokens {got[:5]}... ({len(got)})")
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))

        for _ in range(n):
            t = threading.Thread(target=one, daemon=True)
            t.start()
            self.threads.append(t)

    def counted(self) -> int:
        return sum(self.pool.inflight.get(u, 0) for u in self.urls)

    def open(self) -> int:
        return sum(t.is_alive() for t in self.threads)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=60)
        self.threads.clear()

    def stop(self) -> None:
        self.gw.stop()
        for proc in self.procs:
            proc.kill()
            proc.wait()


def test_in_flight_counts_equal_the_requests_open_through_kills_restarts_failovers():
    """Load-aware routing reads the in-flight count per decode instance. Through a SIGKILL
    of an instance mid-stream (its streams continue on the other, exactly), its restart and
    return, a kill of the other one, and clients hanging up, each instance's count is the
    number of answers it is really streaming: never drifting, never below zero."""
    lab = SlowDecoders()
    try:
        lab.stream(4)
        assert wait_for(lambda: lab.counted() == 4, timeout=10), lab.pool.inflight
        time.sleep(0.5)  # a few tokens each
        lab.kill(0)  # mid-stream: its streams fail over to the other instance, then it is back
        assert wait_for(lambda: lab.pool.inflight[lab.urls[1]] == 4, timeout=10), \
            lab.pool.inflight
        assert lab.pool.inflight[lab.urls[0]] == 0
        assert wait_for(lambda: lab.urls[0] not in lab.pool.down, timeout=10)
        lab.pool.cool_down(lab.urls[0], 0)  # its failure no longer held against it
        lab.stream(2, cut_after=30)  # two clients that hang up after ~1.5 s
        lab.stream(2)
        assert wait_for(lambda: lab.open() == 8 and lab.counted() == 8, timeout=10), \
            lab.pool.inflight
        assert wait_for(lambda: lab.open() == 6, timeout=10), (lab.open(), lab.failures)
        assert wait_for(lambda: lab.counted() == 6, timeout=5), lab.pool.inflight
        # The other one killed for good: the streams it served from the start go on on the
        # restarted one; the two it continued already end with an error event (one failover
        # per answer), leaving 4 open.
        lab.kill(1, restart=False)
        assert wait_for(lambda: lab.pool.inflight[lab.urls[0]] == lab.open() == 4
                        and lab.pool.inflight[lab.urls[1]] == 0, timeout=10), (
            lab.open(), lab.pool.inflight)
        lab.join()
        assert len(lab.failures) == 2, lab.failures
        assert wait_for(lambda: lab.pool.inflight == dict.fromkeys(lab.urls, 0), timeout=5), \
            lab.pool.inflight  # (a client may see its end just before the gateway's release)
    finally:
        lab.stop()
