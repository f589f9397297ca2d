"""Stored items: what one is, which transports hold them and the file names they go by.

`ItemInfo` is one stored embedding's description, on every wire that names items.

`TransportName` is what `ec_connector_extra_config.transport` accepts (one name, or a list
of them as tiers). `UpTransport` is what `epd up --transport` accepts: one transport, the
`tiered` preset (its tiers are `TIERED`, in load order: the producer's pool, then the store,
then the shared directory), or `auto` (`shm` when every server runs on this host, which is
always so for `epd up`).

File names are shared by the transports that write items and the processes that only look
(the gateway's availability check stats them without loading torch). Every name starts with
an item's key (`keys.item_key`) inside its namespace's directory (`keys.namespace_key`):
- safetensors: `<storage_path>/<namespace>/<key>.safetensors`;
- shm: `<shm_path>/<namespace>/<key>.item`, the record naming the arena block of the item;
- both: `<key>.failed`, a tombstone (the producer could not store the item), and `.tmp-*`
  files being written (renamed into place when complete).
"""

from __future__ import annotations

from typing import Literal, get_args

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


TransportName = Literal["safetensors", "mooncake", "mooncake_store", "shm", "nixl"]
TRANSPORT_NAMES: tuple[TransportName, ...] = get_args(TransportName)
UpTransport = Literal[TransportName, "tiered", "auto"]
TIERED: tuple[TransportName, ...] = ("mooncake", "mooncake_store", "safetensors")

SAFETENSORS_SUFFIX = ".safetensors"  # one stored item
SHM_RECORD_SUFFIX = ".item"  # one stored item's shm record
FAILED_SUFFIX = ".failed"
TMP_PREFIX = ".tmp-"
