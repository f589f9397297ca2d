"""Media checks at the gateway, before any upstream call.

Media checks at the gateway: every item is decoded far enough to know it is what it claims
and within the limits, before any upstream call (bad media is a 4xx here, never a 500 on an
encoder or a decode instance).

image: PIL (header, pixel count, `verify()`). video: a frame list (`data:video/jpeg;base64,
<f1>,<f2>,...`, vLLM's format) checks every frame as an image; a container (mp4, webm, ...)
is opened with OpenCV, vLLM's default video decoder, for its frame count, size and duration.
audio: libsndfile (`soundfile`: wav, flac, mp3, ogg) for its duration.
"""

from __future__ import annotations

import io
import os
import tempfile
import warnings
from typing import Any

from PIL import Image

from encoder_service.gateway.config import LimitsConfig
from encoder_service.gateway.wire import GatewayError


def check_image(data: bytes, limits: LimitsConfig, what: str = "image") -> None:
    """Raise 400 unless `data` is a decodable image within the pixel limit."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                w, h = img.size
                if w * h > limits.max_image_pixels:
                    raise GatewayError(413, f"{what} is {w}x{h} pixels; the limit is "
                                       f"{limits.max_image_pixels}", "image_too_large")
                img.verify()
    except GatewayError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise GatewayError(413, f"{what} has too many pixels", "image_too_large") from None
    except Exception:  # noqa: BLE001 - PIL raises many types for bad bytes
        raise GatewayError(400, f"{what} is not a decodable image (PNG, JPEG, WebP, GIF, ...)",
                           "not_an_image") from None


def check_frames(frames: list[bytes], limits: LimitsConfig) -> None:
    """A video sent as a list of images (vLLM's `video/jpeg` data URL)."""
    if len(frames) > limits.max_video_frames:
        raise GatewayError(413, f"video has {len(frames)} frames; the limit is "
                           f"{limits.max_video_frames}", "video_too_long")
    for i, frame in enumerate(frames):
        check_image(frame, limits, what=f"video frame {i}")


def _video_props(data: bytes) -> tuple[int, int, int, float] | None:
    """Probe a video container's frame count, size and frame rate.

    (frames, width, height, fps) of a video container, or None when OpenCV cannot open
    it. OpenCV reads files only: the bytes go to a private temp file for the probe."""
    import cv2  # vLLM's default video decoder; installed with vLLM

    fd, path = tempfile.mkstemp(prefix="epd-video-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        cap = cv2.VideoCapture(path)
        try:
            if not cap.isOpened():
                return None
            ok, _ = cap.read()  # a header alone is not a video: one frame must decode
            if not ok:
                return None
            return (int(cap.get(cv2.CAP_PROP_FRAME_COUNT)),
                    int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)),
                    int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)), float(cap.get(cv2.CAP_PROP_FPS)))
        finally:
            cap.release()
    finally:
        os.unlink(path)


def check_video(data: bytes, limits: LimitsConfig) -> None:
    """A video container: decodable, within the frame, pixel and duration limits."""
    try:
        props = _video_props(data)
    except ImportError:
        raise GatewayError(415, "this gateway cannot check video containers (OpenCV is not "
                           "installed); send frames as data:video/jpeg;base64,<f1>,<f2>,...",
                           "video_unsupported") from None
    if props is None:
        raise GatewayError(400, "video_url does not hold a decodable video (mp4, webm, ...)",
                           "not_a_video")
    frames, w, h, fps = props
    if frames > limits.max_video_frames:
        raise GatewayError(413, f"video has {frames} frames; the limit is "
                           f"{limits.max_video_frames}", "video_too_long")
    if w * h > limits.max_image_pixels:
        raise GatewayError(413, f"video frames are {w}x{h} pixels; the limit is "
                           f"{limits.max_image_pixels}", "image_too_large")
    if fps > 0 and frames / fps > limits.max_video_seconds:
        raise GatewayError(413, f"video lasts {frames / fps:.1f} s; the limit is "
                           f"{limits.max_video_seconds} s", "video_too_long")


def check_audio(data: bytes, limits: LimitsConfig) -> None:
    """Audio libsndfile decodes (wav, flac, mp3, ogg), within the duration limit."""
    import soundfile

    try:
        info: Any = soundfile.info(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - libsndfile reports bad bytes as several types
        raise GatewayError(400, "audio is not decodable (wav, flac, mp3 or ogg)",
                           "not_audio") from None
    if info.samplerate <= 0 or info.frames <= 0:
        raise GatewayError(400, "audio holds no samples", "not_audio")
    seconds = info.frames / info.samplerate
    if seconds > limits.max_audio_seconds:
        raise GatewayError(413, f"audio lasts {seconds:.1f} s; the limit is "
                           f"{limits.max_audio_seconds} s", "audio_too_long")
