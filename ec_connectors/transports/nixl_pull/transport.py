"""NIXL transport: consumers READ items out of producers' NIXL-registered pools.

The Mooncake TE transport's machinery (mooncake_te/: the producer's pool and pins under the
lease book, announcements, the scheduler's catalog, the CURVE-authenticated side channel,
the consumer's pulls with deadlines and retries, checksum verification) with NIXL as the
data path: every worker runs one NIXL agent (UCX; no progress thread) with its pool (and a
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
from collections.abc import Callable

import torch

from ec_connectors.config import EPDConfig
from ec_connectors.log import get_logger
from ec_connectors.transports.base import Placement
from ec_connectors.transports.hashed_copy import usable_cores
from ec_connectors.transports.memory import PoolBuffer
from ec_connectors.transports.mooncake_te.peer_link import PeerLink
from ec_connectors.transports.mooncake_te.producer import PullServer
from ec_connectors.transports.mooncake_te.producer_store import HeldInPlace
from ec_connectors.transports.mooncake_te.transport import MooncakeTransport
from ec_connectors.transports.nixl_pull.agent import NixlAgent, NixlUnavailable, rdma_devices
from ec_connectors.transports.nixl_pull.link import NixlPeerLink, pool_location
from ec_connectors.transports.nixl_pull.messages import NixlHello
from ec_connectors.transports.nixl_pull.server import NixlPullServer, RegisteredInPlace

logger = get_logger(__name__)


class NixlTransport(MooncakeTransport):
    """Worker-role NIXL transport (see the module docstring). One per worker process."""

    name = "nixl"

    def __init__(self, config: EPDConfig, placement: Placement) -> None:
        self.location = pool_location(config.memory_pool_device)
        self.agent = NixlAgent(f"epd-{os.getpid()}-{os.urandom(4).hex()}",
                               lanes=min(config.nixl_read_lanes, usable_cores()))
        try:
            super().__init__(config, placement)
        except BaseException:
            self.agent.close()
            raise
        for key in ("nixl_reads", "nixl_split_reads", "nixl_read_errors", "nixl_read_timeouts",
                    "nixl_served"):
            self.pull_stats.setdefault(key, 0)

    def _start_engine(self):
        return None

    def _register(self, addr: int, size: int, location: str = "") -> None:
        self.agent.register(addr, size, location or self.location)

    def _hello(self, nonce: bytes) -> NixlHello:
        return NixlHello(agent=self.agent.name, regions=True)

    def _make_link(self, hello: NixlHello) -> Callable[[str], PeerLink]:  # type: ignore[override]
        scratch = (self._own.data_ptr(), self._own.numel())
        # into host memory one read, then verified on two threads, measured as fast as reads
        # verified as they land (docs/transports.md); a device pool's chunks are hashed
        # from host copies, which overlap the next read
        chunk = 0 if self.location == "cpu" else self.config.transfer_chunk_bytes

        def make(endpoint: str) -> NixlPeerLink:
            return NixlPeerLink(endpoint, self._zmq, self.curve, self.agent, self.location,
                                scratch, self.pull_stats, hello, chunk)
        return make

    def _streams_wanted(self) -> bool:
        return False

    def _holds_in_place(self) -> bool:
        return self.config.producer_put == "in_place" or (
            self.config.producer_put == "auto" and not rdma_devices())

    def _hold_in_place(self, buf: PoolBuffer, tensor: torch.Tensor) -> HeldInPlace | None:
        """The item's memory registered where it lies; None (copy) where NIXL refuses."""
        try:
            return RegisteredInPlace(buf, tensor, self.agent)
        except NixlUnavailable as exc:  # e.g. a limit on locked memory: copy as before
            logger.warning("EPD nixl: cannot register an item where it lies (%s); copying "
                           "large items into the pool from now on", exc)
            self.in_place = False
            return None

    def _make_server(self, *args, **kwargs) -> PullServer:
        return NixlPullServer(*args, agent=self.agent, pool_location=self.location, **kwargs)

    def health(self) -> dict[str, object]:
        pins = len(self.server.pins) if isinstance(self.server, NixlPullServer) else 0
        return {**super().health(), "agent": self.agent.name, "read_pins": pins}

    def close(self) -> None:
        super().close()
        self.agent.close()
