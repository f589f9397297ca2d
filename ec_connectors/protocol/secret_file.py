"""The deployment secret: the file it is read from, and the keys derived from it.

What every EPD process of one deployment shares, and what keeps anyone else off the data
plane. It is read from a file (`secret_file` in a config, else the file named by
`$EPD_SECRET_FILE`), never from a command line. Every other key of the deployment is derived
from it (`derive_key`, blake2b keyed by the secret, one purpose each): the CURVE key pairs
(curve.py), the seal of stored objects (item_ids.py's identity, seal.py), signed item ids
(item_ids.py), the admin token and the API key (api_keys.py).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

SECRET_ENV = "EPD_SECRET_FILE"
MIN_SECRET_BYTES = 16


class SecretError(ValueError):
    """The secret file is missing, unreadable, too short or readable by others."""


def read_secret(path: str | os.PathLike | None = None) -> bytes | None:
    """Read the deployment secret from a file, if one is configured.

    The deployment secret from `path`, else from `$EPD_SECRET_FILE`; None when neither is
    set. Raises SecretError with a clear message on a bad file."""
    path = path or os.environ.get(SECRET_ENV) or None
    if path is None:
        return None
    p = Path(path)
    try:
        data = p.read_bytes().strip()
        mode = p.stat().st_mode
    except OSError as exc:
        raise SecretError(f"cannot read the deployment secret {p}: {exc.strerror}") from None
    if len(data) < MIN_SECRET_BYTES:
        raise SecretError(f"the deployment secret {p} holds {len(data)} bytes; use at least "
                          f"{MIN_SECRET_BYTES} random bytes (e.g. `head -c 32 /dev/urandom "
                          f"| base64 > {p}`)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"the deployment secret {p} is readable by other users; "
                          f"chmod 600 {p}")
    return data


def derive_key(secret: bytes, purpose: str, data: bytes | None = None) -> bytes:
    """A 32-byte key for one purpose (curve, seal, ids, admin, api), derived from the secret."""
    return hashlib.blake2b(purpose.encode() if data is None else data, key=secret[:64],
                           digest_size=32, person=f"epd-{purpose}-v1".encode()).digest()
