"""A model's fingerprint, so models sharing a served name never mix items.

A model's fingerprint: which weights and config made an embedding, so two models that
share a served name (and a storage directory, store or producer) never mix their items.

Cheap by design (it runs at every server start): the config files whole, and for each weight
file its name, size, safetensors header and a few fixed slices of its bytes. A fine-tune or a
retrained checkpoint changes them; renaming or copying the directory does not (content only,
no paths or times), so every instance serving the same weights agrees.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

_CONFIG_FILES = ("config.json", "preprocessor_config.json", "processor_config.json",
                 "video_preprocessor_config.json", "generation_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SLICES = 16  # fixed sample points per weight file
_SLICE_BYTES = 64 << 10
_MAX_HEADER = 100 << 20


def _sample(path: Path, h: hashlib._Hash) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            (hlen,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(min(hlen, _MAX_HEADER)))  # names, dtypes, shapes, offsets
        for i in range(_SLICES):
            f.seek(max(0, (size - _SLICE_BYTES) * i // max(1, _SLICES - 1)))
            h.update(f.read(_SLICE_BYTES))


def model_fingerprint(model: str | os.PathLike, extra: str = "") -> str:
    """16 hex digits naming the weights and config at `model` (a directory).

    Anything else (a hub id vLLM resolved elsewhere) is named by `model` and `extra` (e.g. its
    config JSON)."""
    h = hashlib.sha256()
    path = Path(model)
    if path.is_dir():
        for name in _CONFIG_FILES:
            if (path / name).is_file():
                h.update(name.encode() + b"\0" + (path / name).read_bytes())
        for weights in sorted(p for p in path.iterdir()
                              if p.suffix in _WEIGHT_SUFFIXES and p.is_file()):
            _sample(weights, h)
    else:
        h.update(str(model).encode() + b"\0" + extra.encode())
    return h.hexdigest()[:16]
