"""Producer side of the Mooncake TE transport: announcements, ranges, pulls.

Producer side of the Mooncake TE transport: the ZMQ PUB that announces the items a worker
holds (producer_store.py: its pool's items and pins, under the lease book) to catalogs, the ranges
consumers proved are theirs (the only places pulls are written to), and the side channel that
serves pulls (PullServer: with the engine; or on a consumer's data connection, stream.py)."""

from __future__ import annotations

import hmac
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgspec
import torch
import zmq

from ec_connectors.channel import Channel
from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.protocol.curve import CurveKeys
from ec_connectors.transports.mooncake_te import messages, stream, stream_server
from ec_connectors.transports.mooncake_te.messages import (
    PeerMessage,
    Progress,
    Pull,
    Pulled,
    PullFailed,
    Register,
    StreamOpen,
)
from ec_connectors.transports.mooncake_te.producer_store import PinnedItem, ProducerStore
from epd_common.lru import BoundedLRU
from epd_common.net import parse_endpoint

logger = get_logger(__name__)

_REGISTER_WAIT_S = 5.0  # a pull waits this long at most for its connection's Register
_CHUNKS_AHEAD = 2  # chunk writes submitted and not yet seen landed, per pull
_POLL_S = 0.0002  # between checks of a chunk write in flight


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


class PullServer:
    """A producer's side channel (ZMQ ROUTER).

    A connection's `Register` is proved on threads of its own; a `Pull` is queued (at most
    `max_queued_pulls`, else answered `busy`) for the serve threads, which answer it inline when
    the item is small, or write it with the transfer engine into the range that connection
    proved, chunk by chunk (`Progress`), and stop once the pull's deadline passed. With
    `streams` (te_data_path socket), `StreamOpen` makes a data connection's ticket live, and
    each served data connection's pulls are answered on it by the thread that reads it
    (`_serve_connection`): the reply, then the item's bytes, never through the engine. `stats`:
    the transport's pull counters."""

    def __init__(self, address: str, endpoint: str, store: ProducerStore,
                 ranges: ConsumerRanges, engine, config: EPDConfig, namespace: str,
                 stats: dict[str, int], context: zmq.Context,
                 curve: CurveKeys | None = None,
                 streams: stream_server.StreamServer | None = None) -> None:
        self.endpoint = endpoint
        self.store, self.ranges, self.engine = store, ranges, engine
        self.streams = streams
        if streams is not None:
            streams.set_serve(self._serve_connection)
        self.config, self.namespace, self.stats = config, namespace, stats
        self._queued = 0  # pulls accepted and not yet served
        self._lock = threading.Lock()
        self._serve = ThreadPoolExecutor(config.serve_threads, thread_name_prefix="epd-serve")
        # Proofs of registrations run apart: pulls on the serve threads may be waiting for them.
        self._prove = ThreadPoolExecutor(2, thread_name_prefix="epd-register")
        self.channel: Channel | None = None
        self.channel = Channel(address, bind=True, on_message=self._on_message,
                               name="epd-peer-server", decode=messages.decode_peer,
                               context=context, curve=curve)

    def _on_message(self, msg: PeerMessage, peer: bytes | None, _payload: list[bytes]) -> None:
        if isinstance(msg, Register) and peer is not None:
            if self.engine is None:  # nothing is ever written into a consumer: no range
                return
            claim = self.ranges.register(peer, msg.session, msg.base, msg.length)
            if not claim.done.is_set():
                self._prove.submit(self.ranges.prove, claim, msg.proof_addr, msg.nonce,
                                   self.config.transfer_timeout_base_s)
            return
        if isinstance(msg, StreamOpen):
            if self.streams is not None:
                self.streams.expect(msg.ticket)
            return
        if not isinstance(msg, Pull) or peer is None:
            return
        try:  # none from a consumer without an engine: inline answers only
            if msg.session:
                parse_endpoint(msg.session)
        except ValueError as exc:
            self._reply(peer, PullFailed(pull_id=msg.pull_id, code="bad_request", error=str(exc)))
            return
        with self._lock:
            if self._queued >= self.config.max_queued_pulls:
                busy = True
            else:
                busy = False
                self._queued += 1
        if busy:
            self._reply(peer, PullFailed(pull_id=msg.pull_id, code="busy",
                                         error=f"{self.endpoint} has "
                                               f"{self.config.max_queued_pulls} pulls queued"))
            return
        self._serve.submit(self._serve_queued, msg, peer, _expires(msg))

    def _serve_queued(self, msg: Pull, peer: bytes, expires: float) -> None:
        try:
            self._serve_pull(msg, peer, expires)
        finally:
            with self._lock:
                self._queued -= 1

    def _expired(self, msg: Pull, peer: bytes, expires: float) -> bool:
        """Past the pull's deadline: say so (the consumer frees its buffer) and stop."""
        refusal = self._expiry(msg, expires)
        if refusal is not None:
            self._reply(peer, refusal)
        return refusal is not None

    def _expiry(self, msg: Pull, expires: float) -> PullFailed | None:
        if time.monotonic() <= expires:
            return None
        self.stats["expired"] += 1
        return PullFailed(pull_id=msg.pull_id, code="expired",
                          error=f"the pull's {msg.timeout_s:.3g} s passed at "
                                f"{self.endpoint}; nothing more is written")

    def _foreign(self, msg: Pull) -> PullFailed | None:
        if not msg.namespace or msg.namespace == self.namespace:
            return None
        return PullFailed(pull_id=msg.pull_id, code="namespace",
                          error=f"{self.endpoint} serves model namespace "
                                f"{self.namespace!r}, not {msg.namespace!r}")

    def _absent(self, msg: Pull) -> PullFailed:
        code = self.store.absent(msg.key)
        return PullFailed(pull_id=msg.pull_id, code=code,
                          error=f"item {msg.key} is {code} at {self.endpoint}")

    def _reply(self, peer: bytes, msg: msgspec.Struct, payload: bytes | None = None) -> None:
        if self.channel is not None:
            self.channel.send(msg, to=peer, payload=payload)

    def _serve_pull(self, msg: Pull, peer: bytes, expires: float = float("inf")) -> None:
        if self._expired(msg, peer, expires):
            return
        refusal = self._foreign(msg)
        if refusal is not None:
            self._reply(peer, refusal)
            return
        held = self.store.pin(msg.key)
        if held is None:
            self._reply(peer, self._absent(msg))
            return
        try:
            info = held.info
            if info.nbytes <= self.config.inline_max_bytes:
                data = bytes(held.buf.as_tensor(torch.uint8, (info.nbytes,)).cpu().numpy())
                self._reply(peer, Pulled(pull_id=msg.pull_id, info=info, inline=True), data)
                return
            if msg.capacity < info.nbytes:
                self._reply(peer, PullFailed(pull_id=msg.pull_id, code="too_small", info=info,
                                             error=f"needs {info.nbytes} bytes"))
                return
            if self._serve_held(msg, peer, held, expires):
                held = None  # the data path keeps the pin until the consumer is done
        finally:
            if held is not None:
                self.store.unpin(held)

    def _serve_held(self, msg: Pull, peer: bytes, held: PinnedItem, expires: float) -> bool:
        """Move a pinned item to the puller and answer; True when the pin is kept.

        The engine path: write it into the range the pull's connection proved, then answer
        `Pulled`; the pin is dropped by the caller. nixl_pull/ serves it its own way."""
        info = held.info
        if self.engine is None or not msg.session:
            self.stats["unregistered"] += 1
            self._reply(peer, PullFailed(
                pull_id=msg.pull_id, code="unregistered", error=f"{self.endpoint} writes "
                f"nothing: {'it' if self.engine is None else 'the consumer'} runs no "
                "transfer engine (te_data_path socket); set te_data_path alike everywhere"))
            return False
        refused = self.ranges.check(peer, msg.session, msg.dst_addr, info.nbytes,
                                    min(expires, time.monotonic() + _REGISTER_WAIT_S))
        if refused:
            self.stats["unregistered"] += 1
            self._reply(peer, PullFailed(pull_id=msg.pull_id, code="unregistered",
                                         error=f"{self.endpoint} writes nothing: {refused}"))
            return False
        if self._write(msg, peer, held, expires):
            self._reply(peer, Pulled(pull_id=msg.pull_id, info=info))
        return False

    def _serve_connection(self, conn: socket.socket) -> None:
        """Serve the pulls of one data connection until it ends.

        A served data connection (its ticket came over the side channel): `READY`, then
        its pulls one after another, each answered on it from this thread (nothing is
        written into the consumer: no range to check). Returns, and the connection is
        closed, when it is idle, closed, sends garbage or a reply cannot be sent."""
        conn.settimeout(self.config.transfer_timeout_base_s)
        try:
            conn.sendall(stream.READY)
        except OSError:  # the consumer gave up on it already
            return
        while (msg := stream_server.read_request(conn)) is not None:
            try:
                self._serve_streamed(conn, msg, _expires(msg))
            except (OSError, stream.StreamError) as exc:
                self.stats["stream_errors"] += 1
                logger.warning("EPD: streaming %s to a consumer failed: %s", msg.key, exc)
                return

    def _serve_streamed(self, conn: socket.socket, msg: Pull, expires: float) -> None:
        """Serve one pull on a data connection.

        One pull on a data connection: the same answers as on the side channel (expired,
        namespace, unknown / pending / evicted / failed, too_small), else `Pulled` (the
        digest) and the item's bytes in one stream, sent by the pull's deadline."""
        held = None
        reply = self._expiry(msg, expires) or self._foreign(msg)
        if reply is None:
            held = self.store.pin(msg.key)
            if held is None:
                reply = self._absent(msg)
            elif msg.capacity < held.info.nbytes:
                reply = PullFailed(pull_id=msg.pull_id, code="too_small", info=held.info,
                                   error=f"needs {held.info.nbytes} bytes")
        try:
            if held is None or reply is not None:  # a few bytes, even past the deadline
                stream_server.send_reply(conn, reply,
                                  time.monotonic() + self.config.transfer_timeout_base_s)
                return
            stream_server.send_reply(conn, Pulled(pull_id=msg.pull_id, info=held.info),
                              min(expires, time.monotonic()
                                  + self._give_up_s(held.info.nbytes)), held.buf)
        finally:
            if held is not None:
                self.store.unpin(held)

    def _write(self, msg: Pull, peer: bytes, held: PinnedItem, expires: float) -> bool:
        """The item into the puller's buffer, chunk by chunk; False once a reply ended it.

        Up to `_CHUNKS_AHEAD` chunks are submitted at once (the engine sends the next while
        we learn the previous landed); each is reported (`Progress`) as soon as it and all
        before it landed, so the consumer verifies it while the rest flies. No reply goes
        out while a submitted chunk may still write into the consumer's buffer."""
        nbytes = held.info.nbytes
        chunk = self.config.transfer_chunk_bytes or nbytes
        starts = iter(range(0, nbytes, chunk))
        flying: deque[tuple[int, int, float]] = deque()  # (batch id, end, give up at)
        failure: PullFailed | None = None
        expired = False
        while True:
            while failure is None and not expired and len(flying) < _CHUNKS_AHEAD:
                start = next(starts, None)
                if start is None:
                    break
                if time.monotonic() > expires:
                    expired = True
                    break
                n = min(chunk, nbytes - start)
                batch = self.engine.transfer_submit_write(msg.session, held.buf.addr + start,
                                                          msg.dst_addr + start, n)
                if not batch:
                    failure = self._transfer_failed(msg, "transfer_submit_write", 0)
                    break
                flying.append((batch, start + n, time.monotonic() + self._give_up_s(n)))
            if not flying:
                break
            batch, end, give_up = flying.popleft()
            rc = self._landed(batch, give_up)
            if rc != 0 and failure is None:
                failure = self._transfer_failed(msg, "transfer_submit_write", rc)
            elif failure is None and end < nbytes:
                self._reply(peer, Progress(pull_id=msg.pull_id, done=end))
        if failure is not None:
            self._reply(peer, failure)
            return False
        if expired:  # the rest is never written: say so once nothing is in flight
            self._expired(msg, peer, expires)
            return False
        return True

    def _give_up_s(self, nbytes: int) -> float:
        """How long one chunk's write may take before it counts as failed.

        How long one chunk may take before its write counts as failed: past the engine's
        own progress timeout (MC_TCP_PROGRESS_TIMEOUT_SEC), so a stuck write is normally
        failed, and stopped, by the engine first."""
        return 2 * self.config.progress_timeout_s + nbytes / self.config.min_transfer_bytes_per_s

    def _landed(self, batch: int, give_up: float) -> int:
        """Wait for a submitted write to land; 0 or the engine's error code.

        Wait for a submitted write: 0 once it landed, else the engine's code (or -3 past
        `give_up`). Sleeps between checks: the engine's own sync write spins a core while
        it waits, a core the engine's sender and the consumer need on a small host."""
        while True:
            rc = self.engine.transfer_check_status(batch)
            if rc == 1:
                return 0
            if rc < 0:
                return rc
            if time.monotonic() > give_up:
                return -3
            time.sleep(_POLL_S)

    def _transfer_failed(self, msg: Pull, call: str, rc: int) -> PullFailed:
        return PullFailed(pull_id=msg.pull_id, code="transfer",
                          error=f"{call} to {msg.session} returned {rc}")

    def close(self) -> None:
        """Stop answering, then let the serve threads finish (queued pulls are dropped)."""
        if self.channel is not None:
            self.channel.close()
        if self.streams is not None:  # a send in flight fails at once
            self.streams.close()
        self._serve.shutdown(wait=True, cancel_futures=True)
        self._prove.shutdown(wait=True, cancel_futures=True)


def _expires(msg: Pull) -> float:
    """When a pull's deadline passes on this host's clock (none for older consumers)."""
    return time.monotonic() + msg.timeout_s if msg.timeout_s > 0 else float("inf")
