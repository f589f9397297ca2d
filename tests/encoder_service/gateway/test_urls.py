"""The gateway's URL guard (urls.py) over real HTTP: special-use destinations refused, the
checked address pinned for the fetch (a second DNS answer is never used), no compressed
answers. Names resolve through a test resolver; traffic goes to loopback only."""

from __future__ import annotations

import asyncio
import gzip
import ipaddress
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from encoder_service.gateway.config import LimitsConfig, MediaConfig
from encoder_service.gateway.media.urls import check_destination, fetch_media
from encoder_service.gateway.wire import GatewayError
from encoder_service.local.requests import sample_image_png
from tests.helpers import free_port, port_block

PORTS = iter(port_block(__name__))
IMAGE = sample_image_png(3)


def resolver(answers: list[list[str]], calls: list[str]):
    """Answers in turn (the last one repeats): a name that changes its mind."""
    async def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        return answers[min(len(calls), len(answers)) - 1]
    return resolve


SPECIAL = ["100.100.100.200", "100.64.0.1", "100.127.255.254",  # carrier-grade NAT, metadata
           "198.18.0.1", "192.0.2.10", "203.0.113.5", "240.0.0.1", "0.0.0.0", "127.0.0.1",
           "169.254.169.254", "10.0.0.1", "172.16.0.1", "192.168.1.1", "224.0.0.1",
           "::1", "fe80::1", "fc00::1", "::ffff:10.0.0.1", "64:ff9b::a9fe:a9fe",  # NAT64
           "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
           "2001:0:4136:e378:8000:63bf:5601:fefe"]  # Teredo, client 169.254.1.1


@pytest.mark.parametrize("address", SPECIAL)
def test_special_use_destinations_are_refused(address):
    media = MediaConfig(allow_http_urls=True)
    with pytest.raises(GatewayError) as err:
        asyncio.run(check_destination("http://media.example/x.png", media,
                                      resolver([[address]], [])))
    assert err.value.status == 403 and str(ipaddress.ip_address(address)) in err.value.message


def test_public_destination_passes_and_one_bad_answer_is_enough_to_refuse():
    media = MediaConfig(allow_http_urls=True)
    ip = asyncio.run(check_destination("http://media.example/x.png", media,
                                       resolver([["93.184.215.14"]], [])))
    assert str(ip) == "93.184.215.14"
    with pytest.raises(GatewayError):
        asyncio.run(check_destination("http://media.example/x.png", media,
                                      resolver([["93.184.215.14", "10.1.1.1"]], [])))


@pytest.fixture(scope="module")
def media_server():
    port = free_port(PORTS)
    seen: list[dict] = []

    async def plain(request: Request):
        seen.append(dict(request.headers))
        return Response(IMAGE, media_type="image/png")

    async def gzipped(request: Request):
        seen.append(dict(request.headers))
        return Response(gzip.compress(b"\0" * 1_000_000), media_type="image/png",
                        headers={"content-encoding": "gzip"})

    srv = uvicorn.Server(uvicorn.Config(
        Starlette(routes=[Route("/i.png", plain), Route("/bomb.png", gzipped)]),
        host="127.0.0.1", port=port, log_level="error"))
    srv.install_signal_handlers = lambda: None
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.01)
    yield port, seen
    srv.should_exit = True


def fetch(url: str, resolve, media: MediaConfig | None = None):
    media = media or MediaConfig(allow_http_urls=True, allowed_hosts=["127.0.0.0/8"])

    async def go():
        async with httpx.AsyncClient(trust_env=False) as client:
            return await fetch_media(client, url, media, LimitsConfig(), resolve)
    return asyncio.run(go())


def test_the_fetch_uses_the_checked_address_not_a_second_lookup(media_server):
    port, seen = media_server
    calls: list[str] = []
    # "media.test" has no DNS record: only the pinned, checked address can reach the server;
    # a rebinding name would answer something else on any later lookup
    data, ctype = fetch(f"http://media.test:{port}/i.png",
                        resolver([["127.0.0.1"], ["10.9.9.9"]], calls))
    assert data == IMAGE and ctype == "image/png"
    assert calls == ["media.test"]  # resolved once, for the check
    assert seen[-1]["host"] == f"media.test:{port}"  # the server still sees the name
    assert seen[-1]["accept-encoding"] == "identity"


def test_a_compressed_answer_is_refused_before_it_expands(media_server):
    port, _ = media_server
    with pytest.raises(GatewayError) as err:
        fetch(f"http://media.test:{port}/bomb.png", resolver([["127.0.0.1"]], []))
    assert err.value.status == 502 and "compressed" in err.value.message
