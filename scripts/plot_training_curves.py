#!/usr/bin/env python
"""The default drafts' training curves: tau_estimate per 100 steps, printed as a table and drawn.

    python scripts/plot_training_curves.py [--bundle dspark_jax/assets/default] [--names dspark parallel onetoken]
                                           [--window 100] [--plot curves.png]

Reads <bundle>/logs/draft_<name>_metrics.jsonl (the `dspark train` metrics that scripts/assemble_default.py
copies there; a continued draft's file holds every stage, rows of stage k > 1 marked "stage": k). The training
tau estimate is a noisy per-batch figure, so the table gives its mean over each `window` steps: whether a
curve is still rising at the end is the question the drafts' budget depends on. The plot marks where each
warm restart began.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def window_means(rows: list[dict], key: str, window: int) -> list[tuple[int, float]]:
    """[(last step of the window, mean of `key` over the logged rows in it)], windows (0, w], (w, 2w], ..."""
    by_window: dict[int, list[float]] = {}
    for r in rows:
        if key in r:
            by_window.setdefault((r["step"] - 1) // window, []).append(float(r[key]))
    return [((w + 1) * window, float(np.mean(v))) for w, v in sorted(by_window.items())]


def restart_steps(rows: list[dict]) -> list[int]:
    """The step after which each warm restart began: the last step of every stage but the last ([]: one stage)."""
    last_of_stage: dict[int, int] = {}
    for r in rows:
        stage = r.get("stage", 1)
        last_of_stage[stage] = max(last_of_stage.get(stage, 0), r["step"])
    return [last_of_stage[k] for k in sorted(last_of_stage)[:-1]]


def plot(curves: dict, restarts: dict, path: str, window: int) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, pts) in enumerate(curves.items()):
        ax.plot([s for s, _ in pts], [m for _, m in pts], "o-", color=f"C{i}", label=name)
    for step in sorted({s for steps in restarts.values() for s in steps}):
        ax.axvline(step, color="grey", ls="--", lw=1)
        ax.text(step, ax.get_ylim()[0], " warm restart", color="grey", va="bottom", fontsize=8)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"tau estimate (training batches, mean per {window} steps)")
    ax.set_title("default drafts: training tau estimate")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default="dspark_jax/assets/default")
    ap.add_argument("--names", nargs="+", default=["dspark", "parallel", "onetoken"])
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--plot", default=None, help="write the curves to this PNG")
    args = ap.parse_args(argv)
    logs = ROOT / args.bundle / "logs"
    curves, restarts = {}, {}
    for name in args.names:
        path = logs / f"draft_{name}_metrics.jsonl"
        if not path.is_file():
            print(f"{path}: no such file (names: the drafts trained for this bundle)", file=sys.stderr)
            return 2
        rows = read_metrics(path)
        curves[name], restarts[name] = window_means(rows, "tau_estimate", args.window), restart_steps(rows)
    for name, pts in curves.items():
        after = ", ".join(str(s) for s in restarts[name])
        plural = "s" if len(restarts[name]) > 1 else ""
        restart = f" (warm restart{plural} after step{plural} {after})" if after else ""
        print(f"{name}{restart}: tau_estimate per {args.window} steps")
        print("  " + " ".join(f"{m:.2f}" for _, m in pts))
    if args.plot:
        plot(curves, restarts, args.plot, args.window)
        print(f"plot -> {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
