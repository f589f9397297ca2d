"""EncoderProgress: the deadline of an encode call queued behind others on one encoder.
Driven with asyncio tasks standing in for the calls (the rules are what is tested); the
gateway over real HTTP: test_chat.py's busy-encoder test."""

from __future__ import annotations

import asyncio
import time

import pytest

from encoder_service.gateway.upstreams.encoder_progress import EncoderProgress, EncoderSilent

IDLE = 0.2


async def _answer_after(progress: EncoderProgress, delay_s: float) -> float:
    await asyncio.sleep(delay_s)
    progress.answered()
    return time.monotonic()


def _one_at_a_time(progress: EncoderProgress, delay_s: float):
    """An encoder's call maker: each call answered `delay_s` after the one before it."""
    gate = asyncio.Lock()

    async def call() -> float:
        async with gate:
            return await _answer_after(progress, delay_s)

    return call


def test_calls_answered_one_after_another_wait_past_idle_s():
    """Four calls sent together, answered 0.15 s apart: the last ends at 0.6 s, three times
    idle_s, and none fails."""
    p = EncoderProgress(IDLE)

    async def run():
        serial = _one_at_a_time(p, 0.15)
        t0 = time.monotonic()
        done = await asyncio.gather(*(p.within(serial()) for _ in range(4)))
        return max(done) - t0

    assert asyncio.run(run()) > 3 * IDLE
    assert p.in_flight == 0


def test_an_encoder_that_answers_nothing_fails_every_call_within_idle_s():
    p = EncoderProgress(IDLE)

    async def run():
        t0 = time.monotonic()
        out = await asyncio.gather(*(p.within(asyncio.sleep(5)) for _ in range(3)),
                                   return_exceptions=True)
        return out, time.monotonic() - t0

    out, took = asyncio.run(run())
    assert all(isinstance(e, EncoderSilent) for e in out)
    assert "answered no call for 0.2 s" in str(out[0])
    assert IDLE <= took < IDLE + 0.5


def test_a_call_the_encoder_keeps_passing_over_ends_at_idle_s_per_call_in_flight():
    """Other calls keep being answered (progress), this one never: it ends after idle_s
    for each call that was in flight beside it (here 3: itself and two others)."""
    idle = 0.5
    p = EncoderProgress(idle)

    async def run():
        async def others():
            for _ in range(60):  # two at a time, answered every 0.1 s: 6 s of progress
                await asyncio.gather(p.within(_answer_after(p, 0.1)),
                                     p.within(_answer_after(p, 0.1)))

        bg = asyncio.ensure_future(others())
        await asyncio.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(EncoderSilent, match="3 calls in flight"):
            await p.within(asyncio.sleep(10))
        took = time.monotonic() - t0
        bg.cancel()
        await asyncio.gather(bg, return_exceptions=True)
        return took

    took = asyncio.run(run())
    assert 3 * idle - 0.05 <= took < 4 * idle  # not at 1 x idle_s, not never


def test_an_uncounted_wait_follows_the_calls_it_queues_behind():
    """A request waiting for a shared call is not a call itself: it adds nothing to the calls
    in flight, and waits while they are answered."""
    p = EncoderProgress(IDLE)

    async def run():
        serial = _one_at_a_time(p, 0.15)
        calls = [asyncio.ensure_future(p.within(serial())) for _ in range(3)]
        await asyncio.sleep(0)
        assert p.in_flight == 3
        waited = asyncio.ensure_future(p.within(asyncio.shield(calls[-1]), counted=False))
        await asyncio.sleep(0)
        assert p.in_flight == 3
        await asyncio.gather(*calls)
        return await waited

    assert asyncio.run(run()) > 0
