"""The Transfer Engine data path: a producer writes each item into its consumer's pool.

Starting the Mooncake Transfer Engine of a worker process (P2P handshake, TCP or RDMA),
with one clear error when the wheel or its libraries are missing, only where items move
through it (`needs_engine`), its listeners' ports from the port plan (engine_ports.py); and
`EnginePath`, the data path the core (peer_pull/) is given then: every side-channel
connection opens with the consumer's `Register` (its pool's range, proven: ranges.py), and a
large item is written into the pull's buffer chunk by chunk (`Progress` as chunks land, no
reply while a chunk may still write). A buffer whose pull timed out may still be written by a
frozen producer: the core's link quarantines it until that producer answers or disconnects.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from typing import Any

import torch

from ec_connectors.config import EPDConfig
from ec_connectors.transports.engine_ports import EngineRangeError, plan_engine_ports
from ec_connectors.transports.memory import MemoryPool, PoolBuffer
from ec_connectors.transports.mooncake_te.messages import (
    MESSAGES,
    Register,
    StreamOpen,
    writes_nothing,
)
from ec_connectors.transports.mooncake_te.ranges import ConsumerRanges
from ec_connectors.transports.peer_pull.data_path import OpenLink, PeerReader, Server
from ec_connectors.transports.peer_pull.messages import Progress, Pull, Pulled, PullFailed
from ec_connectors.transports.peer_pull.producer_store import HeldInPlace, PinnedItem

_OWN_PAGE = 4096  # registered page: our proof nonce, then a producer's scratch slots
_REGISTER_WAIT_S = 5.0  # a pull waits this long at most for its connection's Register
_CHUNKS_AHEAD = 2  # chunk writes submitted and not yet seen landed, per pull
_POLL_S = 0.0002  # between checks of a chunk write in flight


class TransferEngineUnavailable(RuntimeError):
    """The transfer engine cannot start or register memory in this process."""


def needs_engine(config: EPDConfig) -> bool:
    """Whether this process moves items with the transfer engine.

    Whether this process moves items with the engine: not on the socket data path
    (`te_data_path`, by default over TCP with a host pool), where an engine would only add
    two listeners on every interface (Mooncake binds them there whatever it is told) that
    nothing uses. A process without one neither proves nor writes into registered ranges:
    every process of a deployment must resolve `te_data_path` alike."""
    return not config.te_socket


def start_engine(config: EPDConfig, host: str):
    """This worker's transfer engine, listening on `host`; raises TransferEngineUnavailable."""
    try:
        plan_engine_ports(config, "mooncake.engine")
    except EngineRangeError as exc:
        raise TransferEngineUnavailable(str(exc)) from None
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(config.progress_timeout_s))
    # The engine's TCP server listens where MC_TCP_BIND_ADDRESS says (else on every
    # interface): on the data-plane address, loopback without a deployment secret.
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransferEngineUnavailable(
            "transport 'mooncake' needs the Mooncake Transfer Engine: pip install "
            "'epd-serve[cpu]' (mooncake-transfer-engine-non-cuda) or '[cuda]'; it needs "
            f"libibverbs.so.1 (apt-get install libibverbs1). Import failed: {exc}") from exc
    engine = TransferEngine()
    device = config.device_name or os.environ.get("RDMA_DEVICE_NAME", "")
    rc = engine.initialize(host, "P2PHANDSHAKE", config.protocol, device if
                           config.protocol == "rdma" else "")
    if rc != 0:
        raise TransferEngineUnavailable(
            f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {config.protocol!r}, "
            f"{device!r}) failed with {rc}; check host/protocol/device_name")
    return engine


def give_up_s(config: EPDConfig, nbytes: int) -> float:
    """How long moving `nbytes` of one pull may take before it counts as failed.

    Past the engine's own progress timeout (MC_TCP_PROGRESS_TIMEOUT_SEC), so a stuck write
    is normally failed, and stopped, by the engine first; the socket path bounds a send
    alike."""
    return 2 * config.progress_timeout_s + nbytes / config.min_transfer_bytes_per_s


class EnginePath:
    """The engine data path of the `mooncake` transport (te_data_path engine), one per worker.

    Consumer: its pool and a page of its own registered with the engine; every connection
    opens with `Register` (the pool's range, the page's nonce as the proof). Producer: a
    connection's range proved on the server's handshake threads, each large item written
    into the range its pull's connection proved."""

    messages = MESSAGES

    def __init__(self, config: EPDConfig, host: str) -> None:
        self.config = config
        self.engine = start_engine(config, host)
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._pool: MemoryPool | None = None
        # Our own registered page: the nonce a consumer proves its session with (first
        # bytes), and a producer's scratch for reading other consumers' proofs (the rest).
        self._own = torch.zeros(_OWN_PAGE, dtype=torch.uint8)
        self._nonce = os.urandom(ConsumerRanges.NONCE_BYTES)
        self.ranges: ConsumerRanges | None = None

    # -- memory ------------------------------------------------------------------------------
    def register(self, addr: int, size: int, location: str = "") -> None:
        """Register memory with the engine (the pool, the own page), once."""
        location = location or ("cpu:0" if self.config.memory_pool_device == "cpu" else
                                f"cuda:{torch.cuda.current_device()}")
        try:
            rc = self.engine.register_memory(addr, size, location)
        except TypeError:  # wheels before 0.3.13 take no location (they detect it)
            rc = self.engine.register_memory(addr, size)
        if rc != 0:
            raise TransferEngineUnavailable(f"register_memory of the {size}-byte pool failed "
                                            f"with {rc}")

    def attach(self, pool: MemoryPool) -> None:
        """Take the pool (its range goes in `Register`) and register the own page."""
        self._pool = pool
        self.register(self._own.data_ptr(), _OWN_PAGE, "cpu:0")
        self._own[:len(self._nonce)] = torch.frombuffer(bytearray(self._nonce),
                                                        dtype=torch.uint8)

    # -- producer ----------------------------------------------------------------------------
    def holds_in_place(self) -> bool:
        """Never: the engine writes from registered memory only."""
        return False

    def hold_in_place(self, buf: PoolBuffer, tensor: torch.Tensor) -> HeldInPlace | None:
        """Never asked (holds_in_place is False): copy."""
        return None

    def listen(self, host: str, port: int) -> str:
        """Nothing listens beside the side channel (the engine's listeners run already)."""
        return "engine writes"

    def start_serving(self, server: Server) -> None:
        """Prove consumers' ranges by reading their nonces through the engine."""
        self.ranges = ConsumerRanges(self.engine.transfer_sync_read,
                                     memoryview(self._own.numpy()), self._own.data_ptr())

    def on_message(self, server: Server, msg: Any, peer: bytes) -> bool:
        """A connection's `Register`: record its range and prove it on a thread of its own."""
        if isinstance(msg, StreamOpen):  # a socket-path consumer's: nothing listens for it
            return True
        if not isinstance(msg, Register) or self.ranges is None:
            return False
        claim = self.ranges.register(peer, msg.session, msg.base, msg.length)
        if not claim.done.is_set():
            server.handshakes.submit(self.ranges.prove, claim, msg.proof_addr, msg.nonce,
                                     self.config.transfer_timeout_base_s)
        return True

    def serve_held(self, server: Server, msg: Pull, peer: bytes, held: PinnedItem,
                   expires: float) -> bool:
        """Write the item into the range the pull's connection proved, then answer `Pulled`.

        The pin is dropped by the caller (False)."""
        if not msg.session:
            server.counters.unregistered += 1
            server.reply(peer, writes_nothing(msg.pull_id, server.endpoint, "the consumer"))
            return False
        refused = self.ranges.check(peer, msg.session, msg.dst_addr, held.info.nbytes,
                                    min(expires, time.monotonic() + _REGISTER_WAIT_S))
        if refused:
            server.counters.unregistered += 1
            server.reply(peer, PullFailed(pull_id=msg.pull_id, code="unregistered",
                                          error=f"{server.endpoint} writes nothing: {refused}"))
            return False
        if self.write(server, msg, peer, held, expires):
            server.reply(peer, Pulled(pull_id=msg.pull_id, info=held.info))
        return False

    def write(self, server: Server, msg: Pull, peer: bytes, held: PinnedItem,
              expires: float) -> bool:
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
                    failure = _transfer_failed(msg, 0)
                    break
                flying.append((batch, start + n, time.monotonic() + give_up_s(self.config, n)))
            if not flying:
                break
            batch, end, give_up = flying.popleft()
            rc = self._landed(batch, give_up)
            if rc != 0 and failure is None:
                failure = _transfer_failed(msg, rc)
            elif failure is None and end < nbytes:
                server.reply(peer, Progress(pull_id=msg.pull_id, done=end))
        if failure is not None:
            server.reply(peer, failure)
            return False
        if expired:  # the rest is never written: say so once nothing is in flight
            server.expired(msg, peer, expires)
            return False
        return True

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

    def stop_serving(self) -> None:
        """Nothing to close beside the side channel."""

    # -- consumer ----------------------------------------------------------------------------
    def reader(self, endpoint: str, open_link: OpenLink) -> PeerReader:
        """The side channel itself: the producer writes, the link waits and quarantines."""
        assert self._pool is not None, "attach() first"
        return open_link(Register(session=self.session, base=self._pool.base_addr,
                                  length=self._pool.capacity,
                                  proof_addr=self._own.data_ptr(), nonce=self._nonce), None)

    def health(self) -> dict[str, object]:
        """No keys of its own."""
        return {}

    def close(self) -> None:
        """Unregister the pool and the own page (the pool is closed already)."""
        for addr in (self._pool.base_addr if self._pool else 0, self._own.data_ptr()):
            if addr:
                with contextlib.suppress(Exception):
                    self.engine.unregister_memory(addr)


def _transfer_failed(msg: Pull, rc: int) -> PullFailed:
    return PullFailed(pull_id=msg.pull_id, code="transfer",
                      error=f"transfer_submit_write to {msg.session} returned {rc}")
