"""`dspark bench acceptance`: tau and per-position conditional acceptance of the embedded drafts.

The three drafts of the embedded default model, each against the SAME trained backbone and the SAME
held-out prompts (dspark_jax/assets/default/prompts.jsonl, functions cut from stdlib files that neither
the backbone nor the drafts saw):
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

The helpers here (variant loading, recording rounds, prompt requests) are shared with `dspark demo` and
scripts/fit_calibration.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

VARIANTS = ("dspark", "parallel", "onetoken")
DESCRIPTIONS = {"dspark": "DSpark (block 7, Markov head)", "parallel": "pure parallel (block 7, rank 0)",
                "onetoken": "one-token (block 1)"}


# ---------------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------------


def default_dir() -> Path | None:
    from dspark_jax import assets

    return assets.default_bundle_path()


def missing_default_message(what: str, random_tiny: bool = True) -> str:
    msg = (f"{what}: the embedded default model is not installed (no dspark_jax/assets/default/bundle.json).\n"
           "  Rebuild it with `bash scripts/build_default.sh` (a few hours on 2 CPU cores), or pass --bundle DIR")
    if random_tiny:
        msg += (",\n  or run `dspark demo --random-tiny` for a plumbing check on random weights (acceptance,"
                " speed-up and text are then meaningless)")
    return msg + "."


def load_variant(bundle, name: str):
    """(SpecModel, Weights, Calibration | None) of draft `name` against the bundle's backbone: 'dspark' is
    the bundle's own draft; other names load <bundle>/variants/<name>/{draft.json, draft.safetensors,
    calibration.json} strictly (every tensor present with its shape, nothing else)."""
    import jax.numpy as jnp

    from dspark_jax import draft as draft_lib
    from dspark_jax import spec_round as sr
    from dspark_jax.bundle import unflatten_strict
    from dspark_jax.calibration import Calibration
    from dspark_jax.checkpoint.safetensors_io import open_checkpoint
    from dspark_jax.config import DSparkConfig

    if name == "dspark":
        return bundle.model, bundle.weights, bundle.calibration
    vdir = Path(bundle.path) / "variants" / name
    if not (vdir / "draft.json").is_file():
        raise FileNotFoundError(f"{vdir}: no draft.json (variant '{name}' is not in this bundle)")
    cfg = DSparkConfig.from_json(vdir / "draft.json")
    params = unflatten_strict(open_checkpoint(vdir / "draft.safetensors"), draft_lib.abstract_params(cfg),
                              str(vdir / "draft.safetensors"))
    cal = Calibration.load(vdir / "calibration.json") if (vdir / "calibration.json").is_file() else None
    temps = jnp.asarray(cal.temperatures if cal else np.ones(cfg.block_size), jnp.float32)
    model = sr.SpecModel(bundle.model.backbone, cfg, tap_mode=bundle.model.tap_mode, impl=bundle.model.impl)
    return model, sr.Weights(bundle.weights.backbone, params, bundle.weights.tied, temps), cal


def with_temperatures(weights, temperatures):
    import jax.numpy as jnp

    return weights._replace(temperatures=jnp.asarray(temperatures, jnp.float32))


def read_prompts(path, limit: int | None = None) -> list[dict]:
    recs = [json.loads(line) for line in open(path) if line.strip()]
    return recs[:limit] if limit else recs


def make_requests(prompts: list[dict], tokenizer, *, max_tokens: int, temperature: float, seed0: int = 0,
                  max_prompt_tokens: int = 192):
    """Engine requests from prompt records ({"prompt": text} or {"tokens": ids}); long prompts keep their
    last `max_prompt_tokens` tokens (the end is what the model continues)."""
    from dspark_jax.serve.engine import Request

    reqs = []
    for i, rec in enumerate(prompts):
        ids = list(rec["tokens"]) if "tokens" in rec else tokenizer.encode(rec["prompt"]).ids
        reqs.append(Request(ids[-max_prompt_tokens:], max_tokens=max_tokens, temperature=temperature,
                            seed=seed0 + i, id=rec.get("id", i)))
    return reqs


def recording_engine(model, weights, config, cost_table=None):
    """An Engine that also keeps, per active request-round, the raw confidence logits, the verify length
    and the accepted count (the STS calibration records: `engine.take_records()`)."""
    import dataclasses

    from dspark_jax.serve.engine import Engine

    return Engine(model, weights, dataclasses.replace(config, record_rounds=True), cost_table=cost_table)


def timed_generate(engine, requests, warmup_tokens: int = 16):
    """Warm up (compile) on the same prompts with short budgets, then run and return (results, Metrics)
    of the measured run only."""
    import dataclasses

    from dspark_jax.serve.engine import Metrics

    engine.metrics = Metrics(engine.k)  # the warm-up must not land in a previous run's metrics object
    if warmup_tokens:
        # The first round after the prompt verifies min(K, max_tokens - 2) drafts, so these budgets compile
        # every verify-width bucket (1, 2, 4, ..., K+1) and the prompt bucket before the timed run.
        budgets = sorted({min(b, r.max_tokens) for r in requests for b in (2, 3, 5, 9, warmup_tokens)})
        for b in budgets:
            engine.generate([dataclasses.replace(r, max_tokens=b) for r in requests])
    engine.metrics = Metrics(engine.k)
    if hasattr(engine, "take_records"):
        engine.take_records()
    results = engine.generate(requests)
    return results, engine.metrics


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
    ax.bar(xs[solid], acc[solid], width, label=label, color=color)
    if (~solid).any():
        ax.bar(xs[~solid], np.nan_to_num(acc[~solid]), width, fill=False, hatch="//", edgecolor=color)
    for x, a, n in zip(xs, acc, counts):
        ax.text(x, (0 if np.isnan(a) else a) + 0.01, f"n={n}", ha="center", va="bottom", fontsize=6, rotation=90)


def fmt_acc(acc, width: int = 7) -> str:
    cells = []
    for k in range(width):
        a = acc[k] if k < len(acc) else None
        cells.append("  -  " if a is None or (isinstance(a, float) and np.isnan(a)) else f"{a:.3f}")
    return " ".join(cells)


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
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--refit", action="store_true", help="also report the in-sample ECE of an STS refit")
    parser.add_argument("--plot", default=None, help="write a PNG of per-position acceptance here")
    parser.add_argument("--json", default=None, help="write all numbers as JSON here")
    parser.add_argument("--impl", default="auto", choices=("auto", "pallas", "xla"))
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from dspark_jax import calibration as cal_lib
    from dspark_jax.bundle import load_bundle
    from dspark_jax.serve.engine import EngineConfig

    path = args.bundle or default_dir()
    if path is None:
        print(missing_default_message("dspark bench acceptance", random_tiny=False), file=sys.stderr)
        return 2
    bundle = load_bundle(path, impl=args.impl)
    prompts_file = Path(args.prompts_file) if args.prompts_file else Path(path) / "prompts.jsonl"
    prompts = read_prompts(prompts_file, args.prompts)
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

    print_table(rows, args.max_tokens, len(prompts))
    if args.json:
        Path(args.json).write_text(json.dumps({"prompts": len(prompts), "max_tokens": args.max_tokens,
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        ax.set_ylim(0, 1.15)  # room for the counts above a bar at 1
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
