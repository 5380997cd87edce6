#!/usr/bin/env python
"""Fit the STS confidence temperatures of the default model's drafts on held-out rounds.

For each draft (the bundle's DSpark draft and each variants/<name>/), run the serving engine in mode
"fixed" with verify length K (every draft verified, so position k's outcome is observed whenever the
round reached it) on the CALIBRATION prompts (held-out files disjoint from the evaluation prompts the
demo and the benchmark use), at --temperature (default 1, the V4.1 default), recording per request-round
the raw confidence logits, the verify length and the accepted count. Then `calibration.fit_sts` and
save calibration.json next to the draft (the bundle folder, or variants/<name>/). With `--coupling
invariant` the requests run under the drafter-invariant coupling (its acceptance is lower) and the fit is saved
as calibration_invariant.json beside it, which the bundle loads for its invariant rows. The records are also
written as JSON lines in `dspark calibrate` format (--records-dir), so reliability plots can be redrawn:
    dspark calibrate build/default_model/calib_records_dspark.jsonl --out /tmp/cal.json

    python scripts/fit_calibration.py [--bundle dspark_jax/assets/default] [--prompts build/default_model/calib_prompts.jsonl]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    from dspark_jax.bundle import load_bundle
    from dspark_jax.calibration import fit_sts
    from dspark_jax.evaluation import load_variant, make_requests, read_prompts, recording_engine, with_temperatures
    from dspark_jax.serve.compiling import release_programs
    from dspark_jax.serve.engine import EngineConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default="dspark_jax/assets/default")
    ap.add_argument("--prompts", default="build/default_model/calib_prompts.jsonl")
    ap.add_argument("--records-dir", default="build/default_model")
    ap.add_argument("--variants", nargs="+", default=["dspark", "parallel", "onetoken"])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--coupling", default="optimal", choices=("optimal", "invariant"))
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=384)
    args = ap.parse_args(argv)

    bundle = load_bundle(ROOT / args.bundle)
    prompts = read_prompts(ROOT / args.prompts)
    summary = {}
    for name in args.variants:
        model, weights, _ = load_variant(bundle, name)
        k = model.block_size
        weights = with_temperatures(weights, np.ones(k))  # record RAW logits; temperatures only act on admission
        engine = recording_engine(model, weights, EngineConfig(max_slots=args.slots, max_len=args.max_len,
                                                               mode="fixed", num_verify=k))
        reqs = make_requests(prompts, bundle.tokenizer, max_tokens=args.max_tokens, temperature=args.temperature,
                             seed0=1000)
        reqs = [dataclasses.replace(r, coupling=args.coupling) for r in reqs]
        engine.generate(reqs)
        rec = engine.take_records()
        z, nv, na = rec["logits"], rec["num_verified"].astype(np.int64), rec["num_accepted"].astype(np.int64)
        cal = fit_sts(z, na, nv)
        out = (ROOT / args.bundle) if name == "dspark" else (ROOT / args.bundle / "variants" / name)
        suffix = "" if args.coupling == "optimal" else "_invariant"
        cal.save(out / f"calibration{suffix}.json")
        rpath = ROOT / args.records_dir / f"calib_records_{name}{suffix}.jsonl"
        with open(rpath, "w") as f:
            for zi, a, v in zip(z, na, nv):
                f.write(json.dumps({"logits": [float(x) for x in zi], "num_accepted": int(a),
                                    "num_verified": int(v)}) + "\n")
        summary[name] = {"records": int(len(z)), "tau": engine.metrics.tau,
                         "temperatures": [float(t) for t in cal.temperatures], "ece_before": cal.ece_before,
                         "ece_after": cal.ece_after}
        print(f"{name}: {len(z)} rounds, tau {engine.metrics.tau:.3f}, ECE {cal.ece_before:.4f} -> "
              f"{cal.ece_after:.4f} (in-sample), T = {np.round(cal.temperatures, 3).tolist()} -> {out}", flush=True)
        del engine  # each variant's engine compiled its whole program set (XLA:CPU memory maps)
        release_programs()
    text = json.dumps(summary, indent=2) + "\n"
    (ROOT / args.records_dir / f"calibration_summary{suffix}.json").write_text(text)
    if (ROOT / args.bundle / "logs").is_dir():  # the bundle's own record of how it was calibrated
        (ROOT / args.bundle / "logs" / f"calibration_summary{suffix}.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
