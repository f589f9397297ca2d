"""The one exception type that becomes a client-facing HTTP error (OpenAI error shape)."""

from __future__ import annotations

from typing import Any


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
        kind = "invalid_request_error" if self.status < 500 else "upstream_error"
        return {"error": {"message": self.message, "type": kind, "code": self.status}}
