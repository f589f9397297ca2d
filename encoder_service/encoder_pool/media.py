"""Media items at the pool's door: decode with vLLM's own media IO, validate, size-check.

Everything a client sends is checked here, before it takes a queue slot: the encoded size,
the pixel count (read from the header, before decoding, so a decompression bomb never
allocates), and a full decode (a truncated or corrupt file fails here, not in a batch).
The decoding itself is vLLM's (`ImageMediaIO`, `MediaConnector.fetch_video` with the loader
vLLM's front end picks, `AudioMediaIO`): the pool's item is what a vLLM server would hand
its multimodal processor (a video keeps only the frames vLLM keeps, with vLLM's metadata;
audio stays at its own rate: the processor resamples it as vLLM does).
"""

from __future__ import annotations

import binascii
import io
from dataclasses import dataclass, field
from typing import Any

import pybase64
from PIL import Image, UnidentifiedImageError


class BadMedia(ValueError):
    """Media that cannot be used; the message names the item and the reason."""

    def __init__(self, item_id: str, reason: str) -> None:
        super().__init__(f"item {item_id!r}: {reason}")
        self.item_id = item_id
        self.reason = reason


@dataclass(frozen=True)
class MediaItem:
    """A decoded media item.

    `media` is what vLLM's media IO returns: an RGB PIL image; a video (`MediaWithBytes` of
    (frames [T, H, W, 3] uint8, metadata)); audio (samples, rate). `prepared` (vLLM's processed
    tensors), `num_embeds` and `metadata` (placeholder metadata) are set by the encoder's
    `prepare`."""

    item_id: str
    modality: str
    media: Any = None
    prepared: Any = None
    num_embeds: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the image or of the video's frames; (samples, 1) for audio."""
        if self.modality == "audio":
            return len(self.media[0]), 1
        if self.modality == "video":
            frames = self.media[0]
            return int(frames.shape[2]), int(frames.shape[1])
        return self.media.size


def decode_audio(item_id: str, raw: bytes, max_seconds: float = 1800.0) -> MediaItem:
    """Decode audio as vLLM decodes it.

    Audio as vLLM decodes it (`AudioMediaIO`: wav, flac, mp3, ogg...; mono float32 at the
    file's own rate)."""
    from vllm.multimodal.media.audio import AudioMediaIO

    try:
        samples, rate = AudioMediaIO().load_bytes(raw)
    except Exception as exc:  # noqa: BLE001 - decoders report bad bytes as many types
        raise BadMedia(item_id, f"cannot decode audio: {exc}") from None
    if not len(samples) or rate <= 0:
        raise BadMedia(item_id, "audio holds no samples")
    if len(samples) > max_seconds * rate:
        raise BadMedia(item_id, f"audio is longer than {max_seconds} s")
    return MediaItem(item_id, "audio", media=(samples, rate))


def payload_bytes(item_id: str, data: str, max_bytes: int) -> bytes:
    """Bytes of a base64 string or a `data:<mime>;base64,` URL, size-checked."""
    if data.startswith("data:"):
        head, sep, data = data.partition(",")
        if not sep or ";base64" not in head:
            raise BadMedia(item_id, "data URL must be base64 encoded")
    if len(data) > (max_bytes * 4) // 3 + 8:
        raise BadMedia(item_id, f"media is larger than the {max_bytes}-byte limit")
    try:
        raw = pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadMedia(item_id, "media is not valid base64") from None
    if len(raw) > max_bytes:
        raise BadMedia(item_id, f"media is {len(raw)} bytes; the limit is {max_bytes}")
    if not raw:
        raise BadMedia(item_id, "media is empty")
    return raw


def decode_video(item_id: str, data: str, max_bytes: int, max_pixels: int,
                 video_processor: str | None = None,
                 media_io_kwargs: dict[str, dict[str, Any]] | None = None) -> MediaItem:
    """Decode a video data URL as vLLM decodes it.

    A video data URL as vLLM decodes it (`MediaConnector.fetch_video`): a JPEG frame list
    (`data:video/jpeg;base64,<f1>,<f2>,...`, the frames vLLM keeps, each checked for its
    pixel count before decoding) or a container (mp4, webm...: vLLM's loader samples the
    frames); `video_processor`: the model's (it picks vLLM's loader); `media_io_kwargs`:
    vLLM's server-wide --media-io-kwargs (num_frames, fps...), as the servers are given."""
    from vllm.multimodal.media import MediaConnector
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.multimodal.media.video import VideoMediaIO

    head, sep, body = data.partition(",")
    if not sep or not head.startswith("data:") or ";base64" not in head:
        raise BadMedia(item_id, "video must be a base64 data URL: data:video/<type>;base64,...")
    if len(body) > (max_bytes * 4) // 3 + 8:
        raise BadMedia(item_id, f"media is larger than the {max_bytes}-byte limit")
    if head[5:].split(";")[0].lower() == "video/jpeg":
        video_kwargs = (media_io_kwargs or {}).get("video", {})
        keep = VideoMediaIO(ImageMediaIO(), **video_kwargs).num_frames  # the first `keep`
        keep = keep if keep > 0 else None  # -1: every frame
        for part in (body.split(",", keep)[:keep] if keep else body.split(",")):
            _probe_pixels(item_id, payload_bytes(item_id, part, max_bytes), max_pixels)
    try:
        video = MediaConnector(media_io_kwargs=media_io_kwargs).fetch_video(
            data, video_processor=video_processor)
        frames = video.media[0]
    except Exception as exc:  # noqa: BLE001 - decoders report bad bytes as many types
        raise BadMedia(item_id, f"cannot decode video: {exc}") from None
    if frames.ndim != 4 or not len(frames):
        raise BadMedia(item_id, "video holds no frames")
    if frames.shape[1] * frames.shape[2] > max_pixels:
        raise BadMedia(item_id, f"video frames are {frames.shape[2]}x{frames.shape[1]} "
                                f"pixels; the limit is {max_pixels}")
    return MediaItem(item_id, "video", media=video)


def _probe_pixels(item_id: str, raw: bytes, max_pixels: int) -> None:
    """The image's pixel count from its header (nothing decoded), or BadMedia."""
    try:
        with Image.open(io.BytesIO(raw)) as probe:
            width, height = probe.size
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError,
            Image.DecompressionBombError) as exc:
        raise BadMedia(item_id, f"cannot decode image: {exc}") from None
    if width * height > max_pixels:
        raise BadMedia(item_id, f"image is {width}x{height} = {width * height} pixels; "
                                f"the limit is {max_pixels}")


def decode_image(item_id: str, raw: bytes, max_pixels: int) -> MediaItem:
    """Decode an image exactly as vLLM does, refusing bad or oversized ones.

    An RGB image decoded exactly as vLLM decodes it (its `ImageMediaIO`: the same format
    allowlist, EXIF orientation applied, transparency onto white), so the pool's embedding is
    the one vLLM would compute; or BadMedia (corrupt, truncated, too many pixels). The pixel
    count is read from the header first: a decompression bomb never allocates."""
    from vllm.multimodal.media.image import ImageMediaIO

    _probe_pixels(item_id, raw, max_pixels)
    try:
        img = ImageMediaIO(image_mode="RGB").load_bytes(raw).media
    except (ValueError, OSError, SyntaxError, Image.DecompressionBombError) as exc:
        raise BadMedia(item_id, f"cannot decode image: {exc}") from None
    return MediaItem(item_id, "image", media=img)
