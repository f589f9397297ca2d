"""NIXL transport: consumers READ items out of producers' NIXL-registered pools.

The peer-pull core (peer_pull/: the producer's pool and pins under the lease book,
announcements, the scheduler's catalog, the CURVE-authenticated side channel, the consumer's
pulls with deadlines and retries, checksum verification) with NIXL as the data path
(`NixlPath`): every worker runs one NIXL agent (UCX; no progress thread) with its pool (and a
small scratch page) registered once, as DRAM or, for a pool on a GPU, VRAM. A consumer
learns a producer's agent over the side channel (link.py), a pull's reply says where the
item lies, and the consumer READs it into its own pool block (server.py has the producer's
end). Reads, not producer writes: nothing is ever written into a consumer's memory from
outside, so there is no range to prove (the engine path's `Register`) and nothing to
quarantine after a frozen producer; docs/transports.md has the measurements.

A producer holds a large host item where it lies (`producer_put`): the tensor vLLM handed over
(or the host copy of a device tensor, made anyway) is registered on its own and read from
there, instead of copied once more into the pool; its pool block is kept unwritten, only to
count its bytes. Consumers load the registration's metadata sent with the pull's reply.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

import torch

from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.transports.base import Placement
from ec_connectors.transports.hashed_copy import usable_cores
from ec_connectors.transports.memory import MemoryPool, PoolBuffer
from ec_connectors.transports.nixl_pull.agent import NixlAgent, NixlUnavailable
from ec_connectors.transports.nixl_pull.host import rdma_devices
from ec_connectors.transports.nixl_pull.link import NixlPeerLink, pool_location
from ec_connectors.transports.nixl_pull.messages import NixlHello, NixlPeer
from ec_connectors.transports.nixl_pull.server import (
    NixlCounters,
    NixlServing,
    RegisteredInPlace,
)
from ec_connectors.transports.peer_pull.data_path import OpenLink, Server
from ec_connectors.transports.peer_pull.messages import Pull
from ec_connectors.transports.peer_pull.producer_store import HeldInPlace, PinnedItem
from ec_connectors.transports.peer_pull.transport import PeerPullTransport

logger = get_logger(__name__)

_SCRATCH = 4096  # registered host page a link's warming read lands in


class NixlPath:
    """The NIXL data path of one worker: its agent, and both halves (see the module).

    `loads_regions`: this consumer loads an item's own registration (`Pulled.region`); a
    consumer that does not (an older release) is served items held in place from the pool."""

    messages = (NixlHello, NixlPeer)
    session = ""  # reads name no destination session
    loads_regions = True

    def __init__(self, config: EPDConfig) -> None:
        self.config = config
        self.location = pool_location(config.memory_pool_device)
        self.agent = NixlAgent(f"epd-{os.getpid()}-{os.urandom(4).hex()}",
                               lanes=min(config.nixl_read_lanes, usable_cores()))
        self.counters = NixlCounters()
        self._scratch = torch.zeros(_SCRATCH, dtype=torch.uint8)
        self._in_place: bool | None = None  # decided on the first large put
        self._serving: NixlServing | None = None

    # -- memory ------------------------------------------------------------------------------
    def register(self, addr: int, size: int, location: str = "") -> None:
        """Register memory with the agent, where the pool lives unless `location` says."""
        self.agent.register(addr, size, location or self.location)

    def attach(self, pool: MemoryPool) -> None:
        """Register the scratch page the warming reads land in."""
        self.register(self._scratch.data_ptr(), _SCRATCH, "cpu:0")

    # -- producer ----------------------------------------------------------------------------
    def holds_in_place(self) -> bool:
        """`producer_put` in_place, or auto on a host without RDMA devices."""
        if self._in_place is None:
            self._in_place = self.config.producer_put == "in_place" or (
                self.config.producer_put == "auto" and not rdma_devices())
        return self._in_place

    def hold_in_place(self, buf: PoolBuffer, tensor: torch.Tensor) -> HeldInPlace | None:
        """The item's memory registered where it lies; None (copy) where NIXL refuses."""
        try:
            return RegisteredInPlace(buf, tensor, self.agent)
        except NixlUnavailable as exc:  # e.g. a limit on locked memory: copy as before
            logger.warning("EPD nixl: cannot register an item where it lies (%s); copying "
                           "large items into the pool from now on", exc)
            self._in_place = False
            return None

    def listen(self, host: str, port: int) -> str:
        """Nothing listens beside the side channel: consumers read through their agents."""
        return "NIXL reads"

    def start_serving(self, server: Server) -> None:
        """Answer agents' handshakes and hold pins for reads of the server's store."""
        self._serving = NixlServing(self.agent, self.location, self.counters)
        self._serving.start(server.store)

    def on_message(self, server: Server, msg: Any, peer: bytes) -> bool:
        """A consumer's `NixlHello` (NixlServing.on_message)."""
        return self._serving.on_message(server, msg, peer)

    def serve_held(self, server: Server, msg: Pull, peer: bytes, held: PinnedItem,
                   expires: float) -> bool:
        """Say where the item lies; it stays pinned for the read (NixlServing.serve_held)."""
        return self._serving.serve_held(server, msg, peer, held, expires)

    def stop_serving(self) -> None:
        """Drop every pin."""
        if self._serving is not None:
            self._serving.close()

    # -- consumer ----------------------------------------------------------------------------
    def reader(self, endpoint: str, open_link: OpenLink) -> NixlPeerLink:
        """The producer's agent loaded and warmed, and pulls as NIXL reads."""
        hello = NixlHello(agent=self.agent.name, regions=self.loads_regions)
        # into host memory one read, then verified on two threads, measured as fast as reads
        # verified as they land (docs/transports.md); a device pool's chunks are hashed
        # from host copies, which overlap the next read
        chunk = 0 if self.location == "cpu" else self.config.transfer_chunk_bytes
        return NixlPeerLink(endpoint, open_link, self.agent, self.location,
                            (self._scratch.data_ptr(), _SCRATCH), self.counters, hello, chunk)

    def health(self) -> dict[str, object]:
        """The NIXL counters, the agent's name and the pins held for reads."""
        pins = self._serving.pins if self._serving is not None else None
        return {**asdict(self.counters), "agent": self.agent.name,
                "read_pins": len(pins) if pins is not None else 0}

    def close(self) -> None:
        """Close the agent (its registrations and peers)."""
        self.agent.close()


class NixlTransport(PeerPullTransport):
    """Worker-role NIXL transport (see the module docstring). One per worker process."""

    name = "nixl"

    def __init__(self, config: EPDConfig, placement: Placement) -> None:
        path = NixlPath(config)
        try:
            super().__init__(config, placement, path)
        except BaseException:
            path.close()
            raise

    @property
    def agent(self) -> NixlAgent:
        """This worker's NIXL agent."""
        return self.path.agent
