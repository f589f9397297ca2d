"""What the peer-pull core is given: a data path, and the counters every health answer shows.

`DataPath` is how an item's bytes cross from a producer's pool to a consumer's: the core
(transport.py, server.py, link.py, puller.py) runs the side channel, the pool, pins and
leases, deadlines, retries and verification, and asks the data path only what differs. Its
implementations live in their own packages (mooncake_te/: the engine's writes and the socket
stream; nixl_pull/: NIXL reads) and import the core, never the reverse."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from concurrent.futures import Executor

    import msgspec
    import torch

    from ec_connectors.config import EPDConfig
    from ec_connectors.transports.memory import MemoryPool, PoolBuffer
    from ec_connectors.transports.peer_pull.link import PeerLink, PendingPull
    from ec_connectors.transports.peer_pull.messages import Pull, PullFailed
    from ec_connectors.transports.peer_pull.producer_store import (
        HeldInPlace,
        PinnedItem,
        ProducerStore,
    )

# how a data path opens its side channel to one producer: (its opening message or None, the
# handler of the messages that answer no pull) -> the core's link
OpenLink = Callable[["msgspec.Struct | None", "Callable[[Any], None] | None"], "PeerLink"]


@dataclass
class PullCounters:
    """One worker's pull counters (its consumer's pulls, its producer's refusals), for health."""

    pulls: int = 0
    inline: int = 0
    unknown: int = 0
    evicted: int = 0
    transfer_errors: int = 0
    expired: int = 0
    unregistered: int = 0
    streamed: int = 0
    stream_errors: int = 0
    stream_connections: int = 0

    def counters(self) -> dict[str, int]:
        """The counters by name, as `health()` reports them."""
        return asdict(self)

    def failed(self, code: str) -> None:
        """Count a producer's refusal of a consumer's pull by its code."""
        if code in ("unknown", "pending"):
            self.unknown += 1
        elif code == "evicted":
            self.evicted += 1
        else:
            self.transfer_errors += 1


class Server(Protocol):
    """What a data path's producer side uses of the core's side channel (server.py)."""

    config: EPDConfig
    endpoint: str
    store: ProducerStore
    counters: PullCounters
    handshakes: Executor  # a connection's opening work, apart from the pulls waiting for it

    def reply(self, peer: bytes, msg: msgspec.Struct, payload: bytes | None = None) -> None:
        """Answer `peer` on the side channel."""

    def expired(self, msg: Pull, peer: bytes, expires: float) -> bool:
        """Past the pull's deadline: answer `expired` and say True."""

    def claim(self, msg: Pull, expires: float) -> tuple[PinnedItem | None, PullFailed | None]:
        """Pin the item a pull asks for, or the refusal to answer it with."""


class PeerReader(Protocol):
    """A consumer's way to one producer: the side channel and the data path's moves."""

    broken: bool

    def pull(self, key: str, session: str, buf: PoolBuffer | None, timeout_s: float,
             on_progress: Callable[[int], None] | None = None, namespace: str = ""
             ) -> PendingPull:
        """Move item `key` into `buf` (None: inline or its size) by `timeout_s`; finished."""

    def reap(self, ttl_s: float) -> None:
        """Free buffers held past `ttl_s` for a producer that never answered."""

    @property
    def quarantined(self) -> int:
        """Buffers held because a producer or a read may still write into them."""

    def close(self) -> None:
        """Close the side channel; buffers nothing writes into any more are freed."""


class DataPath(Protocol):
    """How items move between one worker and its peers, in both roles (see the module)."""

    session: str  # what a pull names as its destination's session ("" where nothing)
    messages: tuple[type, ...]  # the side-channel messages it adds to the core's

    # -- memory --------------------------------------------------------------------------
    def register(self, addr: int, size: int, location: str = "") -> None:
        """Register memory items move from or into (the pool, once)."""

    def attach(self, pool: MemoryPool) -> None:
        """Take the worker's registered pool (its range, for handshakes), once."""

    # -- producer side -------------------------------------------------------------------
    def holds_in_place(self) -> bool:
        """Whether a large host item may be held where it lies, not copied into the pool."""

    def hold_in_place(self, buf: PoolBuffer, tensor: torch.Tensor) -> HeldInPlace | None:
        """Hold an item where it lies (`buf` only counts its bytes); None: copy it."""

    def listen(self, host: str, port: int) -> str:
        """Open what serves beside the side channel at `port`; words for the log line."""

    def start_serving(self, server: Server) -> None:
        """Serve with `server` (before its side channel opens)."""

    def on_message(self, server: Server, msg: Any, peer: bytes) -> bool:
        """Handle one of the data path's own side-channel messages; False: not one."""

    def serve_held(self, server: Server, msg: Pull, peer: bytes, held: PinnedItem,
                   expires: float) -> bool:
        """Move or offer a pinned large item to `peer` and answer; True: the pin is kept."""

    def stop_serving(self) -> None:
        """Close what `listen` opened (the side channel is closed already)."""

    # -- consumer side -------------------------------------------------------------------
    def reader(self, endpoint: str, open_link: OpenLink) -> PeerReader:
        """This consumer's way to the producer at `endpoint`."""

    # -- the rest -----------------------------------------------------------------------
    def health(self) -> dict[str, object]:
        """The data path's own health keys, beside the core's."""

    def close(self) -> None:
        """Release what the data path holds (after the pool is closed)."""
