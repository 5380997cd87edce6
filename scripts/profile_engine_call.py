#!/usr/bin/env python
"""Where one `engine.generate` call's time goes, program by program, plain vs async (issue 42).

For each mode, one engine (compile policy lazy: only what the calls use) serves the same requests
--calls times (the first compiles; every call's wall time is printed), then once more with every
program dispatch followed by a wait for the device, so each program's own time is measured: the
table lists each program key, how often the call ran it, its mean time and its share of the call.
The serialized call is slower than a normal one (no overlap of host and device), but the programs'
times add up to it, and the two modes' tables show what async runs that plain does not.

    python scripts/profile_engine_call.py [--bundle DIR] [--slots 8] [--temperature 0] [--calls 3]
"""

from __future__ import annotations

import argparse
import collections
import time

import jax

from dspark_jax import assets
from dspark_jax.bundle import load_bundle
from dspark_jax.evaluation import make_requests, read_prompts
from dspark_jax.serve.compiling import release_programs
from dspark_jax.serve.engine import Engine, EngineConfig
from dspark_jax.serve.profile import cached_cost_table


def timed_programs(engine: Engine) -> tuple[dict, collections.Counter]:
    """Wrap the engine's dispatcher: -> (key -> seconds, key -> count), filled by the next calls."""
    seconds, count = collections.defaultdict(float), collections.Counter()
    execute = engine._execute

    def execute_and_wait(key, rows=None):
        t0 = time.perf_counter()
        out = execute(key, rows=rows)
        jax.block_until_ready(engine._state)
        seconds[key] += time.perf_counter() - t0
        count[key] += 1
        return out

    engine._execute = execute_and_wait
    return seconds, count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=None)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    path = args.bundle or assets.default_bundle_path()
    bundle = load_bundle(path)
    table, _ = cached_cost_table(bundle, slots=args.slots, max_len=args.max_len, progress=False)
    prompts = read_prompts(f"{path}/prompts.jsonl", args.requests)
    reqs = make_requests(prompts, bundle.tokenizer, max_tokens=args.max_tokens, temperature=args.temperature)
    print(f"{args.requests} requests x {args.max_tokens} tokens, {args.slots} slots, max_len {args.max_len}, "
          f"T = {args.temperature:g}; compile policy lazy")
    for mode in ("plain", "async"):
        release_programs()
        engine = Engine(bundle.model, bundle.weights, EngineConfig(
            max_slots=args.slots, max_len=args.max_len, mode=mode, progress=False, compile="lazy"),
            cost_table=table if mode == "async" else None)
        walls = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            engine.generate(reqs)
            walls.append(time.perf_counter() - t0)
        seconds, count = timed_programs(engine)
        t0 = time.perf_counter()
        engine.generate(reqs)
        wall = time.perf_counter() - t0
        print(f"\n{mode}: calls {', '.join(f'{w:.2f}' for w in walls)} s (the first compiles); serialized call "
              f"{wall:.2f} s, {sum(seconds.values()):.2f} s of it in programs")
        print(f"  {'program':40s} {'runs':>4s} {'ms each':>8s} {'share':>6s}")
        for key in sorted(seconds, key=seconds.get, reverse=True):
            print(f"  {str(key):40s} {count[key]:4d} {1e3 * seconds[key] / count[key]:8.1f} "
                  f"{seconds[key] / wall:6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
