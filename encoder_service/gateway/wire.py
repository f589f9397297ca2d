"""What the gateway writes on the wire: the one JSON codec and the client-facing error.

The codec is msgspec's (docs/benchmarks.md has its cost beside json's); its decode errors are
ValueErrors like json's (`DecodeError` is one), so callers can catch either. `GatewayError` is
the one exception that becomes a client-facing HTTP error, in OpenAI's shape:
`{"error": {"message", "type", "code"}}` with `code` the machine-readable reason (the same
label the rejection metrics carry); docs/errors.md lists them.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec

from ec_connectors.protocol.http_api import UPSTREAM_ERROR, error_type

json_decode = msgspec.json.decode
json_encode = msgspec.json.encode
DecodeError = msgspec.DecodeError


class GatewayError(Exception):
    """A request the gateway refuses or cannot serve. `reason` is a short metrics label."""

    def __init__(self, status: int, message: str, reason: str = "bad_request",
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason
        self.retry_after_s = retry_after_s  # sent as Retry-After (429, 503)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": error_type(self.status, UPSTREAM_ERROR), "code": self.reason}}


_T = TypeVar("_T")

if sys.version_info >= (3, 11):
    async def within(aw: Awaitable[_T], seconds: float | None) -> _T:
        """`await aw` within `seconds` (None: no limit), else asyncio.TimeoutError.

        As `asyncio.wait_for`, without the task that it starts on Python 3.11 (one a request
        on every hop)."""
        async with asyncio.timeout(seconds):
            return await aw
else:
    within = asyncio.wait_for


def ms(seconds: float | None) -> str:
    """A duration as a log field (milliseconds; "-" for none)."""
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def served_body(body: Any, model: str) -> dict[str, Any]:
    """`body` checked to be a JSON object for `model` (the model filled in when absent)."""
    if not isinstance(body, dict):
        raise GatewayError(400, "request body must be a JSON object")
    asked = body.setdefault("model", model)
    if asked != model:
        raise GatewayError(404, f"model {asked!r} is not served here; this gateway serves "
                           f"{model!r}", "unknown_model")
    return body
