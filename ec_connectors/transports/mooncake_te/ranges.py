"""The memory ranges consumers proved theirs: where the engine path may write pulls.

The engine path writes an item straight into the consumer's registered pool. Every
side-channel connection opens with the consumer's `Register` (mooncake_te/messages.py): its
pool's range and a nonce placed in it, which the producer reads back through the engine
before it writes anything there. Pulls on a connection are written only into the range that
connection proved, so a peer holding the deployment secret still cannot aim a producer at
another consumer's memory."""

from __future__ import annotations

import hmac
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from epd_common.lru import BoundedLRU
from epd_common.net import parse_endpoint


@dataclass
class _Claim:
    """A connection's registered range; `ok` once its nonce was read back from its session."""

    session: str
    base: int
    end: int
    done: threading.Event
    ok: bool = False
    error: str = ""


class ConsumerRanges:
    """The memory ranges each consumer proved, where pulls may be written.

    Where a producer may write: per side-channel connection (ZMQ ROUTER identity), the one
    range it registered and proved (messages.Register). A pull names a destination; it is
    written only when that lies inside its own connection's proven range, so a peer holding
    the deployment secret still cannot aim the producer at another consumer's memory."""

    NONCE_BYTES = 16
    _MAX_CONNECTIONS = 4096  # the oldest registrations go first beyond this

    def __init__(self, read: Callable[[str, int, int, int], int], page: memoryview,
                 page_addr: int, first_slot: int = 64) -> None:
        self._read = read  # engine.transfer_sync_read(session, local, remote, n) -> rc
        self._page, self._page_addr = page, page_addr  # registered scratch (slots from 64)
        self._slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for off in range(first_slot, len(page) - self.NONCE_BYTES + 1, 64):
            self._slots.put(off)
        self._claims: BoundedLRU[bytes, _Claim] = BoundedLRU(self._MAX_CONNECTIONS)
        self._cond = threading.Condition()

    def register(self, peer: bytes, session: str, base: int, length: int) -> _Claim:
        """Record a consumer connection's claim to a memory range.

        Record `peer`'s claim; it is refused at once when `session` is not an endpoint,
        else `prove` decides."""
        claim = _Claim(session, base, base + max(0, length), threading.Event())
        try:
            parse_endpoint(session)
        except ValueError as exc:
            claim.error = str(exc)
            claim.done.set()
        with self._cond:
            self._claims[peer] = claim
            self._cond.notify_all()
        return claim

    def prove(self, claim: _Claim, proof_addr: int, nonce: bytes, timeout_s: float) -> None:
        """Read the nonce back from the claimed session (its own thread; one engine read)."""
        try:
            if len(nonce) != self.NONCE_BYTES:
                claim.error = f"a nonce of {len(nonce)} bytes, not {self.NONCE_BYTES}"
                return
            try:
                off = self._slots.get(timeout=timeout_s)
            except queue.Empty:
                claim.error = "too many registrations at once"
                return
            try:
                rc = self._read(claim.session, self._page_addr + off, proof_addr,
                                self.NONCE_BYTES)
                seen = bytes(self._page[off:off + self.NONCE_BYTES])
            finally:
                self._slots.put(off)
            if rc != 0:
                claim.error = f"cannot read the proof from session {claim.session} (rc {rc})"
            elif not hmac.compare_digest(seen, nonce):
                claim.error = f"the proof read from session {claim.session} does not match"
            else:
                claim.ok = True
        finally:
            claim.done.set()

    def check(self, peer: bytes, session: str, addr: int, nbytes: int, deadline: float) -> str:
        """Check that a pull's destination lies in the range its connection proved.

        "" when [addr, addr + nbytes) of `session` lies in the range `peer` proved, else why
        not. Waits (until `deadline`) for a registration still on its way or being proved."""
        with self._cond:
            self._cond.wait_for(lambda: peer in self._claims,
                                max(0.0, deadline - time.monotonic()))
            claim = self._claims.get(peer)
        if claim is None:
            return "this connection registered no range"
        if not claim.done.wait(max(0.0, deadline - time.monotonic())):
            return "the connection's range is not proven yet"
        if not claim.ok:
            return f"the connection's range was refused: {claim.error}"
        if session != claim.session or not claim.base <= addr <= addr + nbytes <= claim.end:
            return (f"{nbytes} bytes at {addr:#x} of {session} are outside the range this "
                    f"connection registered")
        return ""
