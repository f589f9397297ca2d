"""The data plane's CURVE key pairs, and the host it serves on without them.

Every process holding the deployment secret (secret_file.py) derives the same ZMQ CURVE key
pairs: the Mooncake TE side channels (ROUTER/DEALER) and the announcements (PUB/SUB) run
CURVE, so a peer that does not hold the secret cannot complete a handshake (it would need the
server's public key, which only the secret yields): it can neither pull an item, nor name a
buffer to write into, nor read an announcement; traffic is encrypted and replay-protected
(CURVE nonces). Without a secret, the data plane serves loopback only (`data_plane_host`; one
host, `epd up`), and says so at startup.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq
from zmq.utils import z85

from ec_connectors.protocol.secret_file import SecretError, derive_key
from epd_common.net import is_loopback, resolve_host


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


def _secret_key(secret: bytes, role: bytes) -> bytes:
    return z85.encode(derive_key(secret, "curve", role))


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


def data_plane_host(host_setting: str, has_secret: bool) -> str:
    """The address a process serves the data plane on.

    The address a process serves the data plane on: `host_setting` resolved (net.py), or
    loopback when there is no deployment secret (nothing unauthenticated leaves the host)."""
    host = resolve_host(host_setting)
    return host if has_secret or is_loopback(host) else "127.0.0.1"
