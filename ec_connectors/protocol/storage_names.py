"""The names stored items go by on disk, shared by the transports that write them and the
processes that only look (the gateway's availability check stats them without loading torch).
Every name starts with an item's key (`keys.item_key`) inside its namespace's directory
(`keys.namespace_key`).

- safetensors (`transports/safetensors_fs.py`): `<storage_path>/<namespace>/<key>.safetensors`;
- shm (`transports/shm/layout.py`): `<shm_path>/<namespace>/<key>.item`, the record naming the
  arena block that holds the item;
- both: `<key>.failed`, a tombstone (the producer could not store the item), and `.tmp-*`
  files being written (renamed into place when complete).
"""

from __future__ import annotations

SAFETENSORS_SUFFIX = ".safetensors"  # one stored item
SHM_RECORD_SUFFIX = ".item"  # one stored item's shm record
FAILED_SUFFIX = ".failed"
TMP_PREFIX = ".tmp-"

__all__ = ["FAILED_SUFFIX", "SAFETENSORS_SUFFIX", "SHM_RECORD_SUFFIX", "TMP_PREFIX"]
