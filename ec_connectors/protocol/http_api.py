"""What every EPD HTTP server shares with OpenAI's and vLLM's APIs.

What every EPD HTTP server shares with OpenAI's and vLLM's APIs: the error `type` a status
answers with, and bearer API keys checked in constant time. The gateway, the encoder pool and
the server guard in front of every vLLM server all answer through this one module.

Keys are compared as vLLM's own check does: the SHA-256 of the presented key against every
configured key's, all of them each time, so neither the match nor its position shows in the
timing.

A video may come as vLLM's list of frames (`data:video/jpeg;base64,<f1>,<f2>,...`, each frame
base64, joined by commas): `comma_pieces` splits one without copying; the gateway decodes the
frames (its content id covers them), the server guard leaves such a payload out of its parse.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable, Iterator

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

# The `type` of a 5xx other than 503 is the one word the servers do not share, and each is
# what its clients already read: a vLLM server's guard says `server_error` (its own engine
# failed), the gateway and the encoder pool say `upstream_error` (docs/errors.md).
SERVER_ERROR = "server_error"
UPSTREAM_ERROR = "upstream_error"

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}


def error_type(status: int, failed: str = SERVER_ERROR) -> str:
    """OpenAI's error `type` for an HTTP status.

    OpenAI's error `type` for an HTTP status; `failed` is the type of a 5xx other than 503
    (`SERVER_ERROR` or `UPSTREAM_ERROR`, above)."""
    return _TYPES.get(status, "invalid_request_error" if status < 500 else failed)


class KeyCheck:
    """Constant-time membership of a presented bearer key among the configured ones."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]
        if not self._digests:
            raise ValueError("KeyCheck needs at least one key")

    def admits(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header's value is `Bearer <one of the keys>`."""
        scheme, _, given = (authorization or "").partition(" ")
        digest = hashlib.sha256(given.strip().encode()).digest()
        ok = False
        for d in self._digests:  # every key, every time
            ok |= hmac.compare_digest(digest, d)
        return ok and scheme.lower() == "bearer"


class RequireKey:
    """ASGI middleware that requires an API key on some path prefixes.

    ASGI middleware: HTTP requests whose path starts with one of `prefixes` need a key
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
            body = {"error": {"message": "a valid API key is required: send it as "
                              "`Authorization: Bearer <key>`", "type": error_type(401),
                              "code": "invalid_api_key"}}
            await JSONResponse(body, status_code=401,
                               headers={"www-authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


def require_key(app: ASGIApp, keys: Iterable[str], **kw) -> ASGIApp:
    """`app` behind RequireKey when there are keys; `app` itself when there are none."""
    keys = list(keys)
    return RequireKey(app, keys, **kw) if keys else app


def comma_pieces(buf: bytes, start: int = 0, end: int | None = None) -> Iterator[memoryview]:
    """Split a byte range on commas into zero-copy views.

    The comma-separated pieces of `buf[start:end]`, as views of it (a 120-frame clip is
    25 MB: no piece is copied)."""
    end = len(buf) if end is None else end
    view = memoryview(buf)
    while (comma := buf.find(b",", start, end)) >= 0:
        yield view[start:comma]
        start = comma + 1
    yield view[start:end]
