"""Gateway plug-ins without vLLM: the Mooncake availability (a MooncakeCatalog fed by a fake
producer's real ZMQ announcements) and the encoder-pool backend (`PoolEncoderClient` against a
recording stand-in for `epd encoder`). Real HTTP (uvicorn + httpx) as in stubs.py."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import msgspec
import pytest
import uvicorn
import zmq
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ec_connectors.control.messages import encode
from ec_connectors.protocol.keys import content_item_id, item_key
from ec_connectors.protocol.params import ItemEntry
from ec_connectors.protocol.stored import ItemInfo
from ec_connectors.transports.peer_pull.messages import Announce, Evicted, Snapshot
from encoder_service.gateway.config import GatewayConfig, GatewayConfigError
from encoder_service.gateway.media.parsing import MediaPart
from encoder_service.gateway.server import GatewayThread
from encoder_service.gateway.upstreams.availability import MooncakeAvailability, make_availability
from encoder_service.gateway.upstreams.encoder_clients import (
    EncoderRouter,
    PoolEncoderClient,
    Releasing,
    VllmEncoderClient,
)
from encoder_service.local.processes import metric_value
from encoder_service.local.requests import chat_body, sample_image_png
from tests.helpers import MOONCAKE, port_block, wait_for
from tests.helpers import free_port as _free_port

MODEL = "tiny-llava"
PORTS = iter(port_block(__name__))
# a fake producer's side channel (it binds only its announcements, + 1000)
PRODUCER = f"127.0.0.1:{port_block(__name__, MOONCAKE)[0]}"


def free_port() -> int:
    return _free_port(PORTS)


class Server:
    """A small Starlette app on a background uvicorn server."""

    def __init__(self, routes: list[Route]) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(Starlette(routes=routes), host="127.0.0.1",
                                                    port=port, log_level="error"))
        self.server.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        assert wait_for(lambda: self.server.started, timeout=10)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


async def _health(request: Request):
    return JSONResponse({})


class Decoder(Server):
    """Records the chat bodies it gets (with their ec_transfer_params)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

        async def chat(request: Request):
            self.calls.append(await request.json())
            return JSONResponse({"choices": [{"message": {"content": "ok"}}]})

        super().__init__([Route("/v1/chat/completions", chat, methods=["POST"]),
                          Route("/health", _health)])


class FakePool(Server):
    """A stand-in for `epd encoder`: /v1/encode answers in the pool's shape, failing the
    ids in `bad`; /v1/release is recorded."""

    def __init__(self) -> None:
        self.encodes: list[dict] = []
        self.releases: list[list[str]] = []
        self.bad: set[str] = set()

        async def encode(request: Request):
            body = await request.json()
            self.encodes.append(body)
            ok = {it["id"]: {"num_embeds": 4, "key": item_key(it["id"]), "nbytes": 64}
                  for it in body["items"] if it["id"] not in self.bad}
            items = {it["id"]: ({"status": "ok", **ok[it["id"]]} if it["id"] in ok else
                                {"status": "failed", "code": "bad_media", "error": "no"})
                     for it in body["items"]}
            return JSONResponse({"items": items, "fallback": "text_only" if self.bad else None,
                                 "ec_transfer_params": {"epd": {"transport": "safetensors",
                                                                "items": ok}}})

        async def release(request: Request):
            self.releases.append((await request.json())["item_ids"])
            return JSONResponse({})

        super().__init__([Route("/v1/encode", encode, methods=["POST"]),
                          Route("/v1/release", release, methods=["POST"]),
                          Route("/health", _health)])


class FakeProducer:
    """Publishes a mooncake producer's announcements (real ZMQ PUB, real messages)."""

    def __init__(self, endpoint: str = PRODUCER) -> None:
        self.endpoint = endpoint
        host, port = endpoint.rsplit(":", 1)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://{host}:{int(port) + 1000}")

    def send(self, msg: msgspec.Struct) -> None:
        self.sock.send(encode(msg))

    def announce(self, item_id: str, nbytes: int = 4096) -> ItemInfo:
        info = ItemInfo(item_id=item_id, key=item_key(item_id), shape=(4, 256),
                        dtype="float32", nbytes=nbytes, checksum="0")
        self.send(Announce(endpoint=self.endpoint, items=[info]))
        return info

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _until_seen(avail: MooncakeAvailability, producer: FakeProducer, item_id: str) -> None:
    """PUB/SUB drops messages until the subscription is in: announce until seen."""
    def seen() -> bool:
        if item_id in avail.available([item_id]):
            return True
        producer.announce(item_id)
        return False

    assert wait_for(seen, timeout=10, interval=0.05), "announcement never reached the catalog"


@pytest.fixture
def producer():
    p = FakeProducer()
    yield p
    p.close()


# -- mooncake availability -------------------------------------------------------------------
def test_mooncake_availability_follows_announcements(producer):
    avail = MooncakeAvailability([PRODUCER], announce_interval_s=0.5)
    try:
        assert avail.available(["a", "b"]) == set() and avail.hint("a") == ItemEntry()
        _until_seen(avail, producer, "a")
        assert avail.available(["a", "b"]) == {"a"}
        assert avail.hint("a") == ItemEntry(location=PRODUCER, nbytes=4096)
        producer.send(Evicted(endpoint=PRODUCER, keys=[item_key("a")]))
        assert wait_for(lambda: not avail.available(["a"]), timeout=5)
        producer.send(Snapshot(endpoint=PRODUCER, keys=[item_key("b")], nbytes=[8],
                               interval_s=0.5))
        assert wait_for(lambda: avail.available(["a", "b"]) == {"b"}, timeout=5)
        # a producer whose snapshots stop is forgotten (3 intervals + 1 s)
        assert wait_for(lambda: not avail.available(["b"]), timeout=6, interval=0.1)
        assert avail.available(["", "x" * 5000]) == set()  # unusable ids are misses
    finally:
        avail.close()


def test_mooncake_availability_config():
    cfg = GatewayConfig.build({"decoders": ["http://127.0.0.1:1"], "availability": {
        "kind": "mooncake", "producers": [PRODUCER]}})
    avail = make_availability(cfg.availability, cfg.namespace, cfg.secret_file)
    try:
        assert avail.name == "mooncake"
    finally:
        avail.close()
    with pytest.raises(GatewayConfigError, match="producers"):
        GatewayConfig.build({"decoders": ["http://x:1"], "availability": {"kind": "mooncake"}})
    with pytest.raises(GatewayConfigError, match="availability.producers"):
        GatewayConfig.build({"decoders": ["http://x:1"], "availability": {
            "kind": "mooncake", "producers": ["nohostport"]}})
    with pytest.raises(GatewayConfigError, match="storage_path"):
        GatewayConfig.build({"decoders": ["http://x:1"], "availability": {
            "kind": "safetensors"}})
    with pytest.raises(GatewayConfigError, match="encoder_backend"):
        GatewayConfig.build({"decoders": ["http://x:1"], "encoder_backend": "sglang"})
    # an unknown key is an error that names it and the known keys, nested ones dotted
    with pytest.raises(GatewayConfigError,
                       match=r"encoder_transport: Extra inputs.*Known keys: .*encoder_backend"):
        GatewayConfig.build({"decoders": ["http://x:1"], "encoder_transport": "pool"})
    with pytest.raises(GatewayConfigError, match=r"Known keys: .*availability\.producers"):
        GatewayConfig.build({"decoders": ["http://x:1"], "availability": {"kindd": "none"}})


def test_gateway_skips_encoding_items_a_mooncake_producer_holds(producer):
    dec, pool = Decoder(), FakePool()
    gw = GatewayThread(GatewayConfig.build({
        "port": free_port(), "model": MODEL, "encoders": [pool.url], "decoders": [dec.url],
        "encoder_backend": "pool",
        "availability": {"kind": "mooncake", "producers": [PRODUCER]}})).start()
    try:
        image = sample_image_png(seed=11)
        item_id = content_item_id(image, MODEL)
        _until_seen(gw.gateway.availability, producer, item_id)
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(MODEL, image, "hi"),
                       timeout=10)
        assert r.status_code == 200, r.text
        assert pool.encodes == []  # a hit: no encoder call
        items = dec.calls[-1]["ec_transfer_params"]["epd"]["items"]
        assert items == {item_id: {"location": PRODUCER, "nbytes": 4096}}
        text = httpx.get(gw.url + "/metrics").text
        assert metric_value(text, 'epd_gateway_items_total{outcome="cache_hit"}') == 1
    finally:
        gw.stop()
        dec.stop()
        pool.stop()


# -- encoder pool backend --------------------------------------------------------------------
def test_pool_backend_encodes_sends_failed_items_raw_and_releases():
    dec, pool = Decoder(), FakePool()
    gw = GatewayThread(GatewayConfig.build({
        "port": free_port(), "model": MODEL, "encoders": [pool.url], "decoders": [dec.url],
        "encoder_backend": "pool"})).start()
    try:
        good, bad = sample_image_png(seed=21), sample_image_png(seed=22)
        gid, bid = content_item_id(good, MODEL), content_item_id(bad, MODEL)
        pool.bad = {bid}
        body = chat_body(MODEL, good, "hi")
        body["messages"][0]["content"].insert(1, chat_body(MODEL, bad, "")["messages"][0][
            "content"][0])
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        (call,) = pool.encodes  # one call with both images, as data URLs
        assert [it["id"] for it in call["items"]] == [gid, bid]
        assert all(it["data"].startswith("data:image/png;base64,") for it in call["items"])
        assert call["on_failure"] == "text_only"
        sent = dec.calls[-1]
        assert set(sent["ec_transfer_params"]["epd"]["items"]) == {gid}  # bad one goes raw
        parts = sent["messages"][0]["content"]
        assert [p.get("uuid") for p in parts[:2]] == [gid, bid]
        assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
        assert wait_for(lambda: pool.releases == [[gid]], timeout=5)
        text = httpx.get(gw.url + "/metrics").text
        assert metric_value(text, 'epd_gateway_items_total{outcome="encoded"}') == 1
        assert metric_value(text, 'epd_gateway_items_total{outcome="fallback"}') == 1
        # pool down: retried nowhere (one encoder), the item goes raw, nothing to release
        pool.stop()
        r = httpx.post(gw.url + "/v1/chat/completions",
                       json=chat_body(MODEL, sample_image_png(seed=23), "hi"), timeout=10)
        assert r.status_code == 200 and "ec_transfer_params" not in dec.calls[-1]
        assert len(pool.releases) == 1
    finally:
        gw.stop()
        dec.stop()
        pool.stop()


def test_pool_backend_overlaps_new_items_and_asks_again_for_what_it_fails(tmp_path):
    """With an availability it follows, the gateway sends the decode request beside the
    pool's encode (routing.overlap auto); an item the pool fails is asked for again, raw."""
    dec, pool = Decoder(), FakePool()
    gw = GatewayThread(GatewayConfig.build({
        "port": free_port(), "model": MODEL, "encoders": [pool.url], "decoders": [dec.url],
        "encoder_backend": "pool", "routing": {"probe_interval_s": 0},
        "availability": {"kind": "safetensors", "storage_path": str(tmp_path)}})).start()

    def ask(seed: int) -> str:
        image = sample_image_png(seed=seed)
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat_body(MODEL, image, "hi"),
                       timeout=10)
        assert r.status_code == 200, r.text
        return content_item_id(image, MODEL)

    try:
        first = ask(31)  # learns that the pool publishes no placeholder metadata
        assert dec.calls[-1]["ec_transfer_params"]["epd"]["items"][first]["num_embeds"] == 4
        n = len(dec.calls)
        second = ask(32)
        (sent,) = dec.calls[n:]
        assert sent["ec_transfer_params"]["epd"]["items"] == {second: {"pending": True}}
        assert wait_for(lambda: pool.releases[-1:] == [[second]], timeout=5)
        pool.bad = {content_item_id(sample_image_png(seed=33), MODEL)}
        n = len(dec.calls)
        ask(33)
        early, again = dec.calls[n:]
        assert list(early["ec_transfer_params"]["epd"]["items"].values()) == [{"pending": True}]
        assert "ec_transfer_params" not in again  # raw: the decode instance encodes it
        text = httpx.get(gw.url + "/metrics").text
        assert metric_value(text, 'epd_gateway_items_total{outcome="overlapped"}') == 1
        assert metric_value(text, 'epd_gateway_items_total{outcome="fallback"}') == 1
        # an item with its own processor settings: the pool would send it back, no overlap
        body = chat_body(MODEL, sample_image_png(seed=34), "hi")
        body["mm_processor_kwargs"] = {"do_resize": False}
        n = len(dec.calls)
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        assert len(dec.calls) == n + 1 and "ec_transfer_params" not in dec.calls[-1]
    finally:
        gw.stop()
        dec.stop()
        pool.stop()


class PartialEncoder:
    """Encodes everything but the ids in `bad` (left out of its answer); releasable."""

    def __init__(self, name: str, bad: set[str]) -> None:
        self.name, self.bad, self.calls, self.released = name, bad, 0, []

    async def encode(self, items, request_id):
        self.calls += 1
        return {it.item_id: {} for it in items if it.item_id not in self.bad}

    async def release(self, item_ids):
        self.released.append(list(item_ids))


def test_router_items_left_out_fail_alone_without_a_retry():
    a, b = PartialEncoder("a", {"i1"}), PartialEncoder("b", {"i1"})
    router = EncoderRouter([a])
    todo = [MediaPart(f"i{k}", "image", 1, {}) for k in range(3)]
    out, errors = asyncio.run(router.encode(todo, "r"))
    assert out.failed == ["i1"] and set(out.hints) == {"i0", "i2"} and out.retries == 0
    assert len(errors) == 1 and a.calls == 1
    asyncio.run(out.release())
    asyncio.run(out.release())  # once only
    assert a.released == [["i0", "i2"]] and b.released == []
    assert router.down_until["a"] == 0.0  # a per-item failure does not cool the encoder down


def test_release_never_raises():
    class Broken(PartialEncoder):
        async def release(self, item_ids):
            raise RuntimeError("gone")

    router = EncoderRouter([Broken("a", set())])
    out, _ = asyncio.run(router.encode([MediaPart("i0", "image", 1, {})], "r"))
    t0 = time.monotonic()
    asyncio.run(out.release())
    assert time.monotonic() - t0 < 1


def test_only_releasing_encoders_are_held():
    class Plain:  # a vLLM producer: nothing to release
        def __init__(self) -> None:
            self.name = "plain"

        async def encode(self, items, request_id):
            return {it.item_id: {} for it in items}

    client = httpx.AsyncClient()
    assert isinstance(PoolEncoderClient("http://p:1", client, 1.0), Releasing)
    assert not isinstance(VllmEncoderClient("http://v:1", "m", client, 1.0), Releasing)
    asyncio.run(client.aclose())
    out, _ = asyncio.run(EncoderRouter([Plain()]).encode([MediaPart("i0", "image", 1, {})], "r"))
    assert set(out.hints) == {"i0"} and out.holders == []


def test_shm_availability_follows_the_records_of_a_real_shm_producer(tmp_path):
    import tempfile

    import torch

    from ec_connectors.config import EPDConfig
    from ec_connectors.transports import Placement, make_transport

    root = tempfile.mkdtemp(prefix="epd-avail-", dir="/dev/shm")
    prod = make_transport(EPDConfig.from_dict({
        "transport": "shm", "shm_path": root, "namespace": "tiny-model",
        "shm_arena_bytes": 4 << 20, "shm_lease_ttl_s": 0.01, "shm_consumer_pool_bytes": 0}),
        Placement(is_producer=True, is_consumer=False))
    cfg = GatewayConfig.build({"decoders": ["http://127.0.0.1:1"], "model": "tiny-model",
                               "availability": {"kind": "shm", "shm_path": root}})
    avail = make_availability(cfg.availability, cfg.namespace, cfg.secret_file)
    try:
        assert avail.name == "shm" and avail.available(["a"]) == set()
        prod.put("a", torch.zeros(1 << 20, dtype=torch.uint8))
        assert avail.available(["a", "b"]) == {"a"} and avail.hint("a") == ItemEntry()
        time.sleep(0.02)
        prod.put("b", torch.zeros(3 << 20, dtype=torch.uint8))  # the arena evicts "a"
        assert avail.available(["a", "b"]) == {"b"}
        assert avail.available(["", "x" * 5000]) == set()  # unusable ids are misses
    finally:
        avail.close()
        prod.close()
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    with pytest.raises(GatewayConfigError, match="shm_path"):
        GatewayConfig.build({"decoders": ["http://x:1"], "availability": {"kind": "shm"}})
