"""What the scheduler and its workers tell each other: control messages and step metadata.

The control messages (msgspec, never pickle) ride the control channel; `EPDConnectorMetadata`
rides inside vLLM's SchedulerOutput each step. The Mooncake TE peer side channel has its own
wire (transports/mooncake_te/messages.py); both are encoded by `channel.encode` (re-exported
here); each wire has its own `decode`."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata

from ec_connectors.channel import encode as encode  # the shared encoder, re-exported
from ec_connectors.protocol.stored import ItemInfo

Stats = dict[str, dict[str, float | list[float] | dict[str, float]]]  # EPDStats.data


class Hello(msgspec.Struct, tag=True):
    """worker -> scheduler: a worker joined (sent again on reconnect)."""

    rank: int
    pid: int
    endpoint: str = ""  # this worker's transport endpoint, if it serves items (producers)


class Prefetch(msgspec.Struct, tag=True):
    """scheduler -> workers: stage this item in memory, then report `Staged`.

    `location`/`nbytes`: where the item lives and its size, when known (request params or a
    producer's announcement); transports that pull from a peer use them."""

    item_id: str
    timeout_s: float
    location: str = ""
    nbytes: int = 0


class Renew(msgspec.Struct, tag=True):
    """Ask the producer's workers to keep an item a consumer is promised again.

    scheduler -> workers (producer): vLLM skipped encoding this item because it is stored;
    a consumer is being promised it again, so keep it (renew its lease / LRU recency)."""

    item_id: str


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
    stats: Stats | None = None  # the worker's stats since its last report (as WorkerStats)
    # this load's times on the worker (seconds; sched/load_spans.py): the Prefetch queued
    # for a loader thread, the transport's read (checksum verified), into the staging area
    wait_s: float = 0.0
    get_s: float = 0.0
    stage_s: float = 0.0


class Saved(msgspec.Struct, tag=True):
    """worker -> scheduler: an item is durably in the transport (or failed to get there)."""

    item_id: str
    rank: int
    ok: bool
    info: ItemInfo | None = None
    error: str = ""
    stats: Stats | None = None  # the worker's stats since its last report (as WorkerStats)


class WorkerStats(msgspec.Struct, tag=True):
    """A worker's counters and latencies since its last report.

    worker -> scheduler: counters and latencies since the last report (EPDStats.data),
    when no Staged or Saved carries them."""

    rank: int
    data: Stats


ControlMessage = Hello | Prefetch | Renew | Drop | Staged | Saved | WorkerStats

_decoder = msgspec.msgpack.Decoder(ControlMessage)


def decode(data: bytes) -> ControlMessage:
    """Raises msgspec.DecodeError / ValidationError on garbage; callers drop such frames."""
    return _decoder.decode(data)


# An item read by the scheduler itself: its verified bytes, dtype name and shape.
InlineItem = tuple[bytes, str, tuple[int, ...]]


@dataclass
class EPDConnectorMetadata(ECConnectorMetadata):
    """The scheduler's per-step metadata for workers: the items to place.

    scheduler -> worker, every step: the items to put into the encoder cache this step
    (item id -> number of embeddings); those the scheduler read itself travel here too
    (`inline`, a subset of `place`); the others wait in the workers' staging. Plain and
    picklable."""

    place: dict[str, int] = field(default_factory=dict)
    inline: dict[str, InlineItem] = field(default_factory=dict)
