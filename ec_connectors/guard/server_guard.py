"""The ASGI guard in front of a vLLM server's API.

The guard in front of a vLLM server's API: `vllm serve ... --middleware
ec_connectors.server_guard.ServerGuard` (every server `epd up`, compose and k8s start).

vLLM adds it as an ASGI middleware (`app.add_middleware(ServerGuard)`, the outermost of its
own), so it sees every request before vLLM reads it, and every answer. It does four things:

1. **The deployment key on every route.** vLLM's own `--api-key` check
   (`AuthenticationMiddleware`) guards only /v1, /v2, /inference and /cohere; /pause,
   /abort_requests, /tokenize, /invocations, /reset_* ... stay open. With a key set
   (`VLLM_API_KEY`, or vLLM's `--api-key`), every route but /health, /ping, /metrics and
   /version needs `Authorization: Bearer <key>` (compared in constant time); 401 otherwise.
   Without a key nothing is enforced.
2. **Bounds before allocation** (`request_checks.py`): a JSON body that may hold embeddings
   parts or `ec_transfer_params` is parsed and checked against the served model before vLLM
   sees it; a violation is a 400/413 with a reason, answered at once, nothing allocated.
3. **A reason on every refusal.** vLLM's error answers get a machine-readable `code` in
   OpenAI's shape (`{"error": {"message", "type", "code"}}`), and an engine failure of a
   request whose embedding the connector could not deliver (`500 Internal server error`,
   streamed or not) becomes a 503 with the connector's reason (`refusals.ReasonBoard`):
   `embedding_unavailable`, `embedding_load_failed`, `embedding_timeout`; or a 400
   `embedding_mismatch` (the stored item does not fit the part naming it). docs/errors.md
   lists them all.
4. **Items named by their EPD id** on an EPDConnector server (`item_ids.py`): vLLM would
   name an item sent with media or processor settings by a hash of its uuid and the
   settings, which neither the gateway nor the other servers know.
"""

from __future__ import annotations

import binascii
import json
import os
import re
import time
from typing import Any

import msgspec
import pybase64
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ec_connectors.config import GuardSettings
from ec_connectors.guard.item_ids import keep_item_ids
from ec_connectors.guard.request_checks import Checked, ModelBounds, check_request
from ec_connectors.log import get_logger
from ec_connectors.plugin import CONNECTOR_NAME
from ec_connectors.protocol.http_api import KeyCheck, comma_pieces, error_type
from ec_connectors.protocol.refusals import (
    EMBEDDING_MISMATCH,
    ReasonBoard,
    Refusal,
    board_dir,
    error_body,
    failure_status,
)

logger = get_logger(__name__)

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
_ENGINE_FAILED = "Internal server error"  # vLLM's GenerationError message
_ADVICE = (" The request names an embedding this server could not use and carries no media "
           "to encode it from: send the media (a gateway does this by itself), or retry.")
# A media URL's payload (`_without_media`): bodies from this size on are looked at, payloads
# from this size on left out of the parse
_ELIDE_FROM, _ELIDE_MIN = 32 * 1024, 4 * 1024
_URL_VALUE = re.compile(
    rb'"url"[ \t\n\r]*:[ \t\n\r]*"data:[\x20\x21\x23-\x5b\x5d-\x7e]{0,200}?;base64,')
_MISFIT_ADVICE = (" The part names a stored embedding that is not what the part says: send "
                  "the metadata its producer published for it (ec_transfer_params), or the "
                  "media.")


def _key_check(keys: list[str]) -> KeyCheck | None:
    """The check of `keys` (empty ones dropped); None, nothing enforced, without any."""
    keys = [k for k in keys if k]
    return KeyCheck(keys) if keys else None


class ServerGuard:
    """Pure ASGI middleware; see the module doc.

    `bounds`, `api_keys` and `settings` are for tests; in vLLM they come from the app's state on
    the first request."""

    def __init__(self, app: ASGIApp, bounds: ModelBounds | None = None,
                 api_keys: list[str] | None = None, settings: GuardSettings | None = None,
                 reasons: ReasonBoard | None = None) -> None:
        self.app = app
        self._bounds = bounds
        self._keys_given = api_keys is not None  # else vLLM's (_resolve)
        self._keys = None if api_keys is None else _key_check(api_keys)
        self._settings = settings
        self._reasons = reasons
        self._resolved = False  # the rest comes from vLLM's app state (_resolve)

    # -- configuration from vLLM's app state (once) --------------------------------------
    def _resolve(self, scope: Scope) -> None:
        state = getattr(scope.get("app"), "state", None)
        args = getattr(state, "args", None)
        if not self._keys_given:  # vLLM's rule: --api-key, else VLLM_API_KEY
            keys = list(getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY", "")])
            self._keys = _key_check(keys)
        vllm_config = getattr(state, "vllm_config", None)
        if vllm_config is None:
            self._settings = self._settings or GuardSettings()
            self._resolved = True  # not a vLLM app (yet): keys only, plus bounds if given
            return
        ec = vllm_config.ec_transfer_config
        extra = dict(getattr(ec, "ec_connector_extra_config", None) or {})
        from ec_connectors.config import EPDConfig

        try:
            cfg: GuardSettings = EPDConfig.from_dict(extra)
        except Exception:  # noqa: BLE001 - another connector's keys: defaults
            cfg = GuardSettings()
        self._settings = self._settings or cfg
        renderer = getattr(getattr(state, "engine_client", None), "renderer", None)
        processor = getattr(renderer, "mm_processor", None)
        if isinstance(cfg, EPDConfig) and getattr(ec, "ec_connector", None) == CONNECTOR_NAME:
            keep_item_ids(processor, cfg.ids)  # item_ids.py: the uuid names the item
        if self._bounds is None:
            self._bounds = ModelBounds.from_vllm(
                vllm_config.model_config, getattr(processor, "info", None),
                max_items=self._settings.guard_max_items,
                max_params_bytes=self._settings.guard_max_params_bytes,
                producers=tuple(getattr(cfg, "producers", ()) or ()))
            logger.info("EPD server guard: %s", self._bounds)
        if self._reasons is None and ec is not None and ec.engine_id:
            self._reasons = ReasonBoard(board_dir(extra.get("control_dir"), ec.engine_id))
        self._resolved = True

    # -- ASGI ----------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if not self._resolved:
            try:
                self._resolve(scope)
            except Exception:  # noqa: BLE001 - never take the server down; log once
                logger.exception("EPD server guard: cannot read the model's bounds; "
                                 "requests are checked for the key only")
                self._settings = self._settings or GuardSettings()
                self._resolved = True
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if (self._keys is not None and scope.get("method") != "OPTIONS"
                and path not in OPEN_PATHS and not self._keys.admits(_authorization(scope))):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await _answer(send, 401, "invalid_api_key", "a valid API key is required: "
                          "Authorization: Bearer <key>",
                          [(b"www-authenticate", b"Bearer")])
            return
        started = time.time()
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("method") != "POST":
            await self.app(scope, receive, _Answers(send, self, None, started))
            return
        try:
            body, receive = await self._read_body(receive)
            checked = self._check(scope, body)
        except Refusal as exc:
            await _answer(send, exc.status, exc.code, exc.message)
            return
        await self.app(scope, receive, _Answers(send, self, checked, started))

    async def _read_body(self, receive: Receive) -> tuple[bytes, Receive]:
        """Read a request's whole body, within its size limit, and replay it to vLLM.

        The whole body (refused beyond `guard_max_body_bytes`), and a `receive` that
        hands it to vLLM again."""
        assert self._settings is not None
        limit = self._settings.guard_max_body_bytes
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks), _replay(b"", receive, message)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise Refusal(413, "body_too_large",
                              f"the request body is larger than {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        return body, _replay(body, receive)

    def _check(self, scope: Scope, body: bytes) -> Checked | None:
        if self._bounds is None or not body:
            return None
        ctype = ""
        for name, raw in scope.get("headers", ()):
            if name == b"content-type":
                ctype = raw.decode("latin-1").lower()
        if ctype and "json" not in ctype:
            return None  # multipart uploads (transcriptions): vLLM reads no parts there
        # Every JSON body is parsed (a JSON \\u escape can spell any key, so no substring test
        # can skip one): msgspec, the faster parser (docs/benchmarks.md); what it
        # refuses (NaN, lone surrogates) json reads as vLLM's FastAPI does (same duplicate keys).
        # No check reads a media URL's payload: a body carrying one is parsed without it
        # (`_without_media`), the whole body again only where that could answer otherwise.
        reduced = _without_media(body) if len(body) >= _ELIDE_FROM else None
        if reduced is not None:
            checked = _check_reduced(reduced, self._bounds)
            if checked is not None:
                return checked
        try:
            parsed = msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError):
            parsed = _json(body)
        return check_request(parsed, self._bounds)

    def failure_reason(self, checked: Checked | None, since: float) -> tuple[str, str] | None:
        if checked is None or not checked.item_ids or self._reasons is None:
            return None
        return self._reasons.read(checked.item_ids, since - 0.001)


def _without_media(body: bytes) -> bytes | None:
    """Strip the base64 media payloads from a request body, keeping it valid JSON.

    `body` with the base64 payload of each `"url": "data:<type>;base64,<payload>"` value
    left out (an empty data URL stays), or None when it has none worth leaving out. Only a
    payload that is whole, valid base64 or a comma-joined list of it (a video's frames,
    protocol/http_api.py: nothing in either can end, escape or break the string)
    after a `"url"` key no backslash precedes (a key, not text) is left out: the reduced
    body is valid JSON exactly when the body is, with the same structure and every other
    string. No check reads such a payload (vLLM's part parser takes any string as a URL)."""
    keep: list[memoryview] = []
    start = pos = 0
    view = memoryview(body)
    while (pos := body.find(b'"url"', pos)) >= 0:
        head = _URL_VALUE.match(body, pos) if pos == 0 or body[pos - 1] != 0x5C else None
        if head is None:
            pos += 5
            continue
        end = body.find(b'"', head.end())
        if end < 0:
            break
        if end - head.end() >= _ELIDE_MIN and all(
                map(_base64, comma_pieces(body, head.end(), end))):
            keep.append(view[start:head.end()])
            start = end
        pos = end + 1
    if not keep:
        return None
    keep.append(view[start:])
    return b"".join(keep)


def _base64(data: memoryview) -> bool:
    try:
        pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _check_reduced(reduced: bytes, bounds: ModelBounds) -> Checked | None:
    """Check a request body without its media payloads, when that gives the same answer.

    The checks on a body without its media payloads; None where the whole body must be
    checked instead (so every answer is the one it would get): one msgspec refuses, a
    refusal (its message is the whole body's), `ec_transfer_params` holding a data URL
    (their size counts every byte)."""
    try:
        parsed = msgspec.json.decode(reduced)
        checked = check_request(parsed, bounds)
    except (msgspec.DecodeError, RecursionError, Refusal):
        return None
    params = parsed.get("ec_transfer_params") if isinstance(parsed, dict) else None
    if params is not None and b";base64," in msgspec.json.encode(params):
        return None
    return checked


def _authorization(scope: Scope) -> str | None:
    """The request's first `Authorization` header, as starlette reads it (latin-1)."""
    for name, raw in scope.get("headers", ()):
        if name == b"authorization":
            return raw.decode("latin-1")
    return None


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except RecursionError:
        raise Refusal(400, "invalid_json", "the request body is nested too deeply") from None
    except ValueError as exc:
        raise Refusal(400, "invalid_json", f"the request body is not valid JSON: {exc}") \
            from None


def _replay(body: bytes, receive: Receive, first: Message | None = None) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return first or {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _answer(send: Send, status: int, code: str, message: str,
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(error_body(status, code, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


def _code_for(status: int, message: str) -> str:
    """A machine-readable code for one of vLLM's error answers.

    A machine-readable code for one of vLLM's own error answers (its `code` is the
    HTTP status)."""
    text = message.lower()
    if status == 400:
        return "context_length_exceeded" if "context length" in text or \
            "maximum model length" in text else "invalid_request"
    return {401: "invalid_api_key", 403: "forbidden",
            404: "model_not_found" if "model" in text else "not_found",
            405: "method_not_allowed", 413: "body_too_large", 415: "unsupported_media_type",
            422: "invalid_request", 429: "rate_limited", 501: "not_implemented",
            503: "service_unavailable"}.get(status, "engine_error" if status >= 500
                                            else "invalid_request")


class _Answers:
    """Rewrite vLLM's answers: reasons on errors, a 503 for a lost embedding.

    `send` for vLLM's answer: error answers get a reason (module doc, 3.); an engine
    failure of a request whose embedding the connector lost becomes a 503."""

    def __init__(self, send: Send, guard: ServerGuard, checked: Checked | None,
                 started: float) -> None:
        self.send, self.guard, self.checked, self.started = send, guard, checked, started
        self.start: Message | None = None  # an error answer's start, held for its body
        self.chunks: list[bytes] = []
        self.stream = False

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = dict(message.get("headers", ()))
            ctype = headers.get(b"content-type", b"")
            if message["status"] >= 400 and b"json" in ctype:
                self.start = message
                return
            self.stream = (b"event-stream" in ctype and self.checked is not None
                           and bool(self.checked.item_ids))
        elif kind == "http.response.body":
            if self.start is not None:
                self.chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    await self._send_error()
                return
            if self.stream and b'"error"' in message.get("body", b""):
                message = {**message, "body": self._stream_event(message["body"])}
        await self.send(message)

    def _reason(self, status: int, error: dict[str, Any]) -> tuple[int, str, str]:
        message = str(error.get("message", ""))
        if status == 500 and message == _ENGINE_FAILED:
            found = self.guard.failure_reason(self.checked, self.started)
            if found is not None:
                advice = _MISFIT_ADVICE if found[0] == EMBEDDING_MISMATCH else _ADVICE
                return failure_status(found[0]), found[0], found[1] + "." + advice
        code = error.get("code")
        return status, code if isinstance(code, str) else _code_for(status, message), message

    async def _send_error(self) -> None:
        assert self.start is not None
        status, data = self.start["status"], b"".join(self.chunks)
        try:
            body = json.loads(data)
        except ValueError:
            body = None
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, str) or error is None:  # {"error": "..."}, {"detail": ...}
            detail = body.get("detail") if isinstance(body, dict) else None
            error = {"message": error or (detail if isinstance(detail, str) else
                                          json.dumps(detail) if detail else data[:500]
                                          .decode("utf-8", "replace"))}
        if isinstance(error, dict):
            status, code, message = self._reason(status, error)
            data = json.dumps({"error": {**error, "message": message,
                                         "type": error_type(status), "code": code}}).encode()
        headers = [(k, v) for k, v in self.start.get("headers", ())
                   if k != b"content-length"] + [(b"content-length", str(len(data)).encode())]
        await self.send({**self.start, "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": data})

    def _stream_event(self, chunk: bytes) -> bytes:
        """A streamed `data: {"error": ...}` event of an engine failure, with its reason."""
        out = []
        for event in chunk.split(b"\n\n"):
            if event.startswith(b"data: {") and b'"error"' in event:
                try:
                    payload = json.loads(event[6:])
                except ValueError:
                    payload = None
                error = payload.get("error") if isinstance(payload, dict) else None
                if isinstance(error, dict):
                    code = error.get("code")
                    status, code, message = self._reason(
                        code if isinstance(code, int) and 400 <= code < 600 else 500, error)
                    event = b"data: " + json.dumps({**payload, "error": {
                        **error, "message": message, "type": error_type(status),
                        "code": code}}).encode()
            out.append(event)
        return b"\n\n".join(out)
