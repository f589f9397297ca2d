"""The deadline of an encode call that waits behind other calls on the same encoder.

An encoder works through the calls it is given one step at a time: four 120-frame clips sent
together are answered one after another, the last long after `timeouts.encoder_s` has passed
since it was sent, while the encoder was busy, not down. A fixed deadline per call sent that
clip raw to the decode instance, which then encoded it a second time, on the instance that
should be decoding. Here a call fails when the encoder has answered nothing, to any call, for
`idle_s` (a dead or stuck encoder is still found within `idle_s`), and at the latest after
`idle_s` for every call that was in flight beside it (a call the encoder keeps passing over
still ends).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class EncoderSilent(Exception):
    """The call's deadline passed; the message says which rule ended it."""


class _Call:
    __slots__ = ("start", "peak")

    def __init__(self, start: float, peak: int) -> None:
        self.start = start
        self.peak = peak  # the most calls in flight on the encoder while this one was


class EncoderProgress:
    """One encoder's calls in flight and when it last answered: the deadline of each call.

    `within(aw)` awaits one call under the rules above; `answered()` is called whenever the
    encoder answers a call (any status: an answer is progress, a refused connection is not).
    Waits that share a call (a request queued for a coalesced call) pass `counted=False`:
    they wait under the same rules, counting the call they will ride on, without adding to
    the calls in flight."""

    def __init__(self, idle_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self.clock = clock
        self.answered_at = float("-inf")
        self._open: set[_Call] = set()

    @property
    def in_flight(self) -> int:
        return len(self._open)

    def answered(self) -> None:
        self.answered_at = self.clock()

    def deadline(self, call: _Call) -> float:
        """When `call` fails if nothing changes.

        `idle_s` after the later of its start and the encoder's last answer, and never later
        than `idle_s` per call in flight beside it."""
        quiet = max(call.start, self.answered_at) + self.idle_s
        return min(quiet, call.start + self.idle_s * max(1, call.peak))

    def why(self, call: _Call) -> str:
        now = self.clock()
        if max(call.start, self.answered_at) + self.idle_s <= now:
            return f"the encoder answered no call for {self.idle_s:g} s"
        return (f"{self.idle_s:g} s for each of the {call.peak} calls in flight on the "
                f"encoder meanwhile, its own included")

    async def within(self, aw: Awaitable[T], counted: bool = True) -> T:
        """`aw`'s result, or EncoderSilent once its deadline passes (`aw` is cancelled)."""
        task = asyncio.ensure_future(aw)
        # an uncounted wait rides on a call still to be sent: that one is counted here too
        call = _Call(self.clock(), self.in_flight + 1)
        if counted:
            self._open.add(call)
            for other in self._open:
                other.peak = max(other.peak, len(self._open))
        try:
            while True:
                left = self.deadline(call) - self.clock()
                if left <= 0:
                    waited = self.clock() - call.start
                    raise EncoderSilent(f"no answer within {waited:.1f} s ({self.why(call)})")
                done, _ = await asyncio.wait({task}, timeout=left)
                if done:
                    return task.result()
                if not counted:  # what it waits behind may have grown meanwhile
                    call.peak = max(call.peak, self.in_flight + 1)
        finally:
            self._open.discard(call)
            if not task.done():
                task.cancel()
