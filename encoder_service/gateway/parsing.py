"""Validate an OpenAI chat request's media and give each item its content-derived id.

Contract of `prepare_chat`: on success the body is rewritten in place (every media part
carries `uuid` = content id; URL media become data: URLs, so no vLLM server ever fetches a
URL; any client `ec_transfer_params` and `kv_transfer_params` are dropped) and the distinct
media items are returned.
On bad input it raises GatewayError (4xx) before any upstream call.

The content id covers the media bytes and every request setting that changes the embedding
(`mm_processor_kwargs`, `media_io_kwargs`: fps, num_frames, max_pixels...), so the same bytes
with other settings never share an embedding; encoders get the same settings.
"""

from __future__ import annotations

import binascii
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pybase64

from ec_connectors.protocol.keys import content_item_id
from ec_connectors.protocol.lru import BoundedLRU
from ec_connectors.protocol.secret import IdSigner
from encoder_service.gateway.codec import json_encode
from encoder_service.gateway.config import GatewayConfig
from encoder_service.gateway.errors import GatewayError
from encoder_service.gateway.media import check_audio, check_frames, check_image, check_video

Fetcher = Callable[[str], Awaitable[tuple[bytes, str | None]]]

# content part type -> (modality, key holding the payload)
_MEDIA_PARTS = {"image_url": ("image", "image_url"), "video_url": ("video", "video_url"),
                "audio_url": ("audio", "audio_url"), "input_audio": ("audio", "input_audio")}
_TEXT_PARTS = {"text"}
# request fields that change what an encoder makes of the same bytes
_KWARGS_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")
_MAX_KWARGS_BYTES = 4096


@dataclass
class MediaPart:
    """One distinct media item of a request. `part` is a JSON-ready content part (with uuid)
    that an encoder can be sent as is."""

    item_id: str
    modality: str
    nbytes: int
    part: dict[str, Any]
    kwargs: dict[str, Any] = field(default_factory=dict)  # the request's _KWARGS_FIELDS
    settings: bytes = b""  # their canonical bytes (in the id; equal settings, equal bytes)


@dataclass
class PreparedRequest:
    body: dict[str, Any]
    items: list[MediaPart]
    stream: bool


def _b64(data: str, what: str) -> bytes:
    try:
        return pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise GatewayError(400, f"{what}: malformed base64 data", "bad_base64") from None


def _split_data_url(url: str) -> tuple[str, str]:
    """(mime, base64 payload) of a `data:<mime>;base64,<payload>` URL."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise GatewayError(400, "data URLs must look like data:<mime>;base64,<data>",
                           "bad_data_url")
    return head[5:-7].lower(), payload


# verdicts (limits, modality, content id) whose bytes already passed validation (same bytes,
# same verdict: a repeated image skips the decode check)
_validated: BoundedLRU[str, None] = BoundedLRU(4096)


def _check(modality: str, data: bytes, frames: list[bytes] | None,
           cfg: GatewayConfig) -> None:
    """Decode `data` far enough to reject bad media with a 4xx (media.py)."""
    if modality == "image":
        check_image(data, cfg.limits)
    elif frames is not None:
        check_frames(frames, cfg.limits)
    elif modality == "video":
        check_video(data, cfg.limits)
    else:
        check_audio(data, cfg.limits)


def canonical_settings(kwargs: dict[str, Any]) -> bytes:
    """The canonical bytes of a request's settings (b"" for none)."""
    return json_encode(kwargs, order="sorted") if kwargs else b""


def _settings(body: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """The request's embedding-changing settings, and their canonical bytes for the id."""
    kwargs = {}
    for name in _KWARGS_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise GatewayError(400, f"{name} must be an object", "bad_kwargs")
        if value:
            kwargs[name] = value
    canonical = canonical_settings(kwargs)
    if len(canonical) > _MAX_KWARGS_BYTES:
        raise GatewayError(413, f"{' and '.join(kwargs)} are larger than "
                           f"{_MAX_KWARGS_BYTES} bytes", "kwargs_too_large")
    return kwargs, canonical


async def _load(part: dict[str, Any], kind: str, modality: str, cfg: GatewayConfig,
                fetch: Fetcher) -> tuple[str, bytes, list[bytes] | None]:
    """(mime, bytes, frames) of one part; URL media are fetched and inlined as a data: URL.
    `frames`: a video sent as a list of images (`data:video/jpeg;base64,<f1>,<f2>,...`);
    its bytes are then the frames, each prefixed by its length."""
    limit = cfg.limits.max_media_bytes
    payload = part.get(kind)
    if kind == "input_audio":
        if not isinstance(payload, dict) or not isinstance(payload.get("data"), str):
            raise GatewayError(400, "input_audio needs {data: <base64>, format}", "bad_part")
        if len(payload["data"]) > limit * 4 // 3 + 4:
            raise GatewayError(413, f"media item is larger than {limit} bytes",
                               "media_too_large")
        fmt = payload.get("format")
        return f"audio/{fmt}" if isinstance(fmt, str) else "", _b64(payload["data"],
                                                                    "input_audio"), None
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
        if modality == "video" and mime in ("video/jpeg", "image/jpeg"):
            frames = [_b64(f, f"{kind} frame") for f in b64.split(",")]
            if not all(frames):
                raise GatewayError(400, f"{kind}: an empty frame", "bad_part")
            data = b"".join(len(f).to_bytes(8, "little") + f for f in frames)
            return mime, data, frames
        return mime, _b64(b64, f"{kind} data URL"), None
    data, ctype = await fetch(url)
    mime = (ctype or "").split(";", 1)[0].strip().lower()
    if not mime.startswith(f"{modality}/"):
        mime = {"image": "image/png", "audio": "audio/wav", "video": "video/mp4"}[modality]
    payload["url"] = f"data:{mime};base64," + pybase64.b64encode(data).decode()
    return mime, data, None


def _parts(messages: list[Any]) -> Iterator[dict[str, Any]]:
    """The content parts of `messages`, in order (a string content has none)."""
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
            yield part


def _media_kind(ptype: Any, cfg: GatewayConfig) -> tuple[str, str] | None:
    """(modality, payload key) of a media part type, None for text; 400 for the others."""
    if ptype in _TEXT_PARTS:
        return None
    if ptype not in _MEDIA_PARTS:
        raise GatewayError(400, f"unsupported content part type {ptype!r}", "bad_part")
    modality, kind = _MEDIA_PARTS[ptype]
    if modality not in cfg.media.modalities:
        raise GatewayError(400, f"model {cfg.model!r} does not accept {modality} input here "
                           "(media.modalities)", "modality_disabled")
    return modality, kind


async def _tag(part: dict[str, Any], kind: str, modality: str, cfg: GatewayConfig,
               fetch: Fetcher, namespace: str, signer: IdSigner) -> int:
    """Load and check one media part and give it its content id (`uuid`); its size."""
    mime, data, frames = await _load(part, kind, modality, cfg, fetch)
    if len(data) > cfg.limits.max_media_bytes:
        raise GatewayError(413, f"media item is larger than {cfg.limits.max_media_bytes} "
                           "bytes", "media_too_large")
    if not data:
        raise GatewayError(400, f"{part.get('type')} is empty", "bad_part")
    item_id = signer.sign(content_item_id(data, namespace))
    verdict = f"{hash(cfg.limits)}:{modality}:{item_id}"
    if verdict not in _validated:
        _check(modality, data, frames, cfg)
        _validated[verdict] = None
    part["uuid"] = item_id
    return len(data)


async def prepare_chat(body: Any, cfg: GatewayConfig, fetch: Fetcher,
                       signer: IdSigner | None = None) -> PreparedRequest:
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
    # the gateway decides what decode instances get: a client's transfer params could name
    # any host for a server to dial (a KV connector's side channel, an embedding's producer)
    body.pop("ec_transfer_params", None)
    body.pop("kv_transfer_params", None)
    kwargs, settings = _settings(body)
    namespace = cfg.namespace + ("|" + settings.hex() if settings else "")
    signer = signer or IdSigner(None)  # the gateway's own, made once (Gateway.__init__)
    items: dict[str, MediaPart] = {}
    n_parts = 0
    for part in _parts(messages):
        media = _media_kind(part.get("type"), cfg)
        if media is None:
            continue
        n_parts += 1
        if n_parts > cfg.limits.max_media_items:
            raise GatewayError(400, f"more than {cfg.limits.max_media_items} media items",
                               "too_many_items")
        modality, kind = media
        nbytes = await _tag(part, kind, modality, cfg, fetch, namespace, signer)
        if part["uuid"] not in items:
            items[part["uuid"]] = MediaPart(part["uuid"], modality, nbytes, part, kwargs,
                                            settings)
    return PreparedRequest(body=body, items=list(items.values()),
                           stream=body.get("stream") is True)


def metadata_only_body(body: dict[str, Any], metadata: dict[str, dict[str, Any]]
                       ) -> tuple[dict[str, Any], int]:
    """A copy of a prepared `body` whose media parts with known placeholder metadata are
    metadata-only (`{"type": "image_embeds", "image_embeds": {...}, "uuid": id}`: vLLM's
    format for an EC consumer, which gets the embedding from the connector), and how many
    parts were replaced. `body` itself is left as it is (the raw-media retry sends it)."""
    out = dict(body)
    messages, replaced = [], 0
    for msg in body["messages"]:
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            messages.append(msg)
            continue
        parts = []
        for part in content:
            meta = metadata.get(part.get("uuid", ""))
            if meta is None or part.get("type") not in _MEDIA_PARTS:
                parts.append(part)
                continue
            kind = f"{_MEDIA_PARTS[part['type']][0]}_embeds"
            parts.append({"type": kind, kind: meta, "uuid": part["uuid"]})
            replaced += 1
        messages.append({**msg, "content": parts})
    out["messages"] = messages
    return out, replaced
