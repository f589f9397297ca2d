"""Text-only fallback: the chat request a gateway sends when some media cannot be encoded."""

from __future__ import annotations

import copy
from collections.abc import Collection
from typing import Any

MEDIA_PARTS = ("image_url", "image", "video_url", "input_audio", "audio_url", "image_embeds")
NOTE = "[{n} attachment(s) could not be processed and were omitted]"


def text_only_body(body: dict[str, Any], failed_ids: Collection[str] | None = None
                   ) -> dict[str, Any]:
    """A copy of an OpenAI-style chat body without the media parts whose `uuid` is in
    `failed_ids` (all media parts when None), with a short note where they were, and
    without `ec_transfer_params` entries of dropped items. The input is not modified."""
    out = copy.deepcopy(body)
    dropped: set[str] = set()
    total = 0
    for msg in out.get("messages", []):
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        kept, n = [], 0
        for part in content:
            is_media = isinstance(part, dict) and part.get("type") in MEDIA_PARTS
            if is_media and (failed_ids is None or part.get("uuid") in failed_ids):
                n += 1
                if part.get("uuid") is not None:
                    dropped.add(part["uuid"])
                continue
            kept.append(part)
        if n:
            kept.append({"type": "text", "text": NOTE.format(n=n)})
            total += n
        msg["content"] = kept
    items = out.get("ec_transfer_params", {}).get("epd", {}).get("items")
    if isinstance(items, dict):
        for item_id in dropped:
            items.pop(item_id, None)
    elif isinstance(items, list):
        items[:] = [i for i in items if i not in dropped]
    return out
