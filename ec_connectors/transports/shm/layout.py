"""The shm transport's files on tmpfs, and the checks that make reading them safe.

What the shm transport keeps on its tmpfs directory, and the checks that make reading it
safe (torch-free).

```
<shm_path>/                       0700, owned by this user (else refused)
  <namespace key>/                0700: one per served model
    arena-<pid>-<token>.shm       0600: a producer's arena (flock held while it lives)
    <item key>.item               0600: a record: which arena, where, how big, its digest
    <item key>.failed             the producer could not store this item (consumers stop)
```
Every file is opened relative to the directory's descriptor with O_NOFOLLOW, so neither a
name from a record nor a symlink planted later can lead outside it; files not owned by this
user, or readable by anyone else, are refused. Records are written to a temporary name and
renamed into place: a reader sees a whole record or none (inotify sees the rename).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator

import msgspec

from ec_connectors.protocol.stored import FAILED_SUFFIX, TMP_PREFIX
from ec_connectors.protocol.stored import SHM_RECORD_SUFFIX as RECORD_SUFFIX

RECORD_MAGIC = b"EPDSHMR1"
MAX_RECORD_BYTES = 192 * 1024  # room for the longest item id (protocol.keys.MAX_ID_BYTES)
ARENA_RE = re.compile(r"arena-[0-9]{1,10}-[0-9a-f]{8}\.shm")
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


class ShmError(RuntimeError):
    """The shared-memory directory or arena cannot be used (clear reason for the operator)."""


class BadRecord(Exception):
    """A record (or the block it names) is not a complete item of this deployment."""


class Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one stored item lives and what it must hash to (the `.item` file)."""

    item_id: str
    key: str
    scope: str  # namespace#model fingerprint (config.scope)
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    arena: str  # file name in the same directory (ARENA_RE)
    offset: int  # of the block (header + payload) in the arena file
    gen: int  # the block's generation when written (a reused block has another)
    chunk: int  # digest chunk size (copy.Digest)
    algo: str  # "xxh3" | "blake3"
    digest: str  # hex, keyed under the deployment secret when there is one
    # the digest bound to this block (arena, offset, gen), keyed likewise: what a reader
    # checks when it trusts the producer's hash (shm_read_verify "seal")
    seal: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Record).decode


def _check_owned(st: os.stat_result, what: str) -> None:
    if st.st_uid != os.getuid():
        raise BadRecord(f"{what} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise BadRecord(f"{what} is accessible to other users (mode {st.st_mode & 0o777:o})")


def secure_dir(path: str) -> int:
    """Create and open a private directory owned by this user.

    Make `path` (and its parents as needed) a 0700 directory owned by this user and open
    it (O_NOFOLLOW); a directory that belongs to someone else is refused."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
    except OSError as exc:
        raise ShmError(f"cannot open the shared-memory directory {path}: {exc.strerror} "
                       "(a symlink is refused)") from None
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        os.close(fd)
        raise ShmError(f"the shared-memory directory {path} belongs to uid {st.st_uid}; set "
                       "shm_path to a directory of this user")
    if st.st_mode & 0o077:
        os.fchmod(fd, 0o700)  # ours, but made with a loose umask: nobody else may look in
    return fd


class ShmDir:
    """One namespace's directory: records, tombstones, arena names.

    Thread-safe (no state but the descriptor)."""

    def __init__(self, root: str, namespace_key: str) -> None:
        os.close(secure_dir(root))
        self.path = os.path.join(root, namespace_key)
        self.fd = secure_dir(self.path)

    # -- records -----------------------------------------------------------------------------
    def read_record(self, key: str) -> Record:
        """The record of `key`.

        FileNotFoundError when there is none; BadRecord when it is not ours or not well formed."""
        fd = _open(key + RECORD_SUFFIX, os.O_RDONLY, self.fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_RECORD_BYTES:
                raise BadRecord("record is not a small regular file")
            _check_owned(st, "record")
            raw = os.read(fd, MAX_RECORD_BYTES + 1)
        finally:
            os.close(fd)
        if not raw.startswith(RECORD_MAGIC):
            raise BadRecord("not a record of this transport")
        try:
            return _decode(raw[len(RECORD_MAGIC):])
        except msgspec.DecodeError as exc:
            raise BadRecord(f"unreadable record: {exc}") from None

    def write_record(self, record: Record) -> None:
        """Publish `record` atomically (temporary file, then rename)."""
        tmp = f"{TMP_PREFIX}{record.key}-{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600,
                     dir_fd=self.fd)
        try:
            try:
                os.write(fd, RECORD_MAGIC + _encode(record))
            finally:
                os.close(fd)
            os.replace(tmp, record.key + RECORD_SUFFIX, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            self.unlink(tmp)
            raise
        self.unlink(record.key + FAILED_SUFFIX)  # stored now: consumers take it

    def unlink(self, name: str) -> bool:
        try:
            os.unlink(name, dir_fd=self.fd)
            return True
        except FileNotFoundError:
            return False

    def unlink_record_if(self, key: str, arena: str, gen: int) -> bool:
        """Remove a key's record if it still names this block.

        Remove `key`'s record only when it still names this block (another producer may
        have stored the item since)."""
        with contextlib.suppress(FileNotFoundError, BadRecord):
            rec = self.read_record(key)
            if rec.arena == arena and rec.gen == gen:
                return self.unlink(key + RECORD_SUFFIX)
        return False

    def _exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def has_record(self, key: str) -> bool:
        return self._exists(key + RECORD_SUFFIX)

    def failed(self, key: str) -> bool:
        return self._exists(key + FAILED_SUFFIX)

    def mark_failed(self, key: str, reason: str) -> None:
        if self.has_record(key):
            return
        with contextlib.suppress(OSError):
            fd = os.open(key + FAILED_SUFFIX, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _OPEN_FLAGS,
                         0o600, dir_fd=self.fd)
            try:
                os.write(fd, reason.encode()[:200])
            finally:
                os.close(fd)

    def item_keys(self) -> list[str]:
        with os.scandir(self.fd) as it:
            return [k for e in it if (k := key_of(e.name)) is not None]

    def names(self) -> Iterator[tuple[str, float]]:
        """(name, mtime) of every entry (housekeeping)."""
        with os.scandir(self.fd) as it:
            for e in it:
                with contextlib.suppress(FileNotFoundError):
                    yield e.name, e.stat(follow_symlinks=False).st_mtime

    # -- arenas ------------------------------------------------------------------------------
    def open_arena(self, name: str, flags: int = os.O_RDONLY) -> int:
        """A descriptor of the arena `name` (a record's word: checked).

        FileNotFoundError when it is gone; BadRecord when the name or the file is not an arena
        of ours."""
        if not ARENA_RE.fullmatch(name):
            raise BadRecord(f"{name[:80]!r} is not an arena name")
        fd = _open(name, flags, self.fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadRecord("arena is not a regular file")
            _check_owned(st, "arena")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _open(name: str, flags: int, dir_fd: int) -> int:
    """Open a file of the shm directory, refusing what is not ours.

    Open a file of the directory; FileNotFoundError when absent, BadRecord when it cannot
    be opened as one of ours (a symlink, a directory, no permission)."""
    try:
        return os.open(name, flags | _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise BadRecord(f"cannot open {name[:80]!r}: {exc.strerror}") from None


def key_of(name: str) -> str | None:
    """The item key a directory entry holds a record of, or None."""
    if name.endswith(RECORD_SUFFIX) and not name.startswith("."):
        return name[: -len(RECORD_SUFFIX)]
    return None


def arena_name() -> str:
    return f"arena-{os.getpid()}-{secrets.token_hex(4)}.shm"


def tmpfs(path: str) -> bool:
    """Whether `path` lies on a memory filesystem (tmpfs, ramfs, hugetlbfs)."""
    try:
        mounts = open("/proc/mounts").read().splitlines()  # noqa: SIM115 - tiny
    except OSError:
        return False
    target, best, fstype = os.path.realpath(path), -1, ""
    for line in mounts:
        parts = line.split()
        if len(parts) >= 3:
            point = parts[1].replace("\\040", " ")
            if (target == point or target.startswith(point.rstrip("/") + "/")) \
                    and len(point) > best:
                best, fstype = len(point), parts[2]
    return fstype in ("tmpfs", "ramfs", "hugetlbfs")


def stale(mtime: float, age_s: float) -> bool:
    return time.time() - mtime > age_s
