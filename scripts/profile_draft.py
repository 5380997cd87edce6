#!/usr/bin/env python
"""What one jitted draft `propose` costs on the embedded bundles, next to one 1-token backbone forward.

For each bundle, batch and sampling setting, times (median and min of --repeats calls to completion):
  propose      draft.propose as the round calls it (filtering off unless --filtering; top_k 50 with it)
  hidden       the parallel half alone (draft_hidden: body + base logits)
  markov       the Markov sampling loop alone (drafts.markov.sample_block, base logits given)
  noise        the keyed Gumbel noise of a block alone (drafts.markov.draft_noise)
  backbone     one backbone forward of 1 token per row (a plain decode step)
The state is the one `dspark_jax.bench.decode.split_times` builds: 16-token prompts through
spec_round.start. --hlo PATH writes the optimised HLO of propose (first setting) for inspection.

    python scripts/profile_draft.py [--bundles dspark_jax/assets/default,dspark_jax/assets/default_qwen3]
                                    [--batches 1,8] [--temperatures 0,1,mix] [--filtering] [--repeats 50]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np


def _time_ms(fn, repeats: int) -> tuple[float, float]:
    """(median, min) ms of `repeats` calls to completion, after two warm-up calls."""
    from dspark_jax.bench.decode import call_seconds

    times = call_seconds(fn, repeats, warmup=2)
    return float(np.median(times)) * 1e3, float(np.min(times)) * 1e3


def profile(b, batch: int, temperatures: list[str], filtering: bool, repeats: int, hlo: str | None):
    """-> [(temperature, {column: (median, min) ms})] for one bundle at one batch."""
    from dspark_jax import drafts
    from dspark_jax import sampling
    from dspark_jax.drafts import markov as markov_head

    from dspark_jax.bench.decode import started_state

    model, weights = b.model, b.weights
    state, seeds = started_state(model, weights, batch, sampling.SamplingParams.make(batch))
    cfg = model.cfg
    k = model.block_size

    prop = jax.jit(lambda w, s, p: drafts.propose(w.draft, w.tied, cfg, s.draft, s.anchor, p, seeds,
                                                     impl=model.impl, filtering=filtering))
    hid = jax.jit(lambda w, s: drafts.family_of(cfg).draft_hidden(w.draft, w.tied, cfg, s.draft, s.anchor, impl=model.impl))
    _, base = hid(weights, state)
    markov = weights.draft.get("markov")
    w1 = None if markov is None else markov["embed"]
    w2 = None if markov is None else markov["head"]
    loop = jax.jit(lambda base, a, p, pos: markov_head.sample_block(
        "vanilla", None if markov is None else {"embed": w1, "head": w2}, base, a, None, p, seeds, pos,
        impl=model.impl, filtering=filtering))
    vocab = base.shape[-1]
    noise = jax.jit(lambda pos: markov_head.draft_noise(seeds, pos, k, vocab))
    toks1 = jnp.ones((batch, 1), jnp.int32)
    bb = jax.jit(lambda w, s: model.backbone.forward(w.backbone, s.cache, toks1, taps=cfg.target_layer_ids,
                                                     tap_mode=model.tap_mode))
    pos = state.draft.length + 1
    shared = {"hidden": _time_ms(lambda: hid(weights, state), repeats),
              "noise": _time_ms(lambda: noise(pos), repeats),
              "backbone": _time_ms(lambda: bb(weights, state), repeats)}
    rows = []
    for t in temperatures:
        temp = [float(i % 2) for i in range(batch)] if t == "mix" else float(t)  # mix: greedy, T=1, greedy, ..
        sp = sampling.SamplingParams.make(batch, temperature=temp, top_k=50 if filtering else 0)
        if hlo:
            with open(hlo, "w") as f:
                f.write(prop.lower(weights, state, sp).compile().as_text())
            hlo = None
        rows.append((t, {"propose": _time_ms(lambda: prop(weights, state, sp), repeats),
                         "markov": _time_ms(lambda: loop(base, state.anchor, sp, pos), repeats), **shared}))
    return rows, f"V={vocab} K={k} r={0 if w1 is None else w1.shape[1]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundles", default="dspark_jax/assets/default,dspark_jax/assets/default_qwen3")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--temperatures", default="0,1",
                    help="comma-separated; 'mix' = rows alternately greedy and T=1")
    ap.add_argument("--filtering", action="store_true", help="filtering=True and top_k=50 (the scan path)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--hlo", default=None, help="write propose's compiled HLO (first setting) here")
    args = ap.parse_args(argv)

    from dspark_jax.bundle import load_bundle

    cols = ("propose", "markov", "noise", "hidden", "backbone")
    print(f"{'bundle':14s} {'B':>2s} {'T':>4s} {'filter':>6s} " + " ".join(f"{c + ' ms':>15s}" for c in cols))
    hlo = args.hlo
    temps = [x.strip() for x in args.temperatures.split(",")]
    for path in args.bundles.split(","):
        bundle = load_bundle(path)
        name = path.rstrip("/").split("/")[-1]
        for batch in (int(x) for x in args.batches.split(",")):
            rows, shape = profile(bundle, batch, temps, args.filtering, args.repeats, hlo)
            hlo = None
            for t, res in rows:
                print(f"{name:14s} {batch:>2d} {t:>4s} {str(args.filtering):>6s} "
                      + " ".join(f"{res[c][0]:>7.3f} ({res[c][1]:>5.2f})" for c in cols), flush=True)
    print(f"(jax {jax.__version__}, {jax.devices()[0].platform}; {shape}; median (min) of {args.repeats} calls; "
          "hidden, noise and backbone do not depend on T)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
