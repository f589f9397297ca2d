"""Which items are already encoded somewhere, so the gateway can skip encoding them.

Interface: `available(item_ids) -> set of ids that a decode instance can load now`, and
`hint(item_id) -> ItemEntry` (the item's entry in the forwarded `ec_transfer_params`, e.g.
where it lives). Both must be cheap (called per request on the event loop); `close()` at shutdown.
Implementations:
- `SafetensorsAvailability`: the shared directory of the safetensors transport (one stat
  per item, paths built only through `ec_connectors.protocol.keys.item_key` and the file
  names of `ec_connectors.protocol.stored`, which the transports write by);
- `ShmAvailability`: the records of the shm transport (the gateway on the servers' host:
  one stat per item; a record goes when its item is evicted);
- `MooncakeAvailability`: a `MooncakeCatalog` subscribed to the Mooncake TE producers'
  announcements (a dict lookup per item; the hint names the producer holding it);
- `NoAvailability`: nothing is ever known (every item is encoded).
A false positive (item evicted after the check) costs a decode-side wait of at most the
connector's `load_timeout_s`, then a local encode: slower, never wrong.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from ec_connectors.protocol.keys import item_key, namespace_key, safe_key
from ec_connectors.protocol.params import ItemEntry
from ec_connectors.protocol.stored import SAFETENSORS_SUFFIX, SHM_RECORD_SUFFIX
from encoder_service.gateway.config import AvailabilityConfig

_ASK = ItemEntry()  # no hint: the decode instance's transport finds the item


class Availability(Protocol):
    name: str

    def available(self, item_ids: Iterable[str]) -> set[str]: ...

    def hint(self, item_id: str) -> ItemEntry: ...

    def close(self) -> None: ...


class NoAvailability:
    name = "none"

    def available(self, item_ids: Iterable[str]) -> set[str]:
        return set()

    def hint(self, item_id: str) -> ItemEntry:
        return _ASK

    def close(self) -> None:
        pass


class SafetensorsAvailability(NoAvailability):
    name = "safetensors"
    suffix = SAFETENSORS_SUFFIX

    def __init__(self, storage_path: str | os.PathLike, namespace: str) -> None:
        self.root, self.namespace = Path(storage_path), namespace

    @functools.cached_property
    def dir(self) -> Path:
        """The namespace's directory (as the servers' transports name it)."""
        return self.root / namespace_key(self.namespace)

    def path_for(self, item_id: str) -> str:
        return os.path.join(self.dir, item_key(item_id) + self.suffix)

    def available(self, item_ids: Iterable[str]) -> set[str]:
        return {i for i in item_ids if safe_key(i) is not None
                and os.path.exists(self.path_for(i))}


class ShmAvailability(SafetensorsAvailability):
    """Items available in shm: those whose shm record is in place.

    Items whose shm record is in place (`<shm_path>/<namespace>/<key>.item`, the layout
    of ec_connectors.transports.shm.layout): stored and not evicted. The gateway must run on
    the servers' host, as the same user (the directory is 0700)."""

    name = "shm"
    suffix = SHM_RECORD_SUFFIX


class MooncakeAvailability(NoAvailability):
    """Items the Mooncake TE producers announced (and have not evicted).

    The catalog lives on its own thread (ZMQ SUB); a lookup is one dict read. The gateway's item
    ids are already namespaced by model (content hash); producers also refuse pulls from another
    model."""

    name = "mooncake"

    def __init__(self, producers: list[str], announce_interval_s: float | None = None,
                 secret_file: str | None = None) -> None:
        from ec_connectors.config import EPDConfig
        from ec_connectors.transports.base import Placement
        from ec_connectors.transports.mooncake_te.catalog import MooncakeCatalog

        extra: dict[str, Any] = {"transport": "mooncake", "producers": list(producers),
                                 "secret_file": secret_file}  # CURVE, as the producers
        if announce_interval_s is not None:
            extra["announce_interval_s"] = announce_interval_s
        self.catalog = MooncakeCatalog(EPDConfig.from_dict(extra),
                                       Placement(role="scheduler", is_producer=False))

    def _find(self, item_id: str) -> tuple[str, int] | None:
        key = safe_key(item_id)
        return None if key is None else self.catalog.locate(key)

    def available(self, item_ids: Iterable[str]) -> set[str]:
        return {i for i in item_ids if self._find(i) is not None}

    def hint(self, item_id: str) -> ItemEntry:
        found = self._find(item_id)
        return _ASK if found is None else ItemEntry(location=found[0], nbytes=found[1])

    def close(self) -> None:
        self.catalog.close()


def make_availability(a: AvailabilityConfig, namespace: str,
                      secret_file: str | None) -> Availability:
    """Make the availability view the config names.

    The view `a` configures (its required keys per kind are checked by
    AvailabilityConfig); `namespace` as the servers', `secret_file` reads announcements."""
    if a.kind == "mooncake":
        return MooncakeAvailability(a.producers, secret_file=secret_file)
    if a.kind == "safetensors":
        assert a.storage_path
        return SafetensorsAvailability(a.storage_path, namespace)
    if a.kind == "shm":
        assert a.shm_path
        return ShmAvailability(a.shm_path, namespace)
    return NoAvailability()
