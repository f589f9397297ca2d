"""One process's NIXL agent: started, its memory registered, its peers and reads composed.

A thin, checked wrapper over `nixl._api.nixl_agent` (UCX back end), without NIXL's progress
thread. The agent is thread-safe (NIXL's read-write sync mode with lanes: transfers from
several threads at once, registration and peers exclusive; strict with one lane): a worker
both serves reads (notifications) and makes them (its loader threads). Registration lives
here; peers' metadata and region views in peers.py, reads, lanes and notifications in
reads.py, what the host allows in host.py. Nothing a peer sends is trusted: its metadata must
name the agent it claims to be, and every read is checked against the range the peer said it
registered before NIXL sees it (NIXL checks it again against the metadata).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NamedTuple

from ec_connectors.log import get_logger
from ec_connectors.transports.nixl_pull.host import mem_kind
from ec_connectors.transports.nixl_pull.peers import PeerViews
from ec_connectors.transports.nixl_pull.reads import Reads, ReadState

logger = get_logger(__name__)


class Region(NamedTuple):
    """Memory registered on its own (an item held where it lies), and what reads it."""

    reg: object
    metadata: bytes  # NIXL's partial metadata of it: no connection info, what a reader loads


class NixlUnavailable(RuntimeError):
    """NIXL cannot be imported or started in this process."""


class NixlAgent:
    """This process's agent (see the module docstring)."""

    def __init__(self, name: str, backends: tuple[str, ...] = ("UCX",), lanes: int = 1) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as exc:
            raise NixlUnavailable(
                "transport 'nixl' needs NIXL: pip install --no-deps nixl nixl-cu12 (what "
                f"scripts/setup_env.py does). Import failed: {exc}") from exc
        # read-write sync: the lanes post at once on workers of their own; one lane is
        # every caller on one worker, serialised as before lanes
        sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW if lanes > 1 else \
            nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        config = nixl_agent_config(enable_prog_thread=False, backends=[], sync_mode=sync)
        try:
            self._agent = nixl_agent(name, config)
            for backend in backends:  # UCX: a worker per lane
                self._agent.create_backend(
                    backend, {"num_workers": str(lanes)} if backend == "UCX" else {})
        except Exception as exc:  # noqa: BLE001 - the bindings raise their own types
            raise NixlUnavailable(f"cannot start NIXL agent {name} ({backends}): {exc}") from exc
        if not self._agent.backends:
            raise NixlUnavailable(f"NIXL has none of the back ends {backends} here")
        self.name = name
        self._regs: list[object] = []
        self.peers = PeerViews(self._agent, name)
        self.reads = Reads(self._agent, self.peers, lanes)

    # -- registration ----------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, location: str) -> None:
        """Register memory for this agent's whole life (the pool, the scratch page)."""
        self._regs.append(self._register(addr, nbytes, location)[1])

    def register_region(self, addr: int, nbytes: int, location: str) -> Region:
        """Register memory of its own (an item where it lies); `deregister` it when done."""
        descs, reg = self._register(addr, nbytes, location)
        try:
            return Region(reg, self._agent.get_partial_agent_metadata(
                descs, False, list(self._agent.backends)))
        except Exception as exc:  # noqa: BLE001
            self.deregister(Region(reg, b""))
            raise NixlUnavailable(f"NIXL partial metadata failed: {exc}") from exc

    def _register(self, addr: int, nbytes: int, location: str) -> tuple[object, object]:
        mem, device = mem_kind(location)
        descs = self._agent.get_reg_descs([(addr, nbytes, device, "")], mem)
        try:
            return descs, self._agent.register_memory(descs)
        except Exception as exc:  # noqa: BLE001 - the bindings raise their own types
            raise NixlUnavailable(f"NIXL register_memory of {nbytes} bytes of {mem} "
                                  f"failed: {exc}") from exc

    def deregister(self, region: Region) -> None:
        """End a region's registration (its item was released)."""
        try:
            self._agent.deregister_memory(region.reg)
        except Exception as exc:  # noqa: BLE001 - the memory is dropped anyway
            logger.warning("EPD nixl: deregister_memory failed: %s", exc)

    def metadata(self) -> bytes:
        """This agent's full metadata, what a peer loads to read from it."""
        return self._agent.get_agent_metadata()

    # -- peers and reads (peers.py, reads.py) --------------------------------------------------
    def add_peer(self, claimed: str, metadata: bytes) -> str:
        """Load a peer's metadata (PeerViews.add); returns its name or raises ValueError."""
        return self.peers.add(claimed, metadata)

    def forget(self, name: str) -> None:
        """Unload a peer (PeerViews.forget)."""
        self.peers.forget(name)

    @property
    def rebuilds(self) -> int:
        """How often a peer's view was rebuilt to take a region."""
        return self.peers.rebuilds

    def read(self, dest: tuple[int, int, str], remote: tuple[int, str, int], nbytes: int,
             peer: str, notif: bytes, deadline: float, chunk: int = 0,
             on_chunk: Callable[[int], None] | None = None,
             split: bool = True, region_md: bytes = b"") -> tuple[ReadState, object | None]:
        """READ from a peer into our memory by a deadline (Reads.read)."""
        return self.reads.read(dest, remote, nbytes, peer, notif, deadline, chunk, on_chunk,
                               split, region_md)

    def stripes(self, nbytes: int, split: bool = True) -> int:
        """How many stripes a read of `nbytes` goes out in (Reads.stripes)."""
        return self.reads.stripes(nbytes, split)

    def read_ended(self, live: object) -> bool:
        """Whether a read given up on has ended (Reads.read_ended)."""
        return self.reads.read_ended(live)

    def notifications(self) -> list[bytes]:
        """New notifications from any peer (Reads.notifications)."""
        return self.reads.notifications()

    def close(self) -> None:
        """Unload peers, end registrations, stop the lanes."""
        self.peers.close()
        for reg in self._regs:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(reg)
        self._regs.clear()
        self.reads.close()
