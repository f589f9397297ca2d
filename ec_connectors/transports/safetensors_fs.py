"""Shared-filesystem transport: one safetensors file per item.

Better than vLLM's ECExampleConnector pattern in every way that matters to an operator:
- atomic: written to a temp file in the same directory, then renamed;
- safe names: files are named by `item_key` (sanitized + hashed), never by the raw id;
- verified: size, dtype, shape, item id and an xxh3 checksum live in the safetensors
  metadata; a truncated or corrupted file is a miss, never a crash or wrong output;
- bounded: a byte budget with LRU eviction (readers bump mtime on every hit);
- cheap: one `write` from the tensor's memory (no serialization copy), mmap on read.
Files stay readable by any safetensors reader (`safetensors.safe_open`).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch

from ec_connectors.log import get_logger
from ec_connectors.protocol.item_ids import identity
from ec_connectors.protocol.keys import item_key, namespace_key
from ec_connectors.protocol.seal import Seal
from ec_connectors.protocol.stored import FAILED_SUFFIX, TMP_PREFIX, ItemInfo
from ec_connectors.protocol.stored import SAFETENSORS_SUFFIX as SUFFIX
from ec_connectors.transports.base import (
    Transport,
    checksum,
    dtype_from_name,
    dtype_name,
    host_copy,
    tensor_bytes,
)
from ec_connectors.transports.dir_watch import DirWatch

logger = get_logger(__name__)

TENSOR_NAME = "ec_cache"
FORMAT = "epd-1"
MAX_HEADER_BYTES = 1 << 20
_STALE_TMP_S = 600.0
_RESCAN_S = 5.0  # longest a put trusts the byte account before listing the directory again

# safetensors dtype codes <-> torch dtype names
_ST_DTYPES = {
    "bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64",
    "int8": "I8", "uint8": "U8", "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL",
}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


class CorruptItem(Exception):
    """The file exists but is not a complete, verified item."""


class _Header(NamedTuple):
    """What a cache file's header says of its tensor (`hlen`: the header's JSON bytes)."""

    hlen: int
    dtype: torch.dtype
    shape: list[int]
    nbytes: int
    digest: str
    mac: str


class _TooLarge(Exception):
    """The item holds more bytes than the reader asked for at most (get_small)."""


_NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "9p",
               "fuse", "gpfs", "beegfs", "afs")


def network_filesystem(path: Path) -> bool:
    """Whether a path lies on a network or FUSE filesystem.

    Whether `path` lies on a network or FUSE filesystem (from /proc/mounts; False when
    that cannot be read)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return False
    target, best, fstype = str(path.resolve()), -1, ""
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) > best:
            best, fstype = len(point), parts[2]
    return fstype.split(".")[0] in _NETWORK_FS


class SafetensorsTransport(Transport):
    name = "safetensors"
    reads_in_scheduler = True

    def __init__(
        self,
        root: str | os.PathLike,
        namespace: str,
        max_bytes: int,
        fsync: bool = False,
        verify_checksum: bool = True,
        seal: Seal | None = None,
        model: str = "",
    ) -> None:
        super().__init__()
        self.root = Path(root)
        self._ns = namespace_key(namespace)
        self.model = model  # the model fingerprint files record and loads require
        self._scope = f"{self._ns}#{model}" if model else self._ns
        self.dir = self.root / self._ns
        self._dir = str(self.dir)
        self.seal = seal or Seal(None)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self.verify_checksum = verify_checksum
        self._evict_lock = threading.Lock()
        # Bytes in the directory as of the last scan plus this process's writes since: a put
        # rescans (O(files)) only when that passes the budget or the last scan is
        # `_RESCAN_S` old, so files other instances write count within that period.
        self._approx_bytes = 0
        self._scanned_at = float("-inf")
        # On a network filesystem another pod's eviction can pull a mapped file away (SIGBUS):
        # items are read into private memory there; local files are mapped (zero copy).
        self.copy_reads = network_filesystem(self.dir)
        self.writes_fast = not self.copy_reads  # a network filesystem may stall a write

    # -- paths ---------------------------------------------------------------------------
    def path_for(self, item_id: str) -> Path:
        return self.dir / (item_key(item_id) + SUFFIX)

    # -- write ---------------------------------------------------------------------------
    def put(self, item_id: str, tensor: torch.Tensor) -> ItemInfo:
        key = item_key(item_id)
        tensor = host_copy(tensor)
        name = dtype_name(tensor.dtype)
        if name not in _ST_DTYPES:
            raise ValueError(f"dtype {name} cannot be stored in safetensors")
        data = tensor_bytes(tensor)
        digest = checksum(data)
        header = {
            TENSOR_NAME: {
                "dtype": _ST_DTYPES[name],
                "shape": list(tensor.shape),
                "data_offsets": [0, data.nbytes],
            },
            "__metadata__": {
                "format": FORMAT,
                "item_id": item_id,
                "nbytes": str(data.nbytes),
                "xxh3": digest,
                **({"model": self.model} if self.model else {}),
            },
        }
        if self.seal.active:
            header["__metadata__"]["mac"] = self.seal.mac(
                identity(self._scope, key, name, tensor.shape, data.nbytes), data)
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the tensor data 8-byte aligned
        # str paths: pathlib costs more than the write of a small item
        final = os.path.join(self._dir, key + SUFFIX)
        tmp = os.path.join(self._dir, f"{TMP_PREFIX}{key}-{uuid.uuid4().hex[:8]}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                f.write(struct.pack("<Q", len(raw)))
                f.write(raw)
                view = data
                while view.nbytes:  # raw write: loop on short writes
                    n = f.write(view)
                    view = view[n:]
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(FileNotFoundError):  # stored now: consumers take it
            os.unlink(os.path.join(self._dir, key + FAILED_SUFFIX))
        info = ItemInfo(
            item_id=item_id, key=key, shape=tuple(tensor.shape), dtype=name,
            nbytes=data.nbytes, checksum=digest, location=final,
        )
        self._approx_bytes += 8 + len(raw) + data.nbytes
        if (self._approx_bytes > self.max_bytes
                or time.monotonic() - self._scanned_at > _RESCAN_S):
            self.evict(keep=final)
        return info

    # -- read ----------------------------------------------------------------------------
    def get(self, item_id: str, deadline: float, location: str = "",
            nbytes: int = 0, *, wait: bool = True) -> torch.Tensor | None:
        path = self.path_for(item_id)
        delay = 0.001
        while True:
            try:
                return self._read(path, item_id)
            except FileNotFoundError:
                if not wait or time.monotonic() + delay > deadline or \
                        self._tombstone(item_key(item_id)).exists():
                    self.events.missing += 1  # not there (in time), or its save failed
                    return None
                time.sleep(delay)  # the producer may still be writing it
                delay = min(delay * 2, 0.02)
            except CorruptItem as exc:
                self.events.corrupt += 1
                logger.warning("EPD: ignoring corrupt cache file %s (%s); the item will be "
                               "encoded locally", path, exc)
                return None

    def get_small(self, item_id: str, max_bytes: int) -> torch.Tensor | None:
        try:
            return self._read(self.path_for(item_id), item_id, max_bytes=max_bytes)
        except (OSError, CorruptItem, _TooLarge):
            return None  # the workers' load waits for it, or counts and reports the miss

    def _read(self, path: Path, item_id: str, max_bytes: int | None = None) -> torch.Tensor:
        """Read and verify one item's file.

        The verified item; `max_bytes`: refuse a larger one (_TooLarge), and read it into
        private memory (a small read beats a mapping)."""
        with open(path, "rb") as f:
            h = self._header(f, item_id)
            nbytes = h.nbytes
            if max_bytes is not None and nbytes > max_bytes:
                raise _TooLarge
            if nbytes == 0:
                return torch.empty(h.shape, dtype=h.dtype)
            if self.copy_reads or max_bytes is not None:
                f.seek(8 + h.hlen)
                mm = bytearray(nbytes)
                if f.readinto(mm) != nbytes:
                    raise CorruptItem("file shrank while read")
                offset = 0
            else:  # private copy-on-write mapping: zero-copy, writable, immune to unlink
                mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
                offset = 8 + h.hlen
        view = memoryview(mm)[offset: offset + nbytes]
        problem = self._payload_problem(view, item_id, h)
        view.release()
        if problem:
            if isinstance(mm, mmap.mmap):
                mm.close()
            raise CorruptItem(problem)
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
        with contextlib.suppress(OSError):
            os.utime(path)  # LRU: a hit makes the file young again
        return flat.view(h.dtype).reshape(h.shape)

    def _header(self, f, item_id: str) -> _Header:
        """Read an item file's header and check it against the item and the file.

        The open file's header, checked against the item asked for and the file's size
        (CorruptItem says what does not fit)."""
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CorruptItem("truncated header")
        (hlen,) = struct.unpack("<Q", head)
        if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
            raise CorruptItem("bad header length")
        try:
            header = json.loads(f.read(hlen))
            meta = header["__metadata__"]
            spec = header[TENSOR_NAME]
            dtype = dtype_from_name(_TORCH_DTYPES[spec["dtype"]])
            shape = [int(s) for s in spec["shape"]]
            start, end = (int(x) for x in spec["data_offsets"])
            nbytes = int(meta["nbytes"])
            digest = meta["xxh3"]
            stored_id = meta["item_id"]
            mac = meta.get("mac", "")
            model = meta.get("model", "")
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptItem(f"unreadable header: {exc}") from None
        if stored_id != item_id:
            raise CorruptItem("file belongs to another item id")
        if self.model and model != self.model:  # same served name, other weights
            raise CorruptItem(f"made by another model (fingerprint {model or 'none'}, "
                              f"this one is {self.model})")
        numel = 1
        for s in shape:
            numel *= s
        if start != 0 or end != nbytes or numel * dtype.itemsize != nbytes:
            raise CorruptItem("header sizes disagree")
        if size != 8 + hlen + nbytes:
            raise CorruptItem(f"file is {size} bytes, header promises {8 + hlen + nbytes}")
        return _Header(hlen, dtype, shape, nbytes, digest, mac)

    def _payload_problem(self, view: memoryview, item_id: str, h: _Header) -> str:
        """Check an item's payload by its seal or checksum; "" when it is good.

        With the secret the seal is checked (it covers integrity: one pass over the
        bytes), else the xxh3 checksum when `verify_checksum`; "" when the bytes are good."""
        if self.seal.active:
            ok = self.seal.check(identity(self._scope, item_key(item_id), dtype_name(h.dtype),
                                          h.shape, h.nbytes), view, h.mac)
            return "" if ok else "not sealed with this deployment's secret (or damaged)"
        return "checksum mismatch" if self.verify_checksum and checksum(view) != h.digest else ""

    def _tombstone(self, key: str) -> Path:
        return self.dir / (key + FAILED_SUFFIX)

    def save_failed(self, item_id: str, reason: str) -> None:
        """Leave a tombstone for an item whose save failed.

        Leave a tombstone: consumers waiting for the file stop at once (a later successful
        save removes it; eviction clears old ones)."""
        key = item_key(item_id)
        if not (self.dir / (key + SUFFIX)).exists():
            with contextlib.suppress(OSError):
                self._tombstone(key).write_text(reason[:200])

    # -- index & housekeeping -------------------------------------------------------------
    def renew(self, item_id: str) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.path_for(item_id))  # young again for the LRU budget

    def exists(self, item_id: str) -> bool:
        return self.path_for(item_id).is_file()

    def watch_keys(self) -> DirWatch | None:
        """Watch the item directory with inotify, where that works.

        inotify on the directory: a file renamed into place (a finished put) is added, a
        deleted one removed. None off Linux, and on network filesystems (inotify does not
        see other hosts' writes there: the index scans)."""
        if self.copy_reads:
            return None
        try:
            return DirWatch(self._dir, _key_of, close_write=True)
        except (ImportError, OSError) as exc:
            logger.info("EPD: no inotify on %s (%s); the availability index scans it", self.dir,
                        exc)
            return None

    def list_keys(self) -> Iterable[str]:
        try:
            with os.scandir(self.dir) as it:
                return [k for e in it if (k := _key_of(e.name)) is not None]
        except FileNotFoundError:
            return []

    def delete(self, item_id: str) -> bool:
        try:
            self.path_for(item_id).unlink()
            return True
        except FileNotFoundError:
            return False

    def evict(self, keep: str | None = None) -> int:
        """Delete least recently used files until the directory fits the byte budget."""
        with self._evict_lock:
            files: list[tuple[float, int, str]] = []
            total = 0
            now = time.time()
            with os.scandir(self.dir) as it:
                for e in it:
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    if e.name.startswith(TMP_PREFIX) or e.name.endswith(FAILED_SUFFIX):
                        if now - st.st_mtime > _STALE_TMP_S:  # leftovers, old tombstones
                            Path(e.path).unlink(missing_ok=True)
                        continue
                    if e.name.endswith(SUFFIX):
                        total += st.st_size
                        files.append((st.st_mtime, st.st_size, e.path))
            removed = 0
            self._scanned_at = time.monotonic()
            self._approx_bytes = total
            if total <= self.max_bytes:
                return 0
            files.sort()
            for _, size, path in files:
                if total <= self.max_bytes:
                    break
                if keep is not None and path == str(keep):
                    continue
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                total -= size
                self._approx_bytes = total
                removed += 1
                self.events.evictions += 1
                self.events.evicted_bytes += size
            if removed:
                logger.info("EPD: evicted %d cache file(s) from %s to stay under %d bytes",
                            removed, self.dir, self.max_bytes)
            return removed

    def health(self) -> dict[str, object]:
        ok = os.access(self.dir, os.W_OK)
        return {"transport": self.name, "ok": ok, "dir": str(self.dir)}


def _key_of(name: str) -> str | None:
    """The item key a directory entry holds (as list_keys), or None (temp files, tombstones)."""
    return name[: -len(SUFFIX)] if name.endswith(SUFFIX) and not name.startswith(".") else None
