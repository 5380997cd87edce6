"""Reporting per-position conditional acceptance: table cells (`fmt_acc`, `fmt_counts`) and bars that
show the rounds behind each position (`acceptance_bars`).

Shared by `dspark demo` and `dspark bench acceptance`.
"""

from __future__ import annotations

import numpy as np

# A position measured on fewer rounds than this is drawn hollow and labelled with its count, not as data.
MIN_PLOT_ROUNDS = 30


def fmt_counts(counts, width: int = 7) -> str:
    """The rounds behind each acc@k (columns aligned with `fmt_acc`)."""
    return " ".join(f"{int(counts[k]):5d}" if k < len(counts) else "  -  " for k in range(width))


def acceptance_bars(ax, xs, acc, counts, width: float, label: str, color: str) -> None:
    """Bars of per-position acceptance with the rounds behind each written above it; a position seen
    on fewer than MIN_PLOT_ROUNDS rounds is drawn as an empty hatched outline (too few to read)."""
    acc = np.asarray([np.nan if a is None else a for a in acc], float)
    counts = np.asarray(counts, int)
    solid = counts >= MIN_PLOT_ROUNDS
    # The label goes on the solid bars, or on the outlines when there are none (an empty bar set's legend
    # entry would show matplotlib's default colour, not this series').
    ax.bar(xs[solid], acc[solid], width, label=label if solid.any() else None, color=color)
    if (~solid).any():
        ax.bar(xs[~solid], np.nan_to_num(acc[~solid]), width, fill=False, hatch="//", edgecolor=color,
               label=None if solid.any() else label)
    for x, a, n in zip(xs, acc, counts):
        ax.text(x, (0 if np.isnan(a) else a) + 0.01, f"n={n}", ha="center", va="bottom", fontsize=6, rotation=90)


def fmt_acc(acc, width: int = 7) -> str:
    cells = []
    for k in range(width):
        a = acc[k] if k < len(acc) else None
        cells.append("  -  " if a is None or (isinstance(a, float) and np.isnan(a)) else f"{a:.3f}")
    return " ".join(cells)
