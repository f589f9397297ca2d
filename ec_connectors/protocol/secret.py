"""The deployment secret, which keeps anyone else off the data plane.

The deployment secret: what every EPD process of one deployment shares, and what keeps
anyone else off the data plane.

It is read from a file (`secret_file` in a config, else the file named by `$EPD_SECRET_FILE`),
never from a command line. From it every process derives the same ZMQ CURVE key pairs
(blake2b, keyed by the secret): the Mooncake TE side channels (ROUTER/DEALER) and the
announcements (PUB/SUB) run CURVE, so a peer that does not hold the secret cannot complete a
handshake (it would need the server's public key, which only the secret yields): it can
neither pull an item, nor name a buffer to write into, nor read an announcement; traffic is
encrypted and replay-protected (CURVE nonces). Without a secret, the data plane serves
loopback only (one host, `epd up`), and says so at startup. The same secret yields the API
key every vLLM server and encoder pool of the deployment requires (`api_key`, passed in
`$VLLM_API_KEY`, never on a command line) and the gateway presents.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from epd_common.net import resolve_host

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


@dataclass(frozen=True)
class CurveKeys:
    """The deployment's CURVE key pairs for servers and clients.

    The deployment's CURVE key pairs (z85): one for servers (ROUTER, PUB), one for
    clients (DEALER, SUB)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def server(self, sock: zmq.Socket) -> None:
        """Make a bound socket (ROUTER, PUB) a CURVE server: before bind()."""
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def client(self, sock: zmq.Socket) -> None:
        """Make a connecting socket (DEALER, SUB) a CURVE client: before connect()."""
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.client_public
        sock.curve_secretkey = self.client_secret


def _derive(secret: bytes, purpose: str, data: bytes | None = None) -> bytes:
    """A 32-byte key for one purpose (curve, seal, ids, admin), derived from the secret."""
    return hashlib.blake2b(purpose.encode() if data is None else data, key=secret[:64],
                           digest_size=32, person=f"epd-{purpose}-v1".encode()).digest()


def _secret_key(secret: bytes, role: bytes) -> bytes:
    return z85.encode(_derive(secret, "curve", role))


def curve_keys(secret: bytes | None) -> CurveKeys | None:
    """The key pairs every holder of `secret` derives alike; None without a secret."""
    if secret is None:
        return None
    if not zmq.has("curve"):
        raise SecretError("this pyzmq/libzmq has no CURVE support: reinstall pyzmq (its "
                          "wheels bundle libsodium)")
    server_secret, client_secret = _secret_key(secret, b"server"), _secret_key(secret, b"client")
    return CurveKeys(zmq.curve_public(server_secret), server_secret,
                     zmq.curve_public(client_secret), client_secret)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def data_plane_host(host_setting: str, has_secret: bool) -> str:
    """The address a process serves the data plane on.

    The address a process serves the data plane on: `host_setting` resolved (net.py), or
    loopback when there is no deployment secret (nothing unauthenticated leaves the host)."""
    host = resolve_host(host_setting)
    return host if has_secret or is_loopback(host) else "127.0.0.1"


class Seal:
    """Seal and check stored objects with the deployment secret.

    Authenticates stored objects (Mooncake Store objects, safetensors files) with the
    deployment secret: HMAC-SHA256 over the object's identity (namespace, item, dtype, shape,
    size) and its payload. Without a secret it is inactive (objects are still checked against
    their xxh3). With one, a reader accepts only objects sealed with the same secret: a
    well-formed object planted by anyone else, or the bytes of one item under another's name,
    is a miss, never a wrong embedding."""

    def __init__(self, secret: bytes | None) -> None:
        self._key = None if secret is None else _derive(secret, "seal")

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


def identity(namespace: str, key: str, dtype: str, shape, nbytes: int) -> str:
    """What a seal binds an object to (so bytes cannot be moved to another item or model)."""
    return f"{namespace}|{key}|{dtype}|{','.join(map(str, shape))}|{nbytes}"


# -- item ids a deployment vouches for -------------------------------------------------------
_ID_SEP = "~"


class IdSigner:
    """Sign and check item ids, so only vouched-for ids are shared.

    Item ids the deployment vouches for: the gateway derives an id from the media and
    signs it (`<content id>~<tag>`, HMAC-SHA256 with the secret); a producer holding the
    secret shares (saves, publishes) only items whose id carries a valid tag. Any other id a
    client chose (a `uuid` sent straight to a vLLM producer, or to the pool) is encoded for
    that request only, so nobody can store image A's embedding under image B's id. Without
    a secret every id is accepted (one host, loopback: the gateway is the only client)."""

    def __init__(self, secret: bytes | None) -> None:
        self._key = None if secret is None else _derive(secret, "ids")

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


def admin_token(secret: bytes) -> str:
    """The bearer token of a gateway's admin endpoints.

    The bearer token of a gateway's admin endpoints (join/leave at run time): derived from
    the deployment secret, so the secret itself never travels (`epd admin-token` prints it)."""
    return hmac.new(_derive(secret, "admin"), b"epd-admin", hashlib.sha256).hexdigest()


# -- the API key of the deployment's servers ---------------------------------------------------
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own variable (its --api-key without the command line)


def api_key(secret: bytes) -> str:
    """The API key of the deployment's servers, derived from the secret.

    The key every vLLM server and encoder pool of the deployment requires on its API
    (`Authorization: Bearer <key>`), and the gateway presents: derived from the deployment
    secret ("epd api key v1"), so one secret gives one key and the secret never travels.
    `epd api-key` prints it."""
    return hmac.new(_derive(secret, "api"), b"epd api key v1", hashlib.sha256).hexdigest()


def server_api_key(secret_file: str | os.PathLike | None = None) -> str | None:
    """The API key an EPD server requires, if any.

    The key an EPD server requires: `$VLLM_API_KEY` when set, else the key derived from
    the deployment secret (`secret_file`, else `$EPD_SECRET_FILE`), else None (no secret:
    loopback only, unkeyed)."""
    given = os.environ.get(API_KEY_ENV)
    if given:
        return given
    secret = read_secret(secret_file)
    return None if secret is None else api_key(secret)


def export_api_key(environ: dict[str, str] | None = None) -> bool:
    """Put the deployment's API key in `$VLLM_API_KEY` when it is unset.

    Put the deployment's key in `$VLLM_API_KEY` (of `environ`, default this process) when
    a secret is there and the variable is not set: how a vLLM server started by hand,
    compose or Kubernetes (`epd vllm serve`, the image's `vllm`) requires it without a
    command-line flag `ps` would show. Returns whether the variable is set now."""
    env = os.environ if environ is None else environ
    if not env.get(API_KEY_ENV):
        secret = read_secret(env.get(SECRET_ENV) or None)
        if secret is not None:
            env[API_KEY_ENV] = api_key(secret)
    return bool(env.get(API_KEY_ENV))
