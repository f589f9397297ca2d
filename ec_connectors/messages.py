"""Wire types: item descriptions and scheduler<->worker control messages (msgspec, never pickle)."""

from __future__ import annotations

import msgspec


class ItemInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a stored embedding is and where it lives."""

    item_id: str
    key: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    nbytes: int
    checksum: str  # xxh3-64 hex of the raw tensor bytes
    location: str = ""  # transport-specific (file path, endpoint)


class Hello(msgspec.Struct, tag=True):
    """worker -> scheduler: a worker joined (sent again on reconnect)."""

    rank: int
    pid: int


class Prefetch(msgspec.Struct, tag=True):
    """scheduler -> workers: stage this item in memory, then report `Staged`."""

    item_id: str
    timeout_s: float


class Drop(msgspec.Struct, tag=True):
    """scheduler -> workers: forget a staged item (request gone, or another rank failed)."""

    item_id: str


class Staged(msgspec.Struct, tag=True):
    """worker -> scheduler: outcome of a Prefetch."""

    item_id: str
    rank: int
    ok: bool
    nbytes: int = 0
    num_embeds: int = 0  # leading dimension: the token count the item covers
    error: str = ""


class Saved(msgspec.Struct, tag=True):
    """worker -> scheduler: an item is durably in the transport (or failed to get there)."""

    item_id: str
    rank: int
    ok: bool
    info: ItemInfo | None = None
    error: str = ""


class WorkerStats(msgspec.Struct, tag=True):
    """worker -> scheduler: counters and latencies since the last report (EPDStats.data)."""

    rank: int
    data: dict[str, dict[str, float | list[float]]]


ControlMessage = Hello | Prefetch | Drop | Staged | Saved | WorkerStats

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ControlMessage)


def encode(msg: ControlMessage) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> ControlMessage:
    """Raises msgspec.DecodeError / ValidationError on garbage; callers drop such frames."""
    return _decoder.decode(data)
