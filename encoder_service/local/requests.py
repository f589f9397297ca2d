"""Sample media and request bodies for the local stack, tests and benchmarks.

Requests for the local stack, tests and benchmarks: sample images, video frames and audio,
data URLs, OpenAI content parts, chat bodies."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
from PIL import Image


def sample_image_png(seed: int, size: int = 112) -> bytes:
    """A deterministic, non-trivial PNG image."""
    rng = np.random.default_rng(seed)
    pixels = (rng.random((size, size, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _frame_arrays(seed: int, n: int, width: int, height: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.random((height, width, 3)) * 255
    return [np.roll(base, 4 * i, axis=1).astype("uint8") for i in range(n)]


def sample_frames(seed: int, n: int = 4, size: int = 112, width: int | None = None,
                  height: int | None = None) -> list[bytes]:
    """`n` deterministic JPEG frames (a short video), `size` square or `width` x `height`."""
    frames = []
    for arr in _frame_arrays(seed, n, width or size, height or size):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG")
        frames.append(buf.getvalue())
    return frames


def sample_mp4(seed: int, n: int = 4, width: int = 112, height: int = 112,
               fps: float = 2.0) -> bytes:
    """The frames of `sample_frames` as an mp4 container (opencv's mp4v) at `fps`."""
    return mp4_bytes(_frame_arrays(seed, n, width, height), fps)


def mp4_bytes(frames: list[np.ndarray], fps: float) -> bytes:
    """RGB `frames` (all one size) as an mp4 file (opencv's mp4v)."""
    import os
    import tempfile

    import cv2

    height, width = frames[0].shape[:2]
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        out = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        for arr in frames:
            out.write(cv2.cvtColor(arr, cv2.COLOR_RGB2BGR))
        out.release()
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def sample_wav(seed: int, seconds: float = 2.0, rate: int = 16000) -> bytes:
    """A deterministic mono 16-bit WAV: a tone plus noise."""
    return sample_audio(seed, seconds, rate)


AUDIO_SUBTYPES = {"WAV": "PCM_16", "FLAC": "PCM_16", "OGG": "VORBIS", "MP3": "MPEG_LAYER_III"}


def sample_audio(seed: int, seconds: float = 2.0, rate: int = 16000, channels: int = 1,
                 fmt: str = "WAV") -> bytes:
    """Make a deterministic audio clip in a given format.

    A deterministic tone plus noise at `rate` Hz, `channels` channels, as `fmt` (WAV, FLAC,
    OGG or MP3: what libsndfile writes)."""
    import soundfile

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * (200 + 30 * seed) * t)
    wave = tone[:, None] + 0.05 * rng.standard_normal((t.size, channels))
    buf = io.BytesIO()
    soundfile.write(buf, wave.astype("float32") if channels > 1 else wave[:, 0].astype(
        "float32"), rate, format=fmt, subtype=AUDIO_SUBTYPES[fmt])
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(image: bytes, mime: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(image, mime)}}


def video_part(frames: list[bytes] | bytes, mime: str = "video/mp4") -> dict[str, Any]:
    """A video content part, as a JPEG frame list or a container.

    A video as vLLM's JPEG frame list (`data:video/jpeg;base64,<f1>,<f2>,...`) when
    `frames` is a list, else a container of type `mime`."""
    if isinstance(frames, bytes):
        return {"type": "video_url", "video_url": {"url": data_url(frames, mime)}}
    url = "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)
    return {"type": "video_url", "video_url": {"url": url}}


def audio_part(audio: bytes, fmt: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(audio).decode(), "format": fmt}}


def parts_body(model: str, parts: list[dict[str, Any]], prompt: str, *, max_tokens: int = 8,
               **extra: Any) -> dict[str, Any]:
    """A greedy chat request with media `parts` then `prompt`, returning token ids."""
    return {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True,
            "messages": [{"role": "user",
                          "content": [*parts, {"type": "text", "text": prompt}]}],
            **extra}


def chat_body(model: str, image: bytes, prompt: str, *, item_id: str | None = None,
              max_tokens: int = 8, ec_transfer_params: dict | None = None) -> dict[str, Any]:
    part = image_part(image)
    if item_id is not None:
        part["uuid"] = item_id
    body = parts_body(model, [part], prompt, max_tokens=max_tokens)
    if ec_transfer_params is not None:
        body["ec_transfer_params"] = ec_transfer_params
    return body
