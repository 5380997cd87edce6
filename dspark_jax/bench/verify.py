"""`dspark bench verify`: time the jitted verify_and_accept per sampling setting.

Inputs are synthetic but shaped like a serving step: backbone logits are sigma * N(0, 1) per entry
(sigma = --logit-scale; 5 gives peaked, LM-like rows whose top-p 0.9 nucleus has tens of tokens), the
draft's logits are the backbone's plus N(0, --draft-noise) noise, draft tokens are sampled from them
with the draft stream, and every request verifies all K drafts (the most work). The first call
(compilation) is timed separately and excluded; the table reports the median and the minimum of
--repeats further calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.sampling import SamplingParams, Stream, process_logits, sample
from dspark_jax.validation import check_int_flags, check_number_flags
from dspark_jax.verify import verify_and_accept

# name -> (temperature, top_k, top_p), each a per-request list or a scalar
SETTINGS = {
    "greedy": (0.0, 0, 1.0),
    "T=1": (1.0, 0, 1.0),
    "T=0.7 top-k 50": (0.7, 50, 1.0),
    "T=1 top-p 0.9": (1.0, 0, 0.9),
    "T=0.8 top-k 100 top-p 0.95": (0.8, 100, 0.95),
    "mixed: the 5 settings above, cycling over requests": None,
}
FALLBACK = "T=1 top-p 0.999 (full-sort fallback)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=64, help="R, requests in the batch")
    parser.add_argument("--block", type=int, default=5, help="K, drafts per request (all verified)")
    parser.add_argument("--vocab", type=int, default=129280, help="V (V4.1: 129280)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per setting after the warm-up")
    parser.add_argument("--logit-scale", type=float, default=5.0, help="sigma of the backbone logits")
    parser.add_argument("--draft-noise", type=float, default=1.0, help="sigma of the draft's deviation")
    parser.add_argument("--fallback", action="store_true",
                        help="also time a nucleus too wide for the candidate fast path (full sort; slow on CPU)")
    parser.add_argument("--seed", type=int, default=0)


def _params(name: str, r: int) -> SamplingParams:
    if name == FALLBACK:
        return SamplingParams.make(r, temperature=1.0, top_p=0.999)
    setting = SETTINGS[name]
    if setting is not None:
        return SamplingParams.make(r, *setting)
    settings = [s for s in SETTINGS.values() if s is not None]
    cols = [np.resize(np.array([s[i] for s in settings]), r) for i in range(3)]
    return SamplingParams.make(r, *cols)


def _inputs(args, params: SamplingParams, logit_scale: float):
    r, k, v = args.requests, args.block, args.vocab
    key_t, key_d = jax.random.split(jax.random.key(args.seed))
    target = logit_scale * jax.random.normal(key_t, (r, k + 1, v), jnp.float32)
    draft_logits = target[:, :k] + args.draft_noise * jax.random.normal(key_d, (r, k, v), jnp.float32)
    seeds = jnp.arange(r, dtype=jnp.uint32) + jnp.uint32(args.seed)
    positions = jnp.full((r,), 1000, jnp.int32)
    draw = jax.jit(sample)
    drafts = jnp.stack([draw(draft_logits[:, i], params, seeds, positions + i, Stream.DRAFT) for i in range(k)], 1)
    return target, drafts, draft_logits, jnp.full((r,), k, jnp.int32), params, seeds, positions


def _time(fn, inputs, repeats: int):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*inputs))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - start)
    return out, compile_s, times


def run(args: argparse.Namespace) -> int:
    check_int_flags(args, "requests", "block", "vocab", "repeats")
    check_int_flags(args, "seed", minimum=0)
    check_number_flags(args, "logit_scale", "draft_noise")
    r, k, v = args.requests, args.block, args.vocab
    print(f"verify_and_accept on {jax.devices()[0].platform.upper()} ({jax.device_count()} device(s)): "
          f"R={r} K={k} V={v}, all {k} drafts verified, logits sigma={args.logit_scale}, "
          f"draft noise sigma={args.draft_noise}, {args.repeats} timed calls after 1 warm-up")
    print()
    print("| setting | median ms | min ms | first call s (compile) | kept tokens / row | accepted / request |")
    print("|---|---:|---:|---:|---:|---:|")
    names = list(SETTINGS) + ([FALLBACK] if args.fallback else [])
    kept_count = jax.jit(lambda t, p: jnp.mean(jnp.sum(jnp.isfinite(process_logits(t, p)), -1)))
    for name in names:
        # the fallback row uses nearly flat logits: its 0.999 nucleus spans most of the vocabulary
        inputs = _inputs(args, _params(name, r), 0.01 if name == FALLBACK else args.logit_scale)
        out, compile_s, times = _time(verify_and_accept, inputs, args.repeats)
        kept = float(kept_count(inputs[0], inputs[4]))
        accepted = float(jnp.mean(out.num_accepted))
        print(f"| {name} | {1e3 * statistics.median(times):.1f} | {1e3 * min(times):.1f} | {compile_s:.2f} | "
              f"{kept:.1f} | {accepted:.2f} |", flush=True)
    return 0
