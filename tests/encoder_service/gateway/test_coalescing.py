"""CoalescingClient: concurrent requests' new images share calls to an encoder whose cost is
per call (a vLLM server). The inner encoder here is a recording stand-in (the logic around
the call is what is tested); the e2e gateway tests drive it against real vLLM encoders."""

from __future__ import annotations

import asyncio
import time

import pytest

from encoder_service.gateway.media.parsing import MediaPart, canonical_settings
from encoder_service.gateway.upstreams.coalescing import CoalescingClient
from encoder_service.gateway.upstreams.encoder_clients import EncoderFailed, EncoderRouter


class Recorder:
    """An encoder that takes `delay_s` per call, records each call's item ids, refuses a
    call holding a `bad` item with `status` (as vLLM does: the whole request fails)."""

    def __init__(self, delay_s: float = 0.05, bad: frozenset[str] = frozenset(),
                 status: int = 400) -> None:
        self.name = "enc"
        self.delay_s = delay_s
        self.bad = bad
        self.status = status
        self.calls: list[list[str]] = []
        self.active = self.peak = 0

    async def encode(self, items, request_id):
        self.calls.append([it.item_id for it in items])
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.active -= 1
        if self.bad & {it.item_id for it in items}:
            raise EncoderFailed(f"{self.name}: HTTP {self.status}: bad", self.status)
        return {it.item_id: {"by": request_id} for it in items}


def image(i: str, **kwargs) -> MediaPart:
    return MediaPart(i, "image", 10, {"type": "image_url", "uuid": i}, kwargs,
                     canonical_settings(kwargs))


async def _gather(client, groups, stagger_s=0.005):
    async def one(k, items):
        await asyncio.sleep(k * stagger_s)
        try:
            return await client.encode(items, f"r{k}")
        except EncoderFailed as exc:
            return exc
    return await asyncio.gather(*(one(k, g) for k, g in enumerate(groups)))


def test_images_that_arrive_while_the_encoder_is_busy_share_the_next_call():
    inner = Recorder()
    client = CoalescingClient(inner, max_items=4, max_calls=1, timeout_s=5)
    sizes: list[int] = []
    client.on_call = sizes.append
    groups = [[image("a")], [image("b"), image("c")], [image("d")], [image("e")], [image("f")]]
    out = asyncio.run(_gather(client, groups))
    # the first goes at once; the next four arrive while it runs: up to 4 items share a call
    assert inner.calls == [["a"], ["b", "c", "d", "e"], ["f"]] and inner.peak == 1
    assert sizes == [1, 4, 1]
    # each request gets its own items' answers only, from the call that made them
    assert out[0] == {"a": {"by": "r0"}}
    assert out[1] == {"b": {"by": "r1+2"}, "c": {"by": "r1+2"}}
    assert out[3] == {"e": {"by": "r1+2"}} and out[4] == {"f": {"by": "r4"}}


def test_an_idle_encoder_gets_each_request_at_once():
    inner = Recorder(delay_s=0.05)
    client = CoalescingClient(inner, max_items=8, max_calls=2, timeout_s=5)
    t0 = time.monotonic()
    asyncio.run(_gather(client, [[image("a")], [image("b")]], stagger_s=0.0))
    assert inner.calls == [["a"], ["b"]] and inner.peak == 2  # two calls allowed: no waiting
    assert time.monotonic() - t0 < 0.09


def test_a_shared_call_refused_for_its_content_is_split_back_into_requests():
    inner = Recorder(bad=frozenset({"bad"}))
    client = CoalescingClient(inner, max_items=8, max_calls=1, timeout_s=5)
    out = asyncio.run(_gather(client, [[image("a")], [image("b")], [image("bad")],
                                       [image("c")]]))
    assert inner.calls[1] == ["b", "bad", "c"]  # shared, refused whole
    assert sorted(map(tuple, inner.calls[2:])) == [("b",), ("bad",), ("c",)]  # then alone
    assert out[1] == {"b": {"by": "r1"}} and out[3] == {"c": {"by": "r3"}}
    assert isinstance(out[2], EncoderFailed) and out[2].status == 400


def test_a_shared_call_that_fails_otherwise_fails_all_its_requests_without_a_split():
    inner = Recorder(bad=frozenset({"b"}), status=503)
    client = CoalescingClient(inner, max_items=8, max_calls=1, timeout_s=5)
    out = asyncio.run(_gather(client, [[image("a")], [image("b")], [image("c")]]))
    assert inner.calls == [["a"], ["b", "c"]]  # no split: the encoder is unwell, not the item
    assert all(isinstance(o, EncoderFailed) and o.status == 503 for o in out[1:])


def test_only_images_with_the_same_settings_share_and_other_media_never_wait():
    inner = Recorder(delay_s=0.1)
    client = CoalescingClient(inner, max_items=8, max_calls=1, timeout_s=5)
    video = MediaPart("v", "video", 10, {"type": "video_url", "uuid": "v"}, {})
    groups = [[image("a")], [image("b", mm_processor_kwargs={"x": 1})], [image("c")],
              [image("d", mm_processor_kwargs={"x": 1})], [video]]
    asyncio.run(_gather(client, groups))
    assert inner.calls[0] == ["a"] and ["v"] in inner.calls[1:3]  # the video went at once
    rest = [c for c in inner.calls[1:] if c != ["v"]]
    assert rest == [["b", "d"], ["c"]]  # same settings shared; the others in their own call


def test_a_request_left_waiting_gets_an_error_within_the_deadline_and_leaves_the_queue():
    inner = Recorder(delay_s=1.0)
    client = CoalescingClient(inner, max_items=8, max_calls=1, timeout_s=0.2)

    async def run():
        first = asyncio.ensure_future(client.encode([image("a")], "r0"))
        await asyncio.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(EncoderFailed, match="no answer within 0.2 s"):
            await client.encode([image("b")], "r1")
        waited = time.monotonic() - t0
        assert not client._queue  # its item is not sent later for nobody
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        return waited

    assert asyncio.run(run()) < 0.5
    assert inner.calls == [["a"]]


def test_the_router_over_a_coalescing_client_keeps_single_flight_and_retries():
    inner = Recorder()
    router = EncoderRouter([CoalescingClient(inner, max_items=8, max_calls=1, timeout_s=5)])

    async def run():
        return await asyncio.gather(*(router.encode([image(i)], f"r{k}")
                                      for k, i in enumerate(["a", "b", "a", "c"])))

    outs = asyncio.run(run())
    assert sorted(x for call in inner.calls for x in call) == ["a", "b", "c"]  # "a" once
    assert [set(o.hints) for o, _ in outs] == [{"a"}, {"b"}, {"a"}, {"c"}]
    assert all(not o.failed for o, _ in outs)


def test_one_item_per_call_sends_every_request_alone_and_at_once():
    inner = Recorder(delay_s=0.05)
    client = CoalescingClient(inner, max_items=1, max_calls=1, timeout_s=5)
    sizes: list[int] = []
    client.on_call = sizes.append
    asyncio.run(_gather(client, [[image("a")], [image("b")], [image("c")]]))
    assert inner.calls == [["a"], ["b"], ["c"]] and inner.peak == 3 and sizes == [1, 1, 1]


class PerPromptLimit(Recorder):
    """A vLLM encoder started with `--limit-mm-per-prompt '{"image": N}'`: a call with more
    images is refused with vLLM's own message."""

    def __init__(self, limit: int, **kw) -> None:
        super().__init__(**kw)
        self.limit = limit

    async def encode(self, items, request_id):
        if len(items) > self.limit:
            self.calls.append([it.item_id for it in items])
            raise EncoderFailed(
                f"{self.name}: HTTP 400: {{\"error\":{{\"message\":\"At most {self.limit} "
                f"image(s) may be provided in one prompt.\",\"type\":\"BadRequestError\"}}}}",
                400)
        return await super().encode(items, request_id)


def test_a_refusal_for_vllms_per_prompt_limit_caps_every_later_shared_call():
    inner = PerPromptLimit(2)
    client = CoalescingClient(inner, max_items=8, max_calls=1, timeout_s=5)
    first = [[image(f"a{i}")] for i in range(5)]
    out = asyncio.run(_gather(client, first))
    # the shared call of four was refused once and split; every request still answered
    assert inner.calls[:3] == [["a0"], ["a1", "a2", "a3", "a4"], ["a1"]]
    assert all(isinstance(o, dict) and len(o) == 1 for o in out)
    assert client.max_items == 2
    inner.calls.clear()
    later = [[image(f"b{i}")] for i in range(5)]
    out = asyncio.run(_gather(client, later))
    assert all(isinstance(o, dict) and len(o) == 1 for o in out)
    assert max(map(len, inner.calls)) <= 2 and len(inner.calls) == 3  # b0, then pairs


def test_a_refusal_for_other_content_leaves_the_call_size_alone():
    inner = Recorder(bad=frozenset({"x"}))
    client = CoalescingClient(inner, max_items=8, max_calls=1, timeout_s=5)
    asyncio.run(_gather(client, [[image("a")], [image("x")], [image("b")]]))
    assert client.max_items == 8
