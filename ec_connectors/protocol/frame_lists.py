"""A video sent as vLLM's list of frames: `data:video/jpeg;base64,<f1>,<f2>,...`, each frame
base64, the frames joined by commas. The gateway decodes the frames (its content id covers
them); the server guard checks that a payload is one, to leave it out of its parse."""

from __future__ import annotations

from collections.abc import Iterator


def comma_pieces(buf: bytes, start: int = 0, end: int | None = None) -> Iterator[memoryview]:
    """The comma-separated pieces of `buf[start:end]`, as views of it (a 120-frame clip is
    25 MB: no piece is copied)."""
    end = len(buf) if end is None else end
    view = memoryview(buf)
    while (comma := buf.find(b",", start, end)) >= 0:
        yield view[start:comma]
        start = comma + 1
    yield view[start:end]
