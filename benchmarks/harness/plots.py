"""Grouped bar charts: one panel per figure, groups (cases) on the x axis, a bar per series
(deployment). matplotlib is optional (`pip install ".[bench]"`): without it no chart is
written and the run goes on."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

# a panel: (the figure's key in a row, its title, the factor its values are shown at)
Panel = tuple[str, str, float]


def grouped_bars(table: dict[str, dict[str, dict]], groups: Sequence[str],
                 series: Sequence[str], panels: Sequence[Panel], path: Path,
                 columns: int = 3) -> bool:
    """`table[group][series][key]` as bars (a value missing: no bar) into `path` (PNG);
    False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"no chart written to {path}: matplotlib is not installed", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 + 1.6 * len(groups), 4 * rows),
                             squeeze=False)
    width = 0.8 / max(1, len(series))
    for ax, (key, label, scale) in zip(axes.flat, panels, strict=False):
        for i, name in enumerate(series):
            vals = [(table[g].get(name) or {}).get(key) for g in groups]
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))]
            ax.bar(xs, [0 if v is None else v * scale for v in vals], width, label=name)
        ax.set_title(label, fontsize=9)
        ax.set_xticks(range(len(groups)), groups, rotation=30, fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
