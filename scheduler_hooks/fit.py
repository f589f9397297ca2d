"""Does a stored item fit the metadata-only part that names it?

A metadata-only part (`{"type": "image_embeds", "image_embeds": {"image_grid_thw": ...},
"uuid": id}`) names a stored embedding by its id and says what it is: a modality and its
placeholder metadata (a grid, an audio length), from which vLLM makes the placeholders and
counts the embeddings they take. Any client can write one, with any grid. A stored item that
is not what the part says (fewer or more rows, another modality, another grid) must never
reach vLLM: placed, or served from vLLM's encoder cache, it kills the engine (a row count
that does not match the placeholders) or answers nonsense. The request fails instead, with
the reason (`embedding_mismatch`, a 400: the request is wrong, not the server).

What the consumer knows of the stored item before vLLM schedules the request (`Known`): its
row count (its producer's entry in the request's `ec_transfer_params`, a copy staged here,
the entry in vLLM's encoder cache) and the placeholder metadata its producer published (the
entry's `metadata`, when the request carries it). `misfit` compares that with what the part
asks (`Asked`). A stored item carries neither its modality nor its grid, so without the
producer's metadata only the row count can be checked: a part with another grid or modality
but the same number of rows goes through.

Pure logic over plain values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MISMATCH = "embedding mismatch"  # the start of a reason about the metadata
TOKEN_COUNT = "token count"  # the start of a reason about the row count (also `decide`'s)
_SHOWN = 160  # characters of metadata a reason shows


@dataclass(frozen=True, slots=True)
class Asked:
    """What a request's part asks of the stored item.

    What a request's part asks of the item: its modality, the rows its placeholders take
    and its placeholder metadata (vLLM's `embedding_fields` of the modality, as lists)."""

    modality: str
    rows: int
    metadata: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Known:
    """What is known of the stored item.

    What is known of the stored item: its rows (0: not known), where that was read, and
    the placeholder metadata its producer published (None: not known)."""

    rows: int = 0
    rows_from: str = ""
    metadata: Mapping[str, Any] | None = None


def is_mismatch(why: str) -> bool:
    """Whether a reason says the item does not fit the request (not that it is missing)."""
    return why.startswith((MISMATCH, TOKEN_COUNT))


def misfit(asked: Asked, known: Known) -> str:
    """"" when the item fits the part as far as is known, else the reason it does not."""
    if known.metadata is not None and not same_metadata(known.metadata, asked.metadata):
        return (f"{MISMATCH}: its producer published it as {show(known.metadata)}; the "
                f"{asked.modality} part asks for {show(asked.metadata)}")
    if known.rows and known.rows != asked.rows:
        where = f" ({known.rows_from})" if known.rows_from else ""
        return (f"{TOKEN_COUNT}: the item holds {known.rows} embeddings{where}, the "
                f"{asked.modality} part ({show(asked.metadata)}) takes {asked.rows}")
    return ""


def same_metadata(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Compare two sets of placeholder metadata, tolerating JSON and float32 round trips.

    Same fields, same values (a number and a one-element list of it are alike; floats
    within a relative 1e-6: they crossed JSON and float32 tensors)."""
    if set(a) != set(b):
        return False
    for key, value in a.items():
        x, y = _flat(value), _flat(b[key])
        if len(x) != len(y) or not all(_same(u, v) for u, v in zip(x, y, strict=True)):
            return False
    return True


def show(metadata: Mapping[str, Any]) -> str:
    """`image_grid_thw [1, 8, 8]`, short enough for a log line and an HTTP answer."""
    text = ", ".join(f"{k} {v}" for k, v in sorted(metadata.items())) or "no metadata"
    return text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "..."


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [w for v in value for w in _flat(v)]
    return [value]


def _same(u: Any, v: Any) -> bool:
    if isinstance(u, bool) or isinstance(v, bool) or not (
            isinstance(u, (int, float)) and isinstance(v, (int, float))):
        return u == v
    return u == v or math.isclose(u, v, rel_tol=1e-6)
