"""Validate an OpenAI chat request's media and give each item its content-derived id.

Contract of `prepare_chat`: on success the body is rewritten in place (every media part
carries `uuid` = content id; URL media become data: URLs, so no vLLM server ever fetches a
URL; any client `ec_transfer_params` is dropped) and the distinct media items are returned.
On bad input it raises GatewayError (4xx) before any upstream call.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from PIL import Image

from ec_connectors.protocol.keys import content_item_id
from encoder_service.gateway.config import GatewayConfig
from encoder_service.gateway.errors import GatewayError

Fetcher = Callable[[str], Awaitable[tuple[bytes, str | None]]]

# content part type -> (modality, key holding the payload)
_MEDIA_PARTS = {"image_url": ("image", "image_url"), "video_url": ("video", "video_url"),
                "audio_url": ("audio", "audio_url"), "input_audio": ("audio", "input_audio")}
_TEXT_PARTS = {"text"}


@dataclass
class MediaPart:
    """One distinct media item of a request. `part` is a JSON-ready content part (with uuid)
    that an encoder can be sent as is."""

    item_id: str
    modality: str
    nbytes: int
    part: dict[str, Any]


@dataclass
class PreparedRequest:
    body: dict[str, Any]
    items: list[MediaPart]
    stream: bool


def _b64(data: str, what: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise GatewayError(400, f"{what}: malformed base64 data", "bad_base64") from None


def _split_data_url(url: str) -> tuple[str, str]:
    """(mime, base64 payload) of a `data:<mime>;base64,<payload>` URL."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise GatewayError(400, "data URLs must look like data:<mime>;base64,<data>",
                           "bad_data_url")
    return head[5:-7].lower(), payload


class _Recent:
    """A bounded set of content ids whose bytes already passed validation (same bytes, same
    verdict: a repeated image skips the decode check)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self.ids: dict[str, None] = {}

    def __contains__(self, item_id: str) -> bool:
        return item_id in self.ids

    def add(self, item_id: str) -> None:
        self.ids[item_id] = None
        if len(self.ids) > self.size:
            del self.ids[next(iter(self.ids))]


_validated = _Recent()


def check_image(data: bytes, cfg: GatewayConfig) -> None:
    """Raise 400 unless `data` is a decodable image within the pixel limit."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                w, h = img.size
                if w * h > cfg.limits.max_image_pixels:
                    raise GatewayError(413, f"image is {w}x{h} pixels; the limit is "
                                       f"{cfg.limits.max_image_pixels}", "image_too_large")
                img.verify()
    except GatewayError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise GatewayError(413, "image has too many pixels", "image_too_large") from None
    except Exception:  # noqa: BLE001 - PIL raises many types for bad bytes
        raise GatewayError(400, "image_url does not hold a decodable image "
                           "(PNG, JPEG, WebP, GIF, ...)", "not_an_image") from None


async def _load(part: dict[str, Any], kind: str, modality: str, cfg: GatewayConfig,
                fetch: Fetcher) -> bytes:
    """The media bytes of one part; URL media are fetched and inlined as a data: URL."""
    limit = cfg.limits.max_media_bytes
    payload = part.get(kind)
    if kind == "input_audio":
        if not isinstance(payload, dict) or not isinstance(payload.get("data"), str):
            raise GatewayError(400, "input_audio needs {data: <base64>, format}", "bad_part")
        if len(payload["data"]) > limit * 4 // 3 + 4:
            raise GatewayError(413, f"media item is larger than {limit} bytes",
                               "media_too_large")
        return _b64(payload["data"], "input_audio")
    if isinstance(payload, str):  # the short form {"image_url": "<url>"}
        payload = {"url": payload}
        part[kind] = payload
    url = payload.get("url") if isinstance(payload, dict) else None
    if not isinstance(url, str) or not url:
        raise GatewayError(400, f"{kind} needs a url", "bad_part")
    if url.startswith("data:"):
        mime, b64 = _split_data_url(url)
        if len(b64) > limit * 4 // 3 + 4:
            raise GatewayError(413, f"media item is larger than {limit} bytes",
                               "media_too_large")
        return _b64(b64, f"{kind} data URL")
    data, ctype = await fetch(url)
    mime = (ctype or "").split(";", 1)[0].strip().lower()
    if not mime.startswith(f"{modality}/"):
        mime = {"image": "image/png", "audio": "audio/wav", "video": "video/mp4"}[modality]
    payload["url"] = f"data:{mime};base64," + base64.b64encode(data).decode()
    return data


async def prepare_chat(body: Any, cfg: GatewayConfig, fetch: Fetcher) -> PreparedRequest:
    """Validate `body` (a parsed chat completion request) and tag its media; see module doc."""
    if not isinstance(body, dict):
        raise GatewayError(400, "request body must be a JSON object")
    model = body.setdefault("model", cfg.model)
    if model != cfg.model:
        raise GatewayError(404, f"model {model!r} is not served here; this gateway serves "
                           f"{cfg.model!r}", "unknown_model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages must be a non-empty list")
    body.pop("ec_transfer_params", None)  # the gateway decides what decode instances get
    items: dict[str, MediaPart] = {}
    n_parts = 0
    for msg in messages:
        if not isinstance(msg, dict):
            raise GatewayError(400, "each message must be an object")
        content = msg.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise GatewayError(400, "message content must be a string or a list of parts")
        for part in content:
            if not isinstance(part, dict):
                raise GatewayError(400, "each content part must be an object")
            ptype = part.get("type")
            if ptype in _TEXT_PARTS:
                continue
            if ptype not in _MEDIA_PARTS:
                raise GatewayError(400, f"unsupported content part type {ptype!r}",
                                   "bad_part")
            modality, kind = _MEDIA_PARTS[ptype]
            if modality not in cfg.media.modalities:
                raise GatewayError(400, f"model {cfg.model!r} does not accept {modality} "
                                   "input here (media.modalities)", "modality_disabled")
            n_parts += 1
            if n_parts > cfg.limits.max_media_items:
                raise GatewayError(400, f"more than {cfg.limits.max_media_items} media items",
                                   "too_many_items")
            data = await _load(part, kind, modality, cfg, fetch)
            if len(data) > cfg.limits.max_media_bytes:
                raise GatewayError(413, f"media item is larger than "
                                   f"{cfg.limits.max_media_bytes} bytes", "media_too_large")
            if not data:
                raise GatewayError(400, f"{ptype} is empty", "bad_part")
            item_id = content_item_id(data, cfg.namespace)
            verdict = f"{cfg.limits.max_image_pixels}:{item_id}"
            if modality == "image" and verdict not in _validated:
                check_image(data, cfg)
                _validated.add(verdict)
            part["uuid"] = item_id
            if item_id not in items:
                items[item_id] = MediaPart(item_id, modality, len(data), part)
    return PreparedRequest(body=body, items=list(items.values()),
                           stream=body.get("stream") is True)
