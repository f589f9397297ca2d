"""What the scheduler side hands its workers every step (inside vLLM's SchedulerOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata

# An item read by the scheduler itself: its verified bytes, dtype name and shape.
InlineItem = tuple[bytes, str, tuple[int, ...]]


@dataclass
class EPDConnectorMetadata(ECConnectorMetadata):
    """scheduler -> worker, every step: the items to put into the encoder cache this step
    (item id -> number of embeddings); those the scheduler read itself travel here too
    (`inline`, a subset of `place`); the others wait in the workers' staging. Plain and
    picklable."""

    place: dict[str, int] = field(default_factory=dict)
    inline: dict[str, InlineItem] = field(default_factory=dict)
