"""`dspark bench acceptance`: tau and per-position conditional acceptance of the embedded drafts.

The three drafts of an embedded default (dspark_jax/assets/default, or with --bundle
dspark_jax/assets/default_qwen3 the Qwen3 one), each against the SAME trained backbone and the SAME
held-out prompts (the bundle's prompts.jsonl, functions cut from stdlib files that neither the backbone
nor the drafts saw), trained on the same data with the same budget:
  * dspark    block 7 with the Markov head (the default bundle's draft)
  * parallel  the same draft with markov_rank 0 (pure parallel, DFlash-like)
  * onetoken  block 1 (a one-token draft)
Every round verifies every draft (engine mode "off", so acceptance at position k is observed whenever
1..k-1 survived), at T = 0 (greedy) and T = 1. tau = emitted tokens per request-round (accepted drafts +
the correction/bonus token); acc@k = accepted at k / rounds that verified k with 1..k-1 accepted (SPEC 9).

STS calibration on the same rounds: ECE of the cumulative survival a_k = prod sigmoid(z_i / T_i) against
the observed prefix survival, per position then weighted by counts (`calibration.summary_ece`), raw
(T_i = 1, "before") and with the draft's committed calibration.json ("after"; fitted by
scripts/fit_calibration.py on OTHER held-out prompts, so this is out-of-sample). `--refit` adds the
in-sample ECE of a fit on these records.

    dspark bench acceptance [--max-tokens 128] [--prompts N] [--plot acceptance.png] [--json out.json]

The shared helpers live in the package: running drafts on held-out prompts in `dspark_jax.evaluation`,
the acceptance table cells and bars in `dspark_jax.acceptance_report`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from dspark_jax import output_files
from dspark_jax.acceptance_report import MIN_PLOT_ROUNDS, acceptance_bars, fmt_acc, fmt_counts
from dspark_jax.validation import check_int_flags, check_number_flags, check_output_flags

# calibration, bundle, evaluation and serve.engine import jax: they are imported inside run(), so
# `dspark bench acceptance --help` and its argument errors answer without importing jax.

# The default's comparison drafts (measured by default), then the Markov head variants of its DSpark draft
# (`--variants dspark gated rnn`: vanilla / gated / recurrent head, same data and budget; SPEC 4.1).
VARIANTS = ("dspark", "parallel", "onetoken", "gated", "rnn")
DEFAULT_VARIANTS = VARIANTS[:3]
DESCRIPTIONS = {"dspark": "DSpark (block 7, Markov head)", "parallel": "pure parallel (block 7, rank 0)",
                "onetoken": "one-token (block 1)", "gated": "DSpark, gated Markov head",
                "rnn": "DSpark, recurrent Markov head"}


# ---------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default model)")
    parser.add_argument("--prompts-file", default=None, help="prompts JSONL (default: the bundle's prompts.jsonl)")
    parser.add_argument("--prompts", type=int, default=16, help="how many prompts")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=VARIANTS,
                        help="drafts of the default to measure (default: dspark parallel onetoken; the Markov head "
                             "variants: dspark gated rnn)")
    parser.add_argument("--refit", action="store_true", help="also report the in-sample ECE of an STS refit")
    parser.add_argument("--plot", default=None, help="write a PNG of per-position acceptance here")
    parser.add_argument("--json", default=None, help="write all numbers as JSON here")
    parser.add_argument("--impl", default="auto", choices=("auto", "pallas", "xla"))
    parser.add_argument("--no-progress", action="store_true")


def check_args(args) -> None:
    """Every numeric flag, before the model loads: `--prompts 0` meant all prompts and a negative
    temperature printed a table of zeros."""
    check_int_flags(args, "prompts", "max_tokens", "slots", "max_len")
    check_number_flags(args, "temperatures")
    check_output_flags(args, "plot", "json")


def run(args: argparse.Namespace) -> int:
    check_args(args)  # before jax is imported: a bad flag answers at once
    from dspark_jax import calibration as cal_lib  # noqa: PLC0415  (jax)
    from dspark_jax.bundle import load_bundle  # noqa: PLC0415  (jax)
    from dspark_jax.evaluation import (default_dir, load_variant, make_requests,  # noqa: PLC0415  (jax)
                                       missing_default_message, read_prompts, recording_engine, timed_generate)
    from dspark_jax.serve.compiling import release_programs  # noqa: PLC0415  (jax)
    from dspark_jax.serve.engine import EngineConfig  # noqa: PLC0415  (jax)

    path = args.bundle or default_dir()
    if path is None:
        print(missing_default_message("dspark bench acceptance", random_tiny=False), file=sys.stderr)
        return 2
    prompts_file = Path(args.prompts_file) if args.prompts_file else Path(path) / "prompts.jsonl"
    prompts = read_prompts(prompts_file, args.prompts)  # every line checked before the model loads
    bundle = load_bundle(path, impl=args.impl)
    print(f"bundle {path}; {len(prompts)} held-out prompts from {prompts_file}; {args.max_tokens} tokens each; "
          f"engine mode off (every draft verified), {args.slots} slots", flush=True)

    rows = []
    for name in args.variants:
        try:
            model, weights, cal = load_variant(bundle, name)
        except FileNotFoundError as err:
            print(f"skip {name}: {err}", file=sys.stderr)
            continue
        k = model.block_size
        engine = recording_engine(model, weights, EngineConfig(max_slots=args.slots, max_len=args.max_len,
                                                               mode="off", progress=not args.no_progress))
        for temp in args.temperatures:
            reqs = make_requests(prompts, bundle.tokenizer, max_tokens=args.max_tokens, temperature=temp)
            t0 = time.perf_counter()
            _, m = timed_generate(engine, reqs)
            rec = engine.take_records()
            row = {"draft": name, "block": k, "temperature": temp, "tau": m.tau,
                   "acceptance": [None if np.isnan(a) else float(a) for a in m.acceptance],
                   "verified_at": m.verified_at.tolist(), "request_rounds": m.request_rounds,
                   "emitted": m.emitted, "tokens_per_s": m.tokens_per_s, "seconds": time.perf_counter() - t0}
            z, nv, na = rec["logits"], rec["num_verified"].astype(np.int64), rec["num_accepted"].astype(np.int64)
            if len(z):
                before, counts = cal_lib.ece_per_position(z, na, nv, None)
                row["ece_before"] = cal_lib.summary_ece(before, counts)
                if cal is not None:
                    after, _ = cal_lib.ece_per_position(z, na, nv, cal.temperatures)
                    row["ece_after"] = cal_lib.summary_ece(after, counts)
                    row["temperatures"] = [float(t) for t in cal.temperatures]
                if args.refit:
                    row["ece_refit_in_sample"] = cal_lib.fit_sts(z, na, nv).ece_after
            rows.append(row)
            print(f"  {name:9s} T={temp:g}: tau {m.tau:.3f} over {m.request_rounds} request-rounds "
                  f"({row['seconds']:.0f} s)", flush=True)
        del engine  # each variant's engine compiled its whole program set (XLA:CPU memory maps)
        release_programs()

    print_table(rows, args.max_tokens, len(prompts))
    if args.json:
        output_files.write_text(args.json, json.dumps({"prompts": len(prompts), "max_tokens": args.max_tokens,
                                               "rows": rows}, indent=2) + "\n")
        print(f"numbers -> {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot -> {args.plot}")
    return 0


def print_table(rows, max_tokens, n_prompts) -> None:
    kmax = max((r["block"] for r in rows), default=1)
    head = " ".join(f"acc@{k + 1}" for k in range(kmax))
    print()
    print(f"Acceptance on held-out stdlib code ({n_prompts} prompts x {max_tokens} tokens, every draft verified)")
    refit = any("ece_refit_in_sample" in r for r in rows)
    print(f"{'draft':32s} {'T':>3s} {'tau':>6s}  {head}  {'ECE raw':>7s} {'ECE STS':>7s}"
          + (f" {'refit*':>7s}" if refit else ""))
    for r in rows:
        eb = f"{r['ece_before']:.4f}" if "ece_before" in r else "   -   "
        ea = f"{r['ece_after']:.4f}" if "ece_after" in r else "   -   "
        print(f"{DESCRIPTIONS[r['draft']]:32s} {r['temperature']:>3g} {r['tau']:6.3f}  "
              f"{fmt_acc(r['acceptance'], kmax)}  {eb:>7s} {ea:>7s}"
              + (f" {r['ece_refit_in_sample']:7.4f}" if "ece_refit_in_sample" in r else ""))
        print(f"{'  rounds behind each acc@k':32s} {'':>3s} {'':>6s}  {fmt_counts(r['verified_at'], kmax)}")
    print("tau = emitted tokens per request-round (accepted drafts + 1); acc@k = P(accept k | 1..k-1 accepted);")
    print("ECE of the prefix-survival confidence, raw (T_k = 1) and with the committed STS temperatures"
          " (fitted at T = 1 on other held-out files)" + ("; refit* = STS refitted on these very rounds"
                                                           " (in-sample, optimistic)." if refit else "."))


def plot(rows, path) -> None:
    import matplotlib  # noqa: PLC0415  (heavy; only with --plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        sel = [r for r in rows if r["temperature"] == t]
        width = 0.8 / max(len(sel), 1)
        for i, r in enumerate(sel):
            xs = np.arange(1, len(r["acceptance"]) + 1) + (i - (len(sel) - 1) / 2) * width
            acceptance_bars(ax, xs, r["acceptance"], r["verified_at"], width,
                            f"{DESCRIPTIONS[r['draft']]} (tau {r['tau']:.2f})", f"C{i}")
        ax.set_title(f"conditional acceptance, T = {t:g} (hatched: < {MIN_PLOT_ROUNDS} rounds)")
        kmax = max(len(r["acceptance"]) for r in sel)
        ax.set_xticks(np.arange(1, kmax + 1))
        ax.set_xlim(0.4, kmax + 0.6)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(accept k | 1..k-1 accepted)")
        # Headroom above 1: the counts sit just above the bars and the legend above them (inside the
        # axes it otherwise covers bars, which reach 1 at several positions).
        ax.set_ylim(0, 1.5)
        ax.set_yticks(np.linspace(0, 1, 6))
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
