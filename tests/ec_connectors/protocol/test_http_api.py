"""The HTTP pieces every EPD server shares: the error `type` of a status (both 5xx flavours)
and the constant-time bearer key check with its ASGI guard."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from ec_connectors.protocol.http_api import (
    UPSTREAM_ERROR,
    KeyCheck,
    RequireKey,
    error_type,
    require_key,
)


def test_error_type_follows_the_status_and_only_other_5xx_differ():
    expected = {400: "invalid_request_error", 408: "invalid_request_error",
                413: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
                503: "service_unavailable_error"}
    for status, kind in expected.items():
        assert error_type(status) == kind == error_type(status, UPSTREAM_ERROR), status
    for status in (500, 502, 504):
        assert error_type(status) == "server_error"  # a vLLM server's guard
        assert error_type(status, UPSTREAM_ERROR) == "upstream_error"  # gateway, pool


def test_key_check_is_exact():
    check = KeyCheck(["alpha", "beta"])
    assert check.admits("Bearer alpha") and check.admits("bearer beta")
    assert check.admits("Bearer  beta ")  # the key is stripped, as vLLM's check does
    for header in (None, "", "Bearer", "Bearer alph", "Bearer alphaa", "Token alpha", "alpha"):
        assert not check.admits(header), header
    with pytest.raises(ValueError):
        KeyCheck([])


def test_require_key_guards_its_prefixes_only():
    refused = []
    app = Starlette(routes=[Route("/v1/x", lambda _r: PlainTextResponse("ok")),
                            Route("/health", lambda _r: PlainTextResponse("up"))])
    client = TestClient(RequireKey(app, ["k1"], on_refused=lambda: refused.append(1)))
    answer = client.get("/v1/x")
    assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
    assert answer.content == (b'{"error":{"message":"a valid API key is required: send it as '
                              b'`Authorization: Bearer <key>`","type":"authentication_error",'
                              b'"code":"invalid_api_key"}}')
    assert refused == [1]
    assert client.get("/v1/x", headers={"authorization": "Bearer k1"}).text == "ok"
    assert client.get("/health").text == "up"
    assert require_key(app, []) is app
