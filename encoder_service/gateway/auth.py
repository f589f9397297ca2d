"""API keys on EPD's HTTP servers, both directions of the gateway.

Clients -> gateway: the OpenAI endpoints (`/v1/...`) take API keys as `vllm serve --api-key`
does: `Authorization: Bearer <key>`, any of the configured keys (`api_keys`, one per line in
`api_keys_file` for several clients, `$EPD_GATEWAY_API_KEY`); anything else is a 401 in
OpenAI's error shape. `/health` and `/metrics` stay open (as vLLM's own health and metrics);
`/instances`, which names internal addresses, answers a client key or the admin token once
client keys are configured (admin.py); the admin routes have their own token (the deployment
secret's).
Gateway -> servers: every vLLM server and encoder pool of a deployment with a secret requires
the key derived from it (ec_connectors.protocol.api_keys.api_key); `upstream_headers` is what
the gateway presents on every call (encoders, decode instances, probes, failover).

The guard itself (`RequireKey`, keys compared in constant time) is
ec_connectors.protocol.http_api's, which the encoder pool and the vLLM servers' guard use too.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ec_connectors.protocol.api_keys import api_key
from ec_connectors.protocol.secret_file import read_secret

CLIENT_KEY_ENV = "EPD_GATEWAY_API_KEY"


def read_keys_file(path: str | os.PathLike) -> list[str]:
    """One key per line; blank lines and `#` comments are skipped.

    Raises ValueError with a clear message for a missing or empty file (a typo must not open the
    gateway)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the API keys file {path}: {exc.strerror}") from None
    keys = [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]
    if not keys:
        raise ValueError(f"the API keys file {path} holds no key")
    return keys


def client_keys(keys: Iterable[str], keys_file: str | None,
                env: dict[str, str] | None = None) -> list[str]:
    """Every key a gateway client may present: `keys`, the file's, `$EPD_GATEWAY_API_KEY`'s."""
    env = os.environ if env is None else env
    out = [k for k in keys if k]
    if keys_file:
        out += read_keys_file(keys_file)
    if env.get(CLIENT_KEY_ENV):
        out.append(env[CLIENT_KEY_ENV])
    return list(dict.fromkeys(out))


def upstream_headers(secret_file: str | None) -> dict[str, str]:
    """The auth header the gateway presents to its deployment's servers.

    The header the gateway presents to every server of its deployment: the key derived
    from the deployment secret (`secret_file`, else `$EPD_SECRET_FILE`); none without one."""
    secret = read_secret(secret_file)
    return {} if secret is None else {"authorization": f"Bearer {api_key(secret)}"}
