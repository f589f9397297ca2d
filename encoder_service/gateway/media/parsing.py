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

import asyncio
import binascii
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pybase64

from ec_connectors.protocol.http_api import comma_pieces
from ec_connectors.protocol.item_ids import IdSigner
from ec_connectors.protocol.keys import content_item_id
from encoder_service.gateway.config import MediaRules
from encoder_service.gateway.media.checks import check_audio, check_frames, check_image, check_video
from encoder_service.gateway.wire import GatewayError, json_encode, served_body
from epd_common.lru import BoundedLRU

Fetcher = Callable[[str], Awaitable[tuple[bytes, str | None]]]

# content part type -> (modality, key holding the payload)
_MEDIA_PARTS = {"image_url": ("image", "image_url"), "video_url": ("video", "video_url"),
                "audio_url": ("audio", "audio_url"), "input_audio": ("audio", "input_audio")}
_TEXT_PARTS = {"text"}
# request fields that change what an encoder makes of the same bytes
_KWARGS_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")
_MAX_KWARGS_BYTES = 4096
_OFFLOAD_FROM = 1 << 20  # inline media from this length on are decoded off the event loop
# ... on one thread: hashlib and pybase64 let go of the GIL, so a thread per clip would take
# every core at once from the servers beside the gateway (docs/benchmarks.md, the code's
# figures)
_MEDIA_THREAD = ThreadPoolExecutor(1, thread_name_prefix="epd-media")


@dataclass
class MediaPart:
    """One distinct media item of a request.

    `part` is a JSON-ready content part (with uuid) that an encoder can be sent as is."""

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


# verdicts (limits, modality, content id) whose bytes already passed validation (same bytes,
# same verdict: a repeated image skips the decode check)
_validated: BoundedLRU[str, None] = BoundedLRU(4096)


def _check(modality: str, data: bytes, frames: list[bytes] | None,
           rules: MediaRules) -> None:
    """Decode `data` far enough to reject bad media with a 4xx (media.py)."""
    if modality == "image":
        check_image(data, rules.limits)
    elif frames is not None:
        check_frames(frames, rules.limits)
    elif modality == "video":
        check_video(data, rules.limits)
    else:
        check_audio(data, rules.limits)


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


def _frames(url: str, start: int, kind: str) -> list[bytes]:
    """Decode the frames of a JPEG frame-list video URL.

    The frames of a `data:video/jpeg;base64,<f1>,<f2>,...` URL, its payload from `start`:
    one ASCII copy of the URL, each frame decoded from a view of it (a 120-frame clip is a
    25 MB string: splitting it copied it once more, frame by frame)."""
    try:
        buf = url.encode("ascii")
    except UnicodeEncodeError:  # not base64 (a str, so only ASCII could be)
        raise GatewayError(400, f"{kind} frame: malformed base64 data", "bad_base64") from None
    frames = [_b64(piece, f"{kind} frame") for piece in comma_pieces(buf, start)]
    if not all(frames):
        raise GatewayError(400, f"{kind}: an empty frame", "bad_part")
    return frames


def _framed(frames: list[bytes]) -> list[bytes]:
    """A frame list's bytes as the content id covers them: each frame after its length."""
    return [chunk for f in frames for chunk in (len(f).to_bytes(8, "little"), f)]


async def _fetch(part: dict[str, Any], kind: str, modality: str, fetch: Fetcher
                 ) -> bytes | None:
    """Fetch the bytes of a part whose media is a URL.

    The bytes of a part whose media is a URL to fetch (inlined as a data: URL, so no
    server fetches it); None for every other part (its media are in the request)."""
    payload = part.get(kind)
    if kind == "input_audio":
        return None
    if isinstance(payload, str):  # the short form {"image_url": "<url>"}
        payload = {"url": payload}
        part[kind] = payload
    url = payload.get("url") if isinstance(payload, dict) else None
    if not isinstance(url, str) or not url or url.startswith("data:"):
        return None
    data, ctype = await fetch(url)
    mime = (ctype or "").split(";", 1)[0].strip().lower()
    if not mime.startswith(f"{modality}/"):
        mime = {"image": "image/png", "audio": "audio/wav", "video": "video/mp4"}[modality]
    payload["url"] = f"data:{mime};base64," + pybase64.b64encode(data).decode()
    return data


def _inline_size(part: dict[str, Any], kind: str) -> int:
    """The length of a part's inline media (its data URL or base64 string)."""
    payload = part.get(kind)
    value = payload.get("data" if kind == "input_audio" else "url") \
        if isinstance(payload, dict) else payload
    return len(value) if isinstance(value, str) else 0


def _load(part: dict[str, Any], kind: str, modality: str, rules: MediaRules,
          fetched: bytes | None) -> tuple[list[bytes], list[bytes] | None]:
    """Load one part's media bytes and, for a frame-list video, its frames.

    (chunks, frames) of one part: its media bytes (`b"".join(chunks)`, never made) and,
    for a video sent as a list of images (`data:video/jpeg;base64,<f1>,<f2>,...`), the
    frames; its bytes are then the frames, each prefixed by its length (`_framed`)."""
    limit = rules.limits.max_media_bytes
    if fetched is not None:
        return [fetched], None
    payload = part.get(kind)
    if kind == "input_audio":
        if not isinstance(payload, dict) or not isinstance(payload.get("data"), str):
            raise GatewayError(400, "input_audio needs {data: <base64>, format}", "bad_part")
        if len(payload["data"]) > limit * 4 // 3 + 4:
            raise GatewayError(413, f"media item is larger than {limit} bytes",
                               "media_too_large")
        return [_b64(payload["data"], "input_audio")], None
    url = payload.get("url") if isinstance(payload, dict) else None
    if not isinstance(url, str) or not url:
        raise GatewayError(400, f"{kind} needs a url", "bad_part")
    comma = url.find(",")
    head = url[:comma] if comma >= 0 else url
    if comma < 0 or not head.startswith("data:") or not head.endswith(";base64"):
        raise GatewayError(400, "data URLs must look like data:<mime>;base64,<data>",
                           "bad_data_url")
    if len(url) - comma - 1 > limit * 4 // 3 + 4:
        raise GatewayError(413, f"media item is larger than {limit} bytes", "media_too_large")
    if modality == "video" and head[5:-7].lower() in ("video/jpeg", "image/jpeg"):
        frames = _frames(url, comma + 1, kind)
        return _framed(frames), frames
    return [_b64(url[comma + 1:], f"{kind} data URL")], None


def _identify(part: dict[str, Any], kind: str, modality: str, rules: MediaRules,
              fetched: bytes | None, namespace: str, signer: IdSigner
              ) -> tuple[str, int, str | None]:
    """Decode one part's media, give it its content id and check it.

    Decode one part's media, give it its content id and check what is new: (id, size,
    the verdict to remember, None when it was known). Touches no state but `part`, so it
    may run off the event loop."""
    chunks, frames = _load(part, kind, modality, rules, fetched)
    size = sum(map(len, chunks))
    if size > rules.limits.max_media_bytes:
        raise GatewayError(413, f"media item is larger than {rules.limits.max_media_bytes} "
                           "bytes", "media_too_large")
    if not size:
        raise GatewayError(400, f"{part.get('type')} is empty", "bad_part")
    item_id = signer.sign(content_item_id(chunks, namespace))
    verdict: str | None = f"{hash(rules.limits)}:{modality}:{item_id}"
    if verdict in _validated:
        verdict = None
    else:
        _check(modality, chunks[0] if frames is None else b"", frames, rules)
    return item_id, size, verdict


async def _tag(part: dict[str, Any], kind: str, modality: str, rules: MediaRules,
               fetch: Fetcher, namespace: str, signer: IdSigner) -> int:
    """Load and check one media part and give it its content id (`uuid`); its size.

    Large media (a clip's frames) are decoded, hashed and checked on the media thread: the event
    loop serves other requests meanwhile."""
    fetched = await _fetch(part, kind, modality, fetch)
    args = (part, kind, modality, rules, fetched, namespace, signer)
    if fetched is None and _inline_size(part, kind) >= _OFFLOAD_FROM:
        item_id, size, verdict = await asyncio.get_running_loop().run_in_executor(
            _MEDIA_THREAD, _identify, *args)
    else:
        item_id, size, verdict = _identify(*args)
    if verdict is not None:
        _validated[verdict] = None  # here, on the loop: BoundedLRU is not thread-safe
    part["uuid"] = item_id
    return size


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


def _media_kind(ptype: Any, rules: MediaRules) -> tuple[str, str] | None:
    """(modality, payload key) of a media part type, None for text; 400 for the others."""
    if ptype in _TEXT_PARTS:
        return None
    if ptype not in _MEDIA_PARTS:
        raise GatewayError(400, f"unsupported content part type {ptype!r}", "bad_part")
    modality, kind = _MEDIA_PARTS[ptype]
    if modality not in rules.media.modalities:
        raise GatewayError(400, f"model {rules.model!r} does not accept {modality} input here "
                           "(media.modalities)", "modality_disabled")
    return modality, kind


async def prepare_chat(body: Any, rules: MediaRules, fetch: Fetcher,
                       signer: IdSigner | None = None) -> PreparedRequest:
    """Validate `body` (a parsed chat completion request) and tag its media; see module doc."""
    body = served_body(body, rules.model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages must be a non-empty list")
    # the gateway decides what decode instances get: a client's transfer params could name
    # any host for a server to dial (a KV connector's side channel, an embedding's producer)
    body.pop("ec_transfer_params", None)
    body.pop("kv_transfer_params", None)
    kwargs, settings = _settings(body)
    namespace = rules.namespace + ("|" + settings.hex() if settings else "")
    signer = signer or IdSigner(None)  # the gateway's own, made once (Gateway.__init__)
    items: dict[str, MediaPart] = {}
    n_parts = 0
    for part in _parts(messages):
        media = _media_kind(part.get("type"), rules)
        if media is None:
            continue
        n_parts += 1
        if n_parts > rules.limits.max_media_items:
            raise GatewayError(400, f"more than {rules.limits.max_media_items} media items",
                               "too_many_items")
        modality, kind = media
        nbytes = await _tag(part, kind, modality, rules, fetch, namespace, signer)
        if part["uuid"] not in items:
            items[part["uuid"]] = MediaPart(part["uuid"], modality, nbytes, part, kwargs,
                                            settings)
    return PreparedRequest(body=body, items=list(items.values()),
                           stream=body.get("stream") is True)


def metadata_only_body(body: dict[str, Any], metadata: dict[str, dict[str, Any]]
                       ) -> tuple[dict[str, Any], int]:
    """Copy a request body with metadata-only parts where the metadata is known.

    A copy of a prepared `body` whose media parts with known placeholder metadata are
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
