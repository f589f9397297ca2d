"""The transport interface. Transports own only transport mechanics: where bytes go and how
they come back. Readiness, deadlines, retries and lifecycle live above them (worker.py,
scheduler_hooks/)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import xxhash

from ec_connectors.messages import ItemInfo


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def checksum(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass
class TransportEvents:
    """Counters a transport bumps; the worker folds them into connector stats."""

    evictions: int = 0
    evicted_bytes: int = 0
    corrupt: int = 0
    missing: int = 0
    errors: list[str] = field(default_factory=list)


class Transport(ABC):
    """Moves whole embeddings keyed by item id. Blocking calls: run them off the hot path."""

    name: str = "base"

    def __init__(self) -> None:
        self.events = TransportEvents()

    @abstractmethod
    def put(self, item_id: str, tensor: torch.Tensor) -> ItemInfo:
        """Store `tensor` (CPU, contiguous) under `item_id`; readers never see a partial item."""

    @abstractmethod
    def get(self, item_id: str, deadline: float) -> torch.Tensor | None:
        """The verified item, waiting for it until `deadline` (time.monotonic()); None = miss."""

    @abstractmethod
    def exists(self, item_id: str) -> bool:
        """Whether the item is stored now (may touch the medium: not for hot paths)."""

    @abstractmethod
    def list_keys(self) -> Iterable[str]:
        """Keys of the stored items (`ec_connectors.keys.item_key`), for the availability index."""

    @abstractmethod
    def delete(self, item_id: str) -> bool:
        """Remove an item; True when something was removed."""

    def health(self) -> dict[str, object]:
        return {"transport": self.name, "ok": True}

    def close(self) -> None:
        return None
