#!/usr/bin/env python
"""Where a speculative engine's time goes: inside the jitted round versus on the host between rounds.

Serves the same held-out requests with plain decoding and with speculative decoding (every draft
verified), twice each (the first run compiles), and for the speculative engine times every call of its
jitted round to completion (block_until_ready), so wall time splits into in-round device time and
everything else (prefill, host bookkeeping, dispatch).

    python scripts/profile_engine_round.py [--bundle dspark_jax/assets/default] [--slots 8] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax


def main(argv=None) -> int:
    from dspark_jax.bench.acceptance import make_requests, read_prompts
    from dspark_jax.bundle import load_bundle
    from dspark_jax.serve.engine import Engine, EngineConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default="dspark_jax/assets/default")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)

    b = load_bundle(args.bundle)
    reqs = make_requests(read_prompts(f"{args.bundle}/prompts.jsonl", args.slots), b.tokenizer,
                         max_tokens=args.max_tokens, temperature=0.0, max_prompt_tokens=96)
    k = b.model.block_size
    print(f"{args.bundle}: {len(reqs)} greedy requests x {args.max_tokens} tokens, {args.slots} slots, "
          f"second run of each engine (the first compiles)")
    print(f"{'decoding':12s} {'wall s':>7s} {'steps':>6s} {'ms/step':>8s} {'in-round ms':>12s} "
          f"{'host ms':>8s} {'tau':>5s}")
    for mode in ("plain", "fixed"):
        extra = {"num_verify": k} if mode == "fixed" else {}
        for run in range(2):
            eng = Engine(b.model, b.weights, EngineConfig(max_slots=args.slots, max_len=512, mode=mode,
                                                          progress=False, **extra))
            inner, spent = eng._round, [0.0, 0]

            def timed_round(*a, **kw):
                t = time.perf_counter()
                out = jax.block_until_ready(inner(*a, **kw))
                spent[0] += time.perf_counter() - t
                spent[1] += 1
                return out

            eng._round = timed_round
            t0 = time.perf_counter()
            eng.generate(reqs)
            wall = time.perf_counter() - t0
        steps = spent[1] if mode == "fixed" else args.max_tokens
        in_round = f"{spent[0] / steps * 1e3:.1f}" if mode == "fixed" else "-"
        host = f"{(wall - spent[0]) / steps * 1e3:.1f}" if mode == "fixed" else "-"
        name = "plain" if mode == "plain" else f"spec (K={k})"
        print(f"{name:12s} {wall:7.2f} {steps:6d} {wall / steps * 1e3:8.1f} {in_round:>12s} {host:>8s} "
              f"{eng.metrics.tau:5.2f}")
    print("(plain: steps = tokens per request, ms/step includes prefill; spec: steps = rounds; host = wall "
          "minus in-round time, per round, prefill included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
