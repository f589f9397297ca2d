"""Requests for the local stack, tests and benchmarks: sample images, data URLs, chat bodies."""

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


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat_body(model: str, image: bytes, prompt: str, *, item_id: str | None = None,
              max_tokens: int = 8, ec_transfer_params: dict | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": data_url(image)}}
    if item_id is not None:
        part["uuid"] = item_id
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": prompt}]}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    if ec_transfer_params is not None:
        body["ec_transfer_params"] = ec_transfer_params
    return body
