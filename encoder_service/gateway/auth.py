"""API keys on EPD's HTTP servers, both directions of the gateway.

Clients -> gateway: the OpenAI endpoints (`/v1/...`) take API keys as `vllm serve --api-key`
does: `Authorization: Bearer <key>`, any of the configured keys (`api_keys`, one per line in
`api_keys_file` for several clients, `$EPD_GATEWAY_API_KEY`); anything else is a 401 in
OpenAI's error shape. `/health`, `/metrics` and `/instances` stay open (as vLLM's own health
and metrics); the admin routes have their own token (the deployment secret's).
Gateway -> servers: every vLLM server and encoder pool of a deployment with a secret requires
the key derived from it (ec_connectors.protocol.secret.api_key); `upstream_headers` is what
the gateway presents on every call (encoders, decode instances, probes, failover).

`RequireKey` is the ASGI guard both the gateway and the encoder pool use. Keys are compared in
constant time: the SHA-256 of the presented key against every configured key's, all of them
each time, so neither the match nor its position shows in the timing (as vLLM's own check).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ec_connectors.protocol.secret import api_key, read_secret
from encoder_service.gateway.errors import GatewayError

CLIENT_KEY_ENV = "EPD_GATEWAY_API_KEY"


def read_keys_file(path: str | os.PathLike) -> list[str]:
    """One key per line; blank lines and `#` comments are skipped. Raises ValueError with a
    clear message for a missing or empty file (a typo must not open the gateway)."""
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
    """The header the gateway presents to every server of its deployment: the key derived
    from the deployment secret (`secret_file`, else `$EPD_SECRET_FILE`); none without one."""
    secret = read_secret(secret_file)
    return {} if secret is None else {"authorization": f"Bearer {api_key(secret)}"}


class KeyCheck:
    """Constant-time membership of a presented bearer key among the configured ones."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        if not self._digests:
            raise ValueError("KeyCheck needs at least one key")

    def admits(self, authorization: str | None) -> bool:
        scheme, _, given = (authorization or "").partition(" ")
        digest = hashlib.sha256(given.strip().encode()).digest()
        ok = False
        for d in self._digests:  # every key, every time
            ok |= hmac.compare_digest(digest, d)
        return ok and scheme.lower() == "bearer"


class RequireKey:
    """ASGI middleware: HTTP requests whose path starts with one of `prefixes` need a key
    (401 otherwise, OpenAI's error shape); other paths, OPTIONS and lifespan pass.
    `on_refused()` is called for each refusal (a metric)."""

    def __init__(self, app: ASGIApp, keys: Iterable[str], prefixes: tuple[str, ...] = ("/v1",),
                 on_refused: Callable[[], None] | None = None) -> None:
        self.app = app
        self.check = KeyCheck(keys)
        self.prefixes = prefixes
        self.on_refused = on_refused

    def guards(self, scope: Scope) -> bool:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            return False
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        return path.startswith(self.prefixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.guards(scope) and not self.check.admits(Headers(scope=scope).get(
                "authorization")):
            if self.on_refused is not None:
                self.on_refused()
            err = GatewayError(401, "a valid API key is required: send it as "
                               "`Authorization: Bearer <key>`", "invalid_api_key")
            await JSONResponse(err.body(), status_code=401,
                               headers={"www-authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


def require_key(app: ASGIApp, keys: Iterable[str], **kw) -> ASGIApp:
    """`app` behind RequireKey when there are keys; `app` itself when there are none."""
    keys = list(keys)
    return RequireKey(app, keys, **kw) if keys else app
