"""Wire types of the Mooncake TE side channel and announcements.

Wire types of the Mooncake TE peer side channel and announcements (msgspec, never pickle):
consumer <-> producer pulls, and producer -> catalog item announcements."""

from __future__ import annotations

import msgspec

from ec_connectors.protocol.stored import ItemInfo
from ec_connectors.transports.nixl_pull.messages import NixlHello, NixlPeer

# --- Peer side channel (Mooncake TE transport): consumer worker <-> producer worker ---------
# Control only: the bytes of an item move through the transfer engine or a data connection of
# their own (stream.py), except items up to `inline_max_bytes`, which ride as one raw frame
# after the header (no pickle, ever).


class Pull(msgspec.Struct, tag=True):
    """A consumer's request for one item from a producer.

    consumer -> producer: write item `key` into my registered buffer `dst_addr` (of
    `capacity` bytes) through the transfer engine session `session` ("host:rpc_port").
    capacity 0 asks for the item's metadata first (or the item inline, if it is small).
    `timeout_s`: the consumer waits this long; the producer drops the pull once it has
    passed (answering `expired`, so the consumer's buffer is free again) and never writes
    after that. The same message asks for an item on a data connection (te_data_path
    socket, mooncake_te/stream.py), where `session` and `dst_addr` mean nothing: the reply
    and the bytes come back on that connection."""

    pull_id: int
    key: str
    session: str
    dst_addr: int
    capacity: int
    namespace: str = ""  # the model the item must belong to ("" = do not check)
    timeout_s: float = 0.0  # 0: no deadline (older consumers)


class StreamOpen(msgspec.Struct, tag=True):
    """A consumer's ticket for one data connection to a producer's stream port.

    consumer -> producer (te_data_path socket): `ticket` opens one data connection to the
    producer's stream port, presented there within a few seconds (mooncake_te/stream.py).
    The side channel is the only way a ticket travels, so with a deployment secret only
    holders of it (CURVE) get a connection served."""

    ticket: bytes


class Register(msgspec.Struct, tag=True):
    """A consumer's claim of the memory range pulls may be written into.

    consumer -> producer, on every (re)connection of the side channel: "write my pulls only
    into [base, base + length) of transfer engine session `session`". The proof that the
    session is the sender's own: `nonce` sits at `proof_addr` in that session's registered
    memory, which the producer reads through the engine before it accepts the range (the
    channel is encrypted, so nobody else knows the nonce). Pulls on a connection are written
    only into a range it registered this way."""

    session: str
    base: int
    length: int
    proof_addr: int
    nonce: bytes


class Pulled(msgspec.Struct, tag=True):
    """producer -> consumer: the item is in your buffer (or in the next frame, `inline`).

    On the NIXL data path (nixl_pull/) the item is not moved yet: it lies pinned at
    `src_addr` of the producer's registered pool, for the consumer to READ, and `token` is
    the notification that ends the read (the producer then drops its pin); `region`, when
    the item is held where it lies instead (registered on its own, outside the pool), is
    the NIXL metadata of that registration, which the consumer loads before reading."""

    pull_id: int
    info: ItemInfo
    inline: bool = False
    src_addr: int = 0
    token: bytes = b""
    region: bytes = b""


class PullFailed(msgspec.Struct, tag=True):
    """A producer's answer that a pull failed, with a code saying why.

    producer -> consumer. code: unknown (not here, and no save of it queued here) |
    pending (its save is queued here: ask again) | evicted | too_small (info says the size) |
    transfer | bad_request | namespace (the item belongs to another model) | expired (the
    pull's deadline passed before or while it was served: nothing more is written) |
    unregistered (the destination is not inside a range this connection registered and
    proved: nothing is written) | busy
    (the producer's queue of pulls is full) | failed (the producer could not store the item:
    stop waiting for it)."""

    pull_id: int
    code: str
    error: str = ""
    info: ItemInfo | None = None


class Progress(msgspec.Struct, tag=True):
    """A producer's note that the first bytes of a pull have landed.

    producer -> consumer: the first `done` bytes of pull `pull_id` have landed and will not
    change (the consumer verifies them while the rest is still in flight)."""

    pull_id: int
    done: int


class Announce(msgspec.Struct, tag=True):
    """producer -> subscribers: items stored at `endpoint`."""

    endpoint: str
    items: list[ItemInfo]
    namespace: str = ""


class Evicted(msgspec.Struct, tag=True):
    """producer -> subscribers: keys no longer held at `endpoint`."""

    endpoint: str
    keys: list[str]
    namespace: str = ""


class Snapshot(msgspec.Struct, tag=True):
    """A producer's periodic announcement of everything it holds.

    producer -> subscribers, periodically: everything held at `endpoint` (heals missed
    events; a producer whose snapshots stop is forgotten after a few intervals)."""

    endpoint: str
    keys: list[str]
    nbytes: list[int]
    interval_s: float
    namespace: str = ""


# one side channel, one decoder: the NIXL data path's handshake (nixl_pull/messages.py) rides it
PeerMessage = (Pull | Register | StreamOpen | Pulled | PullFailed | Progress | Announce | Evicted
               | Snapshot | NixlHello | NixlPeer)

_peer_decoder = msgspec.msgpack.Decoder(PeerMessage)


def decode_peer(data: bytes) -> PeerMessage:
    """Raises msgspec.DecodeError / ValidationError on garbage; callers drop such frames."""
    return _peer_decoder.decode(data)
