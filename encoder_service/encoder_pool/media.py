"""Media items at the pool's door: decode (images with vLLM's own media IO), validate,
size-check.

Everything a client sends is checked here, before it takes a queue slot: the encoded size,
the pixel count (read from the header, before decoding, so a decompression bomb never
allocates), and a full decode (a truncated or corrupt file fails here, not in a batch).
"""

from __future__ import annotations

import binascii
import io
from dataclasses import dataclass

import numpy as np
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
    """A decoded media item. Images: `image` (RGB). Videos: `frames` (RGB, in order).
    Audio: `audio` (mono float32 samples in [-1, 1]) at `sample_rate`."""

    item_id: str
    modality: str
    image: Image.Image | None = None
    frames: tuple[Image.Image, ...] = ()
    audio: np.ndarray | None = None
    sample_rate: int = 0

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the image or of the first frame; (samples, 1) for audio."""
        if self.audio is not None:
            return len(self.audio), 1
        img = self.image if self.image is not None else self.frames[0]
        return img.size


AUDIO_RATE = 16000  # what Whisper-style feature extractors take; others are refused


def decode_audio(item_id: str, raw: bytes, max_seconds: float = 1800.0) -> MediaItem:
    """Audio libsndfile decodes (wav, flac, mp3, ogg), mixed down to mono, at 16 kHz.
    Other rates are refused (resampling libraries differ: the embedding would not be the one
    vLLM computes); a vLLM encoder takes those."""
    import soundfile

    try:
        samples, rate = soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True)
    except Exception as exc:  # noqa: BLE001 - libsndfile reports bad bytes as several types
        raise BadMedia(item_id, f"cannot decode audio: {exc}") from None
    if rate != AUDIO_RATE:
        raise BadMedia(item_id, f"audio is {rate} Hz; the pool takes {AUDIO_RATE} Hz only")
    if not len(samples):
        raise BadMedia(item_id, "audio holds no samples")
    if len(samples) > max_seconds * rate:
        raise BadMedia(item_id, f"audio is longer than {max_seconds} s")
    return MediaItem(item_id, "audio", audio=np.ascontiguousarray(samples.mean(axis=1)),
                     sample_rate=rate)


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


MAX_FRAMES = 1024


def decode_frames(item_id: str, data: str, max_bytes: int, max_pixels: int) -> MediaItem:
    """A video sent as vLLM's frame list, `data:video/jpeg;base64,<f1>,<f2>,...`: every
    frame fully decoded (RGB), or BadMedia. Containers (mp4...) are not decoded here."""
    head, sep, body = data.partition(",")
    if not sep or not head.startswith("data:") or head[5:].split(";")[0] not in (
            "video/jpeg", "image/jpeg"):
        raise BadMedia(item_id, "video must be a frame list: data:video/jpeg;base64,<f1>,<f2>,"
                                "... (the pool does not decode video containers)")
    if len(body) > (max_bytes * 4) // 3 + 8:
        raise BadMedia(item_id, f"media is larger than the {max_bytes}-byte limit")
    parts = body.split(",")
    if len(parts) > MAX_FRAMES:
        raise BadMedia(item_id, f"video has {len(parts)} frames; the limit is {MAX_FRAMES}")
    frames = tuple(decode_image(item_id, payload_bytes(item_id, p, max_bytes), max_pixels).image
                   for p in parts)
    if len({f.size for f in frames}) != 1:
        raise BadMedia(item_id, "video frames differ in size")
    return MediaItem(item_id, "video", frames=frames)


def decode_image(item_id: str, raw: bytes, max_pixels: int) -> MediaItem:
    """An RGB image decoded exactly as vLLM decodes it (its `ImageMediaIO`: the same format
    allowlist, EXIF orientation applied, transparency onto white), so the pool's embedding is
    the one vLLM would compute; or BadMedia (corrupt, truncated, too many pixels). The pixel
    count is read from the header first: a decompression bomb never allocates."""
    from vllm.multimodal.media.image import ImageMediaIO

    try:
        with Image.open(io.BytesIO(raw)) as probe:
            width, height = probe.size
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError,
            Image.DecompressionBombError) as exc:
        raise BadMedia(item_id, f"cannot decode image: {exc}") from None
    if width * height > max_pixels:
        raise BadMedia(item_id, f"image is {width}x{height} = {width * height} pixels; "
                                f"the limit is {max_pixels}")
    try:
        img = ImageMediaIO(image_mode="RGB").load_bytes(raw).media
    except (ValueError, OSError, SyntaxError, Image.DecompressionBombError) as exc:
        raise BadMedia(item_id, f"cannot decode image: {exc}") from None
    return MediaItem(item_id, "image", image=img)
