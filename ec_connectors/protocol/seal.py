"""`Seal`: stored objects authenticated with the deployment secret.

Mooncake Store objects and safetensors files carry a seal: HMAC-SHA256, keyed from the
deployment secret (secret_file.py), over the object's identity (item_ids.py `identity`) and
its payload.
"""

from __future__ import annotations

import hashlib
import hmac

from ec_connectors.protocol.secret_file import derive_key


class Seal:
    """Seal and check stored objects with the deployment secret.

    Authenticates stored objects (Mooncake Store objects, safetensors files) with the
    deployment secret: HMAC-SHA256 over the object's identity (namespace, item, dtype, shape,
    size) and its payload. Without a secret it is inactive (objects are still checked against
    their xxh3). With one, a reader accepts only objects sealed with the same secret: a
    well-formed object planted by anyone else, or the bytes of one item under another's name,
    is a miss, never a wrong embedding."""

    def __init__(self, secret: bytes | None) -> None:
        self._key = None if secret is None else derive_key(secret, "seal")

    @property
    def active(self) -> bool:
        return self._key is not None

    def mac(self, identity: str, payload: bytes | memoryview) -> str:
        """The seal of an object ("" when inactive)."""
        if self._key is None:
            return ""
        h = hmac.new(self._key, identity.encode() + b"\0", hashlib.sha256)
        h.update(payload)
        return h.hexdigest()

    def check(self, identity: str, payload: bytes | memoryview, mac: str) -> bool:
        """Whether a stored object may be used.

        Whether a stored object may be used: always when inactive; else only with a valid
        seal."""
        if self._key is None:
            return True
        return bool(mac) and hmac.compare_digest(self.mac(identity, payload), mac)
