"""`dspark calibrate`: fit STS temperatures from round records and draw reliability diagrams.

Records file: JSON lines, one proposal per line,
    {"logits": [z_1, ..., z_K], "num_accepted": n, "num_verified": m}
with the raw confidence-head logits, the verify length the scheduler chose (m, fixed before the
outcome) and the accepted prefix length n <= m. Blank lines are skipped; other keys are ignored.
Writes the calibration JSON (key `temperatures`, SGLang / TensorRT-LLM compatible, plus metadata) and
one reliability-diagram PNG per position (cumulative survival, raw and calibrated, against the observed
prefix-survival frequency).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np

from dspark_jax import calibration
from dspark_jax.errors import UserError, json_object_line
from dspark_jax.output_files import check_not_an_input


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("records", help="JSON-lines file of {logits, num_accepted, num_verified} records")
    parser.add_argument("--out", default="calibration.json", help="calibration JSON to write")
    parser.add_argument("--plot-dir", default=None,
                        help="folder for reliability_k<k>.png (default: the folder of --out)")
    parser.add_argument("--bins", type=int, default=20, help="equal-width ECE bins")


def read_records(path: str | os.PathLike):
    """(logits f64[N, K], num_accepted i64[N], num_verified i64[N]); ValueError naming line and field."""
    logits, accepted, verified = [], [], []
    num_positions = None
    try:
        f = open(path, "rb")  # decoded per line, so a bad byte is reported with its line
    except OSError as err:
        raise ValueError(f"{path}: cannot read the records file ({err.strerror})") from None
    with f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path} line {line_no}"
            try:
                rec = json_object_line(raw)
            except UserError as err:
                raise UserError(f"{where}: {err}") from None
            if rec is None:
                continue
            for key in ("logits", "num_accepted", "num_verified"):
                if key not in rec:
                    raise ValueError(f"{where}: missing field '{key}'")
            z = rec["logits"]
            if (not isinstance(z, list) or not z
                    or not all(_is_number(v) and math.isfinite(v) for v in z)):
                raise ValueError(f"{where}: field 'logits' must be a non-empty list of finite numbers, got {z!r}")
            if num_positions is None:
                num_positions = len(z)
            elif len(z) != num_positions:
                raise ValueError(f"{where}: field 'logits' has {len(z)} values, expected {num_positions} "
                                 f"(K of the first record)")
            m = rec["num_verified"]
            if not _is_int(m) or not 0 <= m <= num_positions:
                raise ValueError(f"{where}: field 'num_verified' must be an integer in [0, {num_positions}], got {m!r}")
            n = rec["num_accepted"]
            if not _is_int(n) or not 0 <= n <= m:
                raise ValueError(f"{where}: field 'num_accepted' must be an integer in [0, num_verified={m}], "
                                 f"got {n!r}")
            logits.append(z)
            accepted.append(n)
            verified.append(m)
    if not logits:
        raise ValueError(f"{path}: no records")
    return np.asarray(logits, np.float64), np.asarray(accepted, np.int64), np.asarray(verified, np.int64)


def unverified_positions(num_verified, num_positions: int) -> list[int]:
    """The 1-based positions k that no record verified (num_verified < k everywhere): nothing to fit there."""
    most = int(np.max(num_verified)) if len(num_verified) else 0
    return list(range(most + 1, num_positions + 1))


def check_verified(path, num_verified, num_positions: int) -> list[int]:
    """UserError when no record verified any position (every temperature would be a silent 1.0); else the
    positions that keep T = 1 for want of evidence, for the caller to warn about."""
    missing = unverified_positions(num_verified, num_positions)
    if len(missing) == num_positions:
        raise UserError(f"{path}: no position was verified (num_verified is 0 in all {len(num_verified)} "
                        "records), nothing to fit; record rounds that verified at least one draft")
    return missing


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def plot_reliability(conf_logits, num_accepted, num_verified, cal: calibration.Calibration,
                     plot_dir: str | os.PathLike, bins: int) -> list[Path]:
    """One reliability diagram per position; returns the PNG paths."""
    # The object-oriented Agg canvas draws without touching pyplot's global backend state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    k = conf_logits.shape[1]
    label, observed = calibration.survival_labels(num_accepted, num_verified, k)
    raw = calibration.cumulative_survival(conf_logits, np.ones(k))
    fitted = calibration.cumulative_survival(conf_logits, cal.temperatures)
    paths = []
    for j in range(k):
        rows = observed[:, j]
        fig = Figure(figsize=(4.5, 4.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="perfect")
        for name, pred, style in (("raw", raw, "o-"), ("STS", fitted, "s-")):
            mean_pred, freq, count = calibration.reliability(pred[rows, j], label[rows, j], bins)
            keep = count > 0
            err = calibration.ece(pred[rows, j], label[rows, j], bins)
            ax.plot(mean_pred[keep], freq[keep], style, ms=3, label=f"{name} (ECE {100 * err:.1f}%)")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel(f"predicted survival a_{j + 1}")
        ax.set_ylabel(f"observed: drafts 1..{j + 1} accepted")
        ax.set_title(f"position {j + 1}: T = {float(cal.temperatures[j]):.3g}, n = {int(rows.sum())}")
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        path = plot_dir / f"reliability_k{j + 1}.png"
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


def run(args: argparse.Namespace) -> int:
    # Bad input raises UserError / ValueError naming it; the CLI boundary prints it as one line, exit 2.
    if args.bins < 1:
        raise UserError(f"--bins: expected an integer >= 1, got {args.bins}")
    check_not_an_input(args.out, [("RECORDS", args.records)])
    z, n, m = read_records(args.records)
    missing = check_verified(args.records, m, z.shape[1])  # before any output is written
    if missing:
        print(f"dspark calibrate: warning: {args.records}: no record verified position(s) "
              f"{', '.join(map(str, missing))}; their temperature stays 1.0", file=sys.stderr)
    cal = calibration.fit_sts(z, n, m, bins=args.bins)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cal.save(out)
    plot_dir = Path(args.plot_dir) if args.plot_dir else out.parent
    pngs = plot_reliability(z, n, m, cal, plot_dir, args.bins)
    eces_before, counts = calibration.ece_per_position(z, n, m, None, bins=args.bins)
    eces_after, _ = calibration.ece_per_position(z, n, m, cal.temperatures, bins=args.bins)
    print(f"{cal.num_samples} records, K = {cal.num_positions}")
    print(f"{'k':>3} {'observed':>9} {'T_k':>8} {'ECE raw':>8} {'ECE STS':>8}")
    for j in range(cal.num_positions):
        print(f"{j + 1:>3} {int(counts[j]):>9} {float(cal.temperatures[j]):>8.4g} "
              f"{100 * eces_before[j]:>7.2f}% {100 * eces_after[j]:>7.2f}%")
    print(f"ECE (count-weighted over positions): {100 * cal.ece_before:.2f}% -> {100 * cal.ece_after:.2f}%")
    print(f"wrote {out} and {len(pngs)} reliability diagrams in {plot_dir}")
    return 0
