"""Wire types of the peer-pull side channel and announcements (msgspec, never pickle).

The messages every data path shares: consumer <-> producer pulls and their answers, and
producer -> catalog announcements. A data path adds the messages of its own (a connection's
opening message, its tickets) to the side channel's decoder (`side_channel_decoder`).
Torch-free: the gateway's catalog decodes announcements with it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import msgspec

from ec_connectors.protocol.stored import ItemInfo

# --- Peer side channel: consumer worker <-> producer worker ---------------------------------
# Control only: the bytes of an item move on the data path, except items up to
# `inline_max_bytes`, which ride as one raw frame after the header (no pickle, ever).


class Pull(msgspec.Struct, tag=True):
    """A consumer's request for one item from a producer.

    consumer -> producer: item `key`, into my buffer `dst_addr` (of `capacity` bytes) of the
    data path's session `session` ("host:rpc_port" on the engine path, else ""). capacity 0
    asks for the item's metadata first (or the item inline, if it is small). `timeout_s`:
    the consumer waits this long; the producer drops the pull once it has passed (answering
    `expired`, so the consumer's buffer is free again) and never moves bytes after that. The
    same message asks for an item on a data connection (te_data_path socket,
    mooncake_te/stream.py), where `session` and `dst_addr` mean nothing: the reply and the
    bytes come back on that connection."""

    pull_id: int
    key: str
    session: str
    dst_addr: int
    capacity: int
    namespace: str = ""  # the model the item must belong to ("" = do not check)
    timeout_s: float = 0.0  # 0: no deadline (older consumers)


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
    unregistered (the data path cannot move it to this consumer: nothing is written) | busy
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


CORE_MESSAGES: tuple[type, ...] = (Pull, Pulled, PullFailed, Progress, Announce, Evicted,
                                   Snapshot)
PeerMessage = Pull | Pulled | PullFailed | Progress | Announce | Evicted | Snapshot


def side_channel_decoder(extra: tuple[type, ...] = ()) -> Callable[[bytes], Any]:
    """The side channel's decoder: the core's messages and a data path's `extra` ones.

    It raises msgspec.DecodeError / ValidationError on garbage; callers drop such frames."""
    return msgspec.msgpack.Decoder(Union[CORE_MESSAGES + extra]).decode  # noqa: UP007


decode_announcement = side_channel_decoder()
