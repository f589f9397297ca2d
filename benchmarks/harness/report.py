"""Progress lines and the numbers every report takes: medians, percentiles, milliseconds.

One meaning each: `ms` turns seconds into milliseconds (None stays None); `medians` takes
the median of every number, key by key, over rows of one shape (a key missing or not a
number in a row is left out of that key's median); `say` prints one progress line tagged
with the running benchmark's module name.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Iterable, Mapping
from typing import Any

MiB = 1 << 20


def say(msg: str) -> None:
    """One progress line, `[<benchmark>] msg`, flushed (runs are long and often piped)."""
    print(f"[{_tag()}] {msg}", flush=True)


def _tag() -> str:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", "") or ""
    return name.rpartition(".")[2] or "bench"


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def medians(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Per key, the median of its numbers over `rows` (bools, None and other values are
    left out); keys in sorted order."""
    rows = list(rows)
    keys = sorted({k for r in rows for k, v in r.items() if _number(v)})
    return {k: statistics.median(r[k] for r in rows if _number(r.get(k))) for k in keys}


def percentile(values: list[float], q: float) -> float | None:
    """numpy's q-th percentile of `values`; None for none."""
    if not values:
        return None
    import numpy as np

    return float(np.percentile(values, q))
