"""Acceptance plots show the rounds behind each position and do not draw thin positions as data."""

import numpy as np

from dspark_jax.acceptance_report import MIN_PLOT_ROUNDS, acceptance_bars, fmt_counts


def test_positions_on_few_rounds_are_hollow_and_every_bar_carries_its_count():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    counts = [200, 31, MIN_PLOT_ROUNDS - 1, 1]
    acceptance_bars(ax, np.arange(1, 5), [0.6, 0.4, 0.5, 1.0], counts, 0.8, "draft", "C0")
    filled = [p for p in ax.patches if p.get_fill()]
    hollow = [p for p in ax.patches if not p.get_fill()]
    assert len(filled) == 2 and len(hollow) == 2 and all(p.get_hatch() == "//" for p in hollow)
    assert [t.get_text() for t in ax.texts] == [f"n={n}" for n in counts]
    plt.close(fig)


def test_counts_line_up_with_the_acceptance_columns():
    assert fmt_counts([200, 3], 3) == "  200     3   -  "
