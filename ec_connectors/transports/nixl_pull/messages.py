"""The NIXL data path's handshake on the peer side channel (msgspec, never pickle).

A consumer's link opens with `NixlHello`; the producer answers with its agent (`NixlPeer`).
Both ride the side channel of the peer-pull core, whose decoder takes them beside its own
(peer_pull/messages.py `side_channel_decoder`, given `NixlPath.messages`).
"""

from __future__ import annotations

import msgspec


class NixlHello(msgspec.Struct, tag=True):
    """consumer -> producer, on every (re)connection of a NIXL side channel: send your agent.

    `regions`: this consumer loads an item's own registration (`Pulled.region`); to one
    that does not (an older release), an item held where it lies is served from its pool
    block, copied there on the first such pull."""

    agent: str
    regions: bool = False


class NixlPeer(msgspec.Struct, tag=True):
    """A NIXL producer's agent, sent over the authenticated side channel only.

    producer -> consumer, the answer to `NixlHello`: the agent's name and metadata (what
    `add_remote_agent` loads), its registered pool [`base`, `base` + `length`) of memory
    type `mem` on device `device`, `warm`, the notification of a first small read the
    consumer makes at once (UCX sets up the connection on the first transfer: off the
    request path), and `kernel`, which kernel and process namespace it runs in (equal to
    the consumer's: UCX reads with a kernel copy, so the consumer splits large reads)."""

    agent: str
    metadata: bytes
    base: int
    length: int
    mem: str
    device: int
    warm: bytes
    kernel: str = ""
