"""Which items are already encoded somewhere, so the gateway can skip encoding them.

Interface: `available(item_ids) -> set of ids that a decode instance can load now`. It must
be cheap (called per request on the event loop). Implementations:
- `SafetensorsAvailability`: the shared directory of the safetensors transport (one stat
  per item, paths built only through `ec_connectors.keys.item_key`);
- `NoAvailability`: nothing is ever known (every item is encoded).
The Mooncake transports plug in here with their own lookups.
A false positive (item evicted after the check) costs a decode-side wait of at most the
connector's `load_timeout_s`, then a local encode: slower, never wrong.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from ec_connectors.keys import item_key, namespace_key
from encoder_service.gateway.config import GatewayConfig

SUFFIX = ".safetensors"  # ec_connectors.transports.safetensors_fs.SUFFIX (that module needs torch)


class Availability(Protocol):
    name: str

    def available(self, item_ids: Iterable[str]) -> set[str]: ...


class NoAvailability:
    name = "none"

    def available(self, item_ids: Iterable[str]) -> set[str]:
        return set()


class SafetensorsAvailability:
    name = "safetensors"

    def __init__(self, storage_path: str | os.PathLike, namespace: str) -> None:
        self.dir = Path(storage_path) / namespace_key(namespace)

    def path_for(self, item_id: str) -> str:
        return os.path.join(self.dir, item_key(item_id) + SUFFIX)

    def available(self, item_ids: Iterable[str]) -> set[str]:
        return {i for i in item_ids if os.path.exists(self.path_for(i))}


def make_availability(cfg: GatewayConfig) -> Availability:
    a = cfg.availability
    if a.kind == "safetensors":
        if not a.storage_path:
            from encoder_service.gateway.config import GatewayConfigError

            raise GatewayConfigError("availability.storage_path is required for "
                                     "availability.kind = 'safetensors'")
        return SafetensorsAvailability(a.storage_path, cfg.namespace)
    return NoAvailability()
