"""Routing: rendezvous hashing with bounded loads, affinity across gateway replicas, single
flight, reference-counted releases (router logic with stand-in encoders; the e2e tests run
it against real vLLM servers)."""

from __future__ import annotations

import asyncio
from collections import Counter

from encoder_service.gateway.media.parsing import MediaPart
from encoder_service.gateway.upstreams.encoder_clients import EncoderFailed, EncoderRouter
from encoder_service.gateway.upstreams.routing import Chooser, bounded, rendezvous
from tests.encoder_service.gateway.stubs import MODEL, FakeEncoder, Lab, items
from tests.helpers import port_block

LAB = Lab(port_block(__name__))  # the stub upstreams, gateways and pools of this module
NAMES = [f"http://enc{i}:8000" for i in range(4)]


def test_rendezvous_is_stable_balanced_and_moves_little_when_members_change():
    keys = [f"item-{k}" for k in range(4000)]
    first = {k: rendezvous(k, NAMES)[0] for k in keys}
    assert first == {k: rendezvous(k, list(reversed(NAMES)))[0] for k in keys}  # order-free
    share = Counter(first.values())
    assert all(800 < n < 1200 for n in share.values()), share
    # one encoder leaves: only its items move, and they spread over the rest
    fewer = NAMES[1:]
    moved = [k for k in keys if rendezvous(k, fewer)[0] != first[k]]
    assert set(moved) == {k for k in keys if first[k] == NAMES[0]}
    # one joins: it takes about a fifth, from everyone, and nothing else moves
    more = [*NAMES, "http://enc4:8000"]
    moved = [k for k in keys if rendezvous(k, more)[0] != first[k]]
    assert all(rendezvous(k, more)[0] == "http://enc4:8000" for k in moved)
    assert 600 < len(moved) < 1000


def test_bounded_load_spills_a_hot_instance_to_the_next_in_order():
    order = rendezvous("hot", NAMES)
    assert bounded(order, {}, 1.25) == order[0]
    # the first choice carries far more than the average: the next in order takes it
    assert bounded(order, {order[0]: 10}, 1.25) == order[1]
    assert bounded(order, {order[0]: 10, order[1]: 10}, 1.25) == order[2]
    assert bounded(order, {n: 1 for n in order}, 1.25) == order[0]  # balanced: stays


def test_router_groups_items_one_call_per_encoder():
    a, b = FakeEncoder("a"), FakeEncoder("b")
    out, errors = asyncio.run(EncoderRouter([a, b]).encode(items(5), "r"))
    assert not errors and not out.failed and out.calls == 2
    assert sorted(len(c) for c in a.calls + b.calls) == [2, 3]
    assert set(out.hints) == {f"i{k}" for k in range(5)}


def test_router_prefers_the_least_loaded_encoder():
    a, b = FakeEncoder("a", delay=0.3), FakeEncoder("b", delay=0.3)
    router = EncoderRouter([a, b])

    async def run():
        first = asyncio.create_task(router.encode(items(1), "r1"))
        await asyncio.sleep(0.05)  # one encoder now has a call in flight
        await router.encode([MediaPart("other", "image", 1, {})], "r2")  # not a shared item
        await first

    asyncio.run(run())
    assert len(a.calls) == 1 and len(b.calls) == 1  # the second went to the idle one


def test_router_retries_once_then_reports_failed_items_and_cools_down():
    a, b, c = FakeEncoder("a", fail=True), FakeEncoder("b", fail=True), FakeEncoder("c")
    router = EncoderRouter([a, b], cooldown_s=60)
    out, errors = asyncio.run(router.encode(items(1), "r"))
    assert out.retries == 1 and out.failed == ["i0"] and len(errors) == 2
    assert len(a.calls) + len(b.calls) == 2  # once each, never a third call
    router = EncoderRouter([a, c], cooldown_s=60)
    for _ in range(3):
        out, _ = asyncio.run(router.encode(items(1), "r"))
        assert not out.failed
    assert len(a.calls) <= 2  # after one failure, a cools down and c takes the work


class Encoder(FakeEncoder):
    """A stand-in encoder that holds what it encoded until released (as the pool does)."""

    def __init__(self, name: str, delay: float = 0.05, fail: bool = False) -> None:
        super().__init__(name, fail=fail, delay=delay)
        self.released: list[list[str]] = []

    async def release(self, item_ids):
        self.released.append(list(item_ids))


def part(item_id: str) -> MediaPart:
    return MediaPart(item_id, "image", 1, {})


def affinity_router(encoders, **kw) -> EncoderRouter:
    return EncoderRouter(encoders, chooser=Chooser("affinity", 1.25), **kw)


def test_a_repeated_item_reaches_the_same_encoder_from_any_gateway():
    fleet = [Encoder(n) for n in NAMES]
    gateways = [affinity_router(fleet), affinity_router(list(reversed(fleet)))]
    for k in range(40):
        for gw in gateways:
            out, _ = asyncio.run(gw.encode([part(f"img-{k}")], f"r{k}"))
            assert out.hints[f"img-{k}"]["by"] == rendezvous(f"img-{k}", NAMES)[0]
    # each item went to one encoder only
    where = {}
    for enc in fleet:
        for call in enc.calls:
            for item in call:
                assert where.setdefault(item, enc.name) == enc.name


def test_sixteen_concurrent_requests_for_one_new_item_make_one_encode():
    fleet = [Encoder(n, delay=0.2) for n in NAMES]
    router = affinity_router(fleet)

    async def run():
        return await asyncio.gather(*(router.encode([part("new")], f"r{i}")
                                      for i in range(16)))

    outs = [o for o, _ in asyncio.run(run())]
    assert sum(len(e.calls) for e in fleet) == 1
    assert all(o.hints["new"]["by"] == outs[0].hints["new"]["by"] for o in outs)
    assert sorted(o.shared for o in outs) == [0] + [1] * 15
    # the pool is told once, when the last request using the item is done
    holder = next(e for e in fleet if e.calls)
    for o in outs[:-1]:
        asyncio.run(o.release())
    assert holder.released == []
    asyncio.run(outs[-1].release())
    assert holder.released == [["new"]]
    # once landed, a later request encodes again (the encoder's own cache answers it)
    asyncio.run(router.encode([part("new")], "later"))
    assert len(holder.calls) == 2


def test_a_shared_encode_that_fails_fails_for_everyone_and_a_cancelled_leader_still_serves():
    dead = affinity_router([Encoder(n, fail=True) for n in NAMES[:2]])

    async def both(router):
        return await asyncio.gather(*(router.encode([part("x")], f"r{i}") for i in range(3)))

    outs = asyncio.run(both(dead))
    assert all(o.failed == ["x"] for o, _ in outs)
    # nothing was encoded for anyone: a follower counts no shared item (the gateway's
    # "encoded" count, hints minus shared, went negative and failed the request)
    assert [(len(o.hints), o.shared) for o, _ in outs] == [(0, 0)] * 3

    fleet = [Encoder(n, delay=0.2) for n in NAMES]
    router = affinity_router(fleet)

    async def leader_leaves():
        leader = asyncio.create_task(router.encode([part("y")], "leader"))
        await asyncio.sleep(0.02)
        follower = asyncio.create_task(router.encode([part("y")], "follower"))
        await asyncio.sleep(0.02)
        leader.cancel()  # its client went away
        return await follower

    out, _ = asyncio.run(leader_leaves())
    assert "y" in out.hints and out.shared == 1
    assert sum(len(e.calls) for e in fleet) == 1


def test_a_hot_stream_of_items_spreads_under_bounded_load():
    fleet = [Encoder(n, delay=0.05) for n in NAMES]
    router = affinity_router(fleet, single_flight=False)

    async def run():
        # 32 distinct items at once that all hash to one encoder would pile up there
        home = rendezvous("a", NAMES)[0]
        same = [f"k{i}" for i in range(2000) if rendezvous(f"k{i}", NAMES)[0] == home][:32]
        await asyncio.gather(*(router.encode([part(k)], k) for k in same))
        return home

    home = asyncio.run(run())
    busiest = max(fleet, key=lambda e: len(e.calls))
    assert busiest.name == home and len(busiest.calls) < 32  # spilled over
    assert sum(len(e.calls) for e in fleet) == 32


def test_a_draining_encoder_gets_nothing_new_and_leaves_after_its_calls():
    fleet = [Encoder(n, delay=0.2) for n in NAMES[:2]]
    router = affinity_router(fleet)
    target = next(k for k in (f"i{n}" for n in range(100))
                  if rendezvous(k, NAMES[:2])[0] == NAMES[0])

    async def run():
        busy = asyncio.create_task(router.encode([part(target)], "busy"))
        await asyncio.sleep(0.02)
        drain = asyncio.create_task(router.drain(NAMES[0], 5.0))
        await asyncio.sleep(0.02)
        out, _ = await router.encode([part(target + "-again")], "new")
        assert (await busy)[0].hints[target]["by"] == NAMES[0]  # finished, not cut
        return out, await drain

    out, drained = asyncio.run(run())
    assert drained and NAMES[0] not in router.clients
    assert out.hints[target + "-again"]["by"] == NAMES[1]
    router.add(Encoder(NAMES[0]))
    assert [d["url"] for d in router.describe()] == [NAMES[1], NAMES[0]]


# -- forward probes, through the gateway's HTTP endpoints (stand-in upstreams) -----------
def test_a_hung_instance_fails_its_forward_probe_and_is_tried_last_until_it_passes():
    import httpx

    from tests.helpers import wait_for

    enc, good, hung = LAB.stub("encoder"), LAB.stub("decoder"), LAB.stub("decoder")
    hung.delay = 3.0  # its HTTP server answers /health, its "engine" does not answer in time
    g = LAB.gateway([enc.url], [good.url, hung.url],
                routing={"probe_interval_s": 0.2, "probe_timeout_s": 0.5})

    def state() -> dict:
        listed = httpx.get(g.url + "/instances").json()
        return {d["url"]: d for d in listed["decoders"]}

    try:
        assert wait_for(lambda: "probe" in state().get(hung.url, {}) and
                        not state()[hung.url]["probe"]["ok"], timeout=10, interval=0.1)
        s = state()
        # its answer never comes in time (ReadTimeout; on a loaded machine the 0.5 s may run
        # out before the stub's accept, a ConnectTimeout: a timeout either way)
        assert s[hung.url]["state"] == "cooling_down" and "Timeout" in \
            s[hung.url]["probe"]["error"]
        assert s[good.url]["probe"]["ok"] and s[good.url]["state"] == "up"
        hung.delay = 0.0  # it recovers: the next probe passing puts it back
        assert wait_for(lambda: state()[hung.url]["state"] == "up", timeout=10, interval=0.1)
    finally:
        g.stop()
        for s in (enc, good, hung):
            s.stop()


def test_an_instance_reported_down_gets_nothing_until_a_probe_passes_after_it_is_back():
    """What `epd up`'s supervisor tells the gateway (outages.py): a decode instance and the
    encoder whose processes died get no new work (the items go raw) and show as down; once
    reported back (restarted, healthy) the decode instance gets work again only after a real
    forward passes; the restarts are counted on /metrics."""
    import httpx

    from encoder_service.local.requests import chat_body, sample_image_png
    from tests.encoder_service.gateway.stubs import metric
    from tests.helpers import wait_for

    enc, first, second = LAB.stub("encoder"), LAB.stub("decoder"), LAB.stub("decoder")
    g = LAB.gateway([enc.url], [first.url, second.url])
    outages = g.gateway.outages
    outages.interval_s = 0.05

    def states() -> dict[str, str]:
        listed = httpx.get(g.url + "/instances").json()
        return {e["url"]: e["state"] for e in (*listed["encoders"], *listed["decoders"])}

    def ask(n: int) -> None:
        r = httpx.post(g.url + "/v1/chat/completions", timeout=10,
                       json=chat_body(MODEL, sample_image_png(seed=n), "x"))
        assert r.status_code == 200, r.text

    try:
        g.call_soon(outages.down, first.url)
        g.call_soon(outages.down, enc.url)
        assert wait_for(lambda: states() == {enc.url: "down", first.url: "down",
                                             second.url: "up"}, timeout=5, interval=0.02)
        calls = len(first.calls), len(enc.calls)
        fallback = metric(g, 'epd_gateway_items_total{outcome="fallback"}')
        for n in range(8):
            ask(n)
        assert (len(first.calls), len(enc.calls)) == calls and len(second.calls) >= 8
        assert metric(g, 'epd_gateway_items_total{outcome="fallback"}') == fallback + 8
        first.fail = True  # restarted and healthy, but its engine does not answer yet
        g.call_soon(outages.back, first.url)
        assert wait_for(lambda: g.gateway.outages.prober.results.get(first.url) is not None,
                        timeout=5, interval=0.02)
        assert not wait_for(lambda: states()[first.url] != "down", timeout=0.3)
        first.fail = False
        assert wait_for(lambda: states()[first.url] == "up", timeout=5, interval=0.02)
        for n in range(100, 120):
            ask(n)
        assert len(first.calls) > calls[0]  # its share again
        g.call_soon(outages.back, enc.url)
        assert wait_for(lambda: states()[enc.url] == "up", timeout=5, interval=0.02)
        ask(200)
        assert len(enc.calls) > calls[1]
        g.gateway.metrics.restarts.labels("decode-0").inc()
        assert metric(g, 'epd_restarts_total{instance="decode-0"}') == 1
    finally:
        g.stop()
        for s in (enc, first, second):
            s.stop()


def test_a_repeated_item_reaches_the_pool_that_encoded_it(tmp_path):
    """Two real encoder pools (the tiny LLaVA, real HTTP, safetensors publishing) behind a
    gateway that looks nothing up: the same image three times is encoded once, by the pool
    its id hashes to, and served from that pool's memory after."""
    import httpx

    from ec_connectors.protocol.keys import content_item_id
    from encoder_service.encoder_pool.config import PoolConfig
    from encoder_service.encoder_pool.server import create_app
    from encoder_service.local.requests import chat_body, sample_image_png
    from encoder_service.local.testmodels import SPECS, build
    from tests.helpers import WORK, Served

    model = build(WORK / "models" / "tiny-llava", SPECS["tiny"])
    cfgs = [PoolConfig.from_dict({"model": model, "served_model_name": MODEL,
                                  "max_wait_ms": 5, "retain": "keep",
                                  "transport": {"storage_path": str(tmp_path / "ec")}})
            for _ in range(2)]
    dec = LAB.stub("decoder")
    with Served(create_app(cfgs[0]), LAB.port()) as p0, \
            Served(create_app(cfgs[1]), LAB.port()) as p1:
        g = LAB.gateway([p0.url, p1.url], [dec.url], encoder_backend="pool")
        try:
            image = sample_image_png(seed=4242)
            for _ in range(3):
                r = httpx.post(g.url + "/v1/chat/completions", timeout=60,
                               json=chat_body(MODEL, image, "x"))
                assert r.status_code == 200, r.text
            stats = {p.url: httpx.get(p.url + "/v1/stats").json() for p in (p0, p1)}
            home = rendezvous(content_item_id(image, MODEL), [p0.url, p1.url])[0]
            assert stats[home]["items_encoded"] == 1 and stats[home]["reuse_hits"] == 2
            other = next(u for u in stats if u != home)
            assert stats[other]["items_encoded"] == 0 and stats[other]["reuse_hits"] == 0
        finally:
            g.stop()
            dec.stop()


class FailsOnce:
    """An encoder whose first call fails with `status` (None: it did not answer at all)."""

    def __init__(self, status: int | None) -> None:
        self.name = "only"
        self.status = status
        self.calls = 0

    async def encode(self, items, request_id):
        self.calls += 1
        if self.calls == 1:
            raise EncoderFailed(f"only: HTTP {self.status}", self.status)
        return {it.item_id: {} for it in items}


def test_a_lone_encoder_that_answered_a_5xx_is_asked_once_more_and_no_other_failure_is():
    """vLLM answers 500 when its processor caches drift and heals them before answering:
    with no other encoder to try, the same one gets the item once more. An encoder that did
    not answer, or refused the item (4xx), is not asked again: the item goes raw."""
    for status, calls, encoded in ((500, 2, True), (503, 2, True), (None, 1, False),
                                   (400, 1, False)):
        enc = FailsOnce(status)
        out, errors = asyncio.run(EncoderRouter([enc]).encode([part("x")], "r"))
        assert (enc.calls, "x" in out.hints, out.retries) == (calls, encoded, calls - 1)
        assert out.failed == ([] if encoded else ["x"]) and len(errors) == 1
