"""The one exception type that becomes a client-facing HTTP error, in OpenAI's shape:
`{"error": {"message", "type", "code"}}` with `code` the machine-readable reason (the same
label the rejection metrics carry); docs/errors.md lists them."""

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
        return {"error": {"message": self.message, "type": error_type(self.status),
                          "code": self.reason}}


def error_type(status: int) -> str:
    """OpenAI's error `type` for a status (as the vLLM servers' guard answers)."""
    return {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            429: "rate_limit_error", 503: "service_unavailable_error"}.get(
        status, "invalid_request_error" if status < 500 else "upstream_error")
