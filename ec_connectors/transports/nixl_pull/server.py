"""Producer side of the NIXL data path: the agent handshake, and pins held for reads.

The core's side channel (peer_pull/server.py: CURVE with the deployment secret, queued pulls,
expiry, namespaces, inline small items) hands this data path two things (`NixlServing`): a
consumer's `NixlHello`, answered with this producer's agent metadata (`NixlPeer`), and a pull
of a large item, answered at once with where it lies in the registered pool and a one-time
token; the item stays pinned (never evicted or reused) until the consumer's READ ends with
that token as its NIXL notification, or until the pull's deadline. Nothing is written into a
consumer. A large host item may be held where it lies (`RegisteredInPlace`: its own memory
registered, a pool block only counting its bytes); the reply then carries that
registration's metadata for the consumer to load.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch

from ec_connectors.log import get_logger
from ec_connectors.transports.memory import PoolBuffer
from ec_connectors.transports.nixl_pull.agent import NixlAgent, Region
from ec_connectors.transports.nixl_pull.host import kernel_identity, mem_kind
from ec_connectors.transports.nixl_pull.messages import NixlHello, NixlPeer
from ec_connectors.transports.peer_pull.data_path import Server
from ec_connectors.transports.peer_pull.messages import Pull, Pulled
from ec_connectors.transports.peer_pull.producer_store import (
    HeldInPlace,
    PinnedItem,
    ProducerStore,
)
from epd_common.lru import BoundedLRU

logger = get_logger(__name__)

_POLL_S = 0.0005  # between polls of notifications while reads are in flight
_WARM_PIN_S = 10.0  # a consumer's first (warming) read is awaited this long
TOKEN_BYTES = 16
_MAX_CONNECTIONS = 4096  # consumers' connections remembered as loading regions


class RegisteredInPlace(HeldInPlace):
    """An item held where it lies, its memory registered with NIXL on its own (`region`).

    Deregistered when released, before the tensor is dropped. `in_pool` copies it into its
    pool block (once) for consumers that load no regions."""

    __slots__ = ("agent", "region", "copied", "_copying")

    def __init__(self, budget: PoolBuffer, tensor: torch.Tensor, agent: NixlAgent) -> None:
        super().__init__(budget, tensor)
        self.agent = agent
        self.region: Region = agent.register_region(self.addr, self.nbytes, "cpu")
        self.copied = False
        self._copying = threading.Lock()

    def in_pool(self) -> int:
        """The address of the item's copy in its pool block, made on the first call.

        Called with the item pinned (never released meanwhile)."""
        with self._copying:
            if not self.copied:
                self.budget.write(self.tensor)
                self.copied = True
        return self.budget.addr

    def unhold(self) -> None:
        """End the registration (before the tensor is dropped)."""
        self.agent.deregister(self.region)


class ReadPins:
    """Items pinned for consumers' reads, each dropped on its token's notification or deadline.

    Its thread polls the agent's notifications (which also makes UCX progress) only while
    pins are held; idle, it waits on a condition."""

    def __init__(self, agent: NixlAgent, store: ProducerStore | None) -> None:
        self._agent, self._store = agent, store
        self._pins: dict[bytes, tuple[PinnedItem | None, float]] = {}
        self._cond = threading.Condition()
        self._stop = False
        self.done = self.expired = 0
        self._thread = threading.Thread(target=self._run, name="epd-nixl-pins", daemon=True)
        self._thread.start()

    def hold(self, held: PinnedItem | None, until: float) -> bytes:
        """Keep `held` pinned until its read's notification or `until`; returns the token."""
        token = os.urandom(TOKEN_BYTES)
        with self._cond:
            self._pins[token] = (held, until)
            self._cond.notify_all()
        return token

    def __len__(self) -> int:
        """Pins held now."""
        return len(self._pins)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pins or self._stop)
                if self._stop:
                    return
            ended = [(m, False) for m in self._agent.notifications()]
            now = time.monotonic()
            with self._cond:
                ended += [(t, True) for t, (_, until) in self._pins.items() if until < now]
                dropped = [(self._pins.pop(t, (None, 0.0))[0], late) for t, late in ended
                           if t in self._pins]
            for held, late in dropped:
                if late:
                    self.expired += 1
                else:
                    self.done += 1
                if held is not None and self._store is not None:
                    self._store.unpin(held)
            time.sleep(_POLL_S)

    def close(self) -> None:
        """Stop polling and drop every pin."""
        with self._cond:
            self._stop = True
            pins, self._pins = list(self._pins.values()), {}
            self._cond.notify_all()
        self._thread.join(timeout=5)
        for held, _ in pins:
            if held is not None and self._store is not None:
                self._store.unpin(held)


@dataclass
class NixlCounters:
    """The NIXL data path's counters (health keys beside the core's pull counters)."""

    nixl_reads: int = 0
    nixl_split_reads: int = 0
    nixl_read_errors: int = 0
    nixl_read_timeouts: int = 0
    nixl_served: int = 0


class NixlServing:
    """The producer's half of the NIXL data path (see the module docstring).

    `pool_location` is where the registered pool lives ("cpu", "cuda:0")."""

    def __init__(self, agent: NixlAgent, pool_location: str, counters: NixlCounters) -> None:
        self.agent, self.counters = agent, counters
        self.pins: ReadPins | None = None
        self._mem, self._device = mem_kind(pool_location)
        self._kernel = kernel_identity()
        self._metadata = agent.metadata()
        # connections whose consumer loads items' own registrations (NixlHello.regions)
        self._region_readers: BoundedLRU[bytes, None] = BoundedLRU(_MAX_CONNECTIONS)

    def start(self, store: ProducerStore) -> None:
        """Hold pins for reads of `store`'s items."""
        self.pins = ReadPins(self.agent, store)

    def on_message(self, server: Server, msg: object, peer: bytes) -> bool:
        """A consumer's `NixlHello`: answer with this agent, and a pin for its warming read."""
        if not isinstance(msg, NixlHello):
            return False
        if msg.regions:
            self._region_readers[peer] = None
        pool = server.store.pool
        warm = self.pins.hold(None, time.monotonic() + _WARM_PIN_S)
        server.reply(peer, NixlPeer(agent=self.agent.name, metadata=self._metadata,
                                    base=pool.base_addr, length=pool.capacity,
                                    mem=self._mem, device=self._device, warm=warm,
                                    kernel=self._kernel))
        return True

    def serve_held(self, server: Server, msg: Pull, peer: bytes, held: PinnedItem,
                   expires: float) -> bool:
        """Answer where the item lies; it stays pinned for the consumer's READ."""
        config = server.config
        cap = time.monotonic() + config.transfer_timeout_base_s + \
            held.info.nbytes / config.min_transfer_bytes_per_s
        token = self.pins.hold(held, min(expires, cap))
        self.counters.nixl_served += 1
        addr, region = held.buf.addr, b""
        if isinstance(held.buf, RegisteredInPlace):
            if peer in self._region_readers:
                region = held.buf.region.metadata
            else:  # a consumer that loads no regions reads the item in the pool
                addr = held.buf.in_pool()
        server.reply(peer, Pulled(pull_id=msg.pull_id, info=held.info, src_addr=addr,
                                  token=token, region=region))
        return True

    def close(self) -> None:
        """Drop every pin (the side channel is closed already)."""
        if self.pins is not None:
            self.pins.close()
