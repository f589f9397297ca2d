"""The one exception type that becomes a client-facing HTTP error, in OpenAI's shape:
`{"error": {"message", "type", "code"}}` with `code` the machine-readable reason (the same
label the rejection metrics carry); docs/errors.md lists them."""

from __future__ import annotations

from typing import Any

from ec_connectors.protocol.http_api import UPSTREAM_ERROR, error_type


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
