"""Admission at the gateway's door: request id, slot and body.

Admission at the gateway's door, before any upstream call: a request id, a slot among
`limits.max_concurrent_requests` (else 429 with Retry-After), and a JSON body read within
`limits.max_request_bytes` and `limits.body_read_timeout_s` (413, 408, 400 bad_json)."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from encoder_service.gateway.config import LimitsConfig
from encoder_service.gateway.wire import GatewayError, json_decode, within

_RID = re.compile(r"[A-Za-z0-9_-]{1,64}")


# Fresh ids: this process's random prefix and a counter (unique without a system call each).
_PREFIX = os.urandom(8).hex()
_COUNT = itertools.count(1)


def request_id(request: Request) -> str:
    """The client's x-request-id when it is short and safe, else a fresh one."""
    rid = request.headers.get("x-request-id", "")
    return rid if rid and _RID.fullmatch(rid) else f"{_PREFIX}{next(_COUNT):08x}"


class Admission:
    """Slots for chat/completions requests and the bounded body read."""

    def __init__(self, limits: LimitsConfig) -> None:
        self.limits = limits
        self.active = 0  # chat/completions requests admitted and not finished

    def admit(self) -> GatewayError | None:
        """Take a slot for one more request, or return the 429 to answer.

        A slot for one more chat/completions request (give it back with `leave()`), or
        the 429 to answer."""
        limit = self.limits.max_concurrent_requests
        if self.active >= limit:
            return GatewayError(429, f"the gateway has {limit} requests in flight "
                                "(limits.max_concurrent_requests); retry later",
                                "overloaded", retry_after_s=1.0)
        self.active += 1
        return None

    def leave(self) -> None:
        self.active -= 1

    async def read_json(self, request: Request) -> Any:
        """The parsed body (any JSON value: the caller checks its shape)."""
        limit = self.limits.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise GatewayError(413, f"request body is larger than {limit} bytes",
                               "request_too_large")
        chunks: list[bytes] = []
        receive = request.receive

        async def read() -> None:
            size = 0
            while True:  # Request.stream(), without its async generator
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect()
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise GatewayError(413, f"request body is larger than {limit} bytes",
                                       "request_too_large")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return

        timeout = self.limits.body_read_timeout_s
        try:
            await within(read(), timeout)
        except asyncio.TimeoutError:
            raise GatewayError(408, f"the request body did not arrive within {timeout:g} s",
                               "body_timeout") from None
        try:
            return json_decode(b"".join(chunks))
        except ValueError as exc:
            raise GatewayError(400, f"request body is not valid JSON: {exc}",
                               "bad_json") from None
