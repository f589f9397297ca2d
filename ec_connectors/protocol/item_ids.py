"""What names an item: the ids a deployment vouches for, and a stored item's identity.

`IdSigner` signs the ids the gateway derives from media, keyed from the deployment secret
(secret_file.py); `identity` is what a stored object is bound to (a seal, seal.py, or a
hashed copy's digest), so bytes cannot be moved to another item or model.
"""

from __future__ import annotations

import hashlib
import hmac

from ec_connectors.protocol.secret_file import derive_key

_ID_SEP = "~"


def identity(namespace: str, key: str, dtype: str, shape, nbytes: int) -> str:
    """What a seal binds an object to (so bytes cannot be moved to another item or model)."""
    return f"{namespace}|{key}|{dtype}|{','.join(map(str, shape))}|{nbytes}"


class IdSigner:
    """Sign and check item ids, so only vouched-for ids are shared.

    Item ids the deployment vouches for: the gateway derives an id from the media and
    signs it (`<content id>~<tag>`, HMAC-SHA256 with the secret); a producer holding the
    secret shares (saves, publishes) only items whose id carries a valid tag. Any other id a
    client chose (a `uuid` sent straight to a vLLM producer, or to the pool) is encoded for
    that request only, so nobody can store image A's embedding under image B's id. Without
    a secret every id is accepted (one host, loopback: the gateway is the only client)."""

    def __init__(self, secret: bytes | None) -> None:
        self._key = None if secret is None else derive_key(secret, "ids")

    @property
    def active(self) -> bool:
        return self._key is not None

    def _tag(self, content_id: str) -> str:
        assert self._key is not None
        return hmac.new(self._key, content_id.encode(), hashlib.sha256).hexdigest()[:32]

    def sign(self, content_id: str) -> str:
        return content_id if self._key is None else f"{content_id}{_ID_SEP}{self._tag(content_id)}"

    def vouched(self, item_id: str) -> bool:
        """Whether `item_id` may be shared with other instances."""
        if self._key is None:
            return True
        content_id, sep, tag = item_id.rpartition(_ID_SEP)
        return bool(sep) and hmac.compare_digest(self._tag(content_id), tag)
