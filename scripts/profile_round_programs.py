#!/usr/bin/env python
"""Time the serving engine's round programs at one batch, side by side: the plain step program and the
speculative round program, in mode "fixed" and in mode "async" (the scheduler's capacity computed on
device), at each verify width; with `dspark_jax.spec_round`'s draft propose and backbone forward alone
beside them (what a round is made of).

Every engine program runs `--rounds` rounds per call (the engine's default 4) on every slot running,
from the same state each time (copied before the call: the programs donate it, and a copy keeps the
cache length, hence the attention work, the same for every call). The cases take turns call by call,
so a slow spell of a shared machine hits them alike. Prints ms per round: min, 25th percentile, median.

    python scripts/profile_round_programs.py [--bundle dspark_jax/assets/default] [--slots 1]
                                             [--max-len 384] [--calls 50]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import sampling
from dspark_jax import spec_round as sr
from dspark_jax.bundle import load_bundle
from dspark_jax.schedule import width_buckets
from dspark_jax.serve import decode_state as ds
from dspark_jax.serve.engine import EngineConfig, Request
from dspark_jax.serve.profile import cached_cost_table

PROMPT_LEN = 24


def seconds(fn, *args, **kw) -> float:
    """Wall seconds of one call of `fn` to completion."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args, **kw))
    return time.perf_counter() - t0


def admitted_state(model, weights, slots: int, max_len: int, deferred: int) -> ds.DecodeState:
    """Every slot running a greedy request with a 24-token prompt, its budget far away."""
    prompts = [[3 + i + j for j in range(PROMPT_LEN)] for i in range(slots)]
    reqs = [Request(p, max_tokens=max_len) for p in prompts]
    rows = ds.joining_rows(list(range(slots)), prompts, reqs, slots, max_len, 1, 16)
    state = ds.init(model, slots, max_len, 1, deferred)
    state, _ = ds.ADMIT(model, weights, state, jax.device_put(rows), max_len=max_len)
    return jax.block_until_ready(state)


def cases(bundle, slots: int, max_len: int, rounds: int) -> dict:
    """name -> (rounds per call, a call that runs the program once from a fresh copy of the state,
    returning its seconds)."""
    model, weights = bundle.model, bundle.weights
    table, _ = cached_cost_table(bundle, slots=slots, max_len=max_len, progress=True)
    state = admitted_state(model, weights, slots, max_len, deferred=EngineConfig.max_deferred_ingest)

    def timed(program, **kw):  # the program donates its state: each call gets a fresh copy (untimed)
        return seconds(program, model, weights, jax.block_until_ready(jax.tree.map(jnp.copy, state)), **kw)

    out = {"plain step (engine)": (rounds, functools.partial(timed, ds.PLAIN_ROUNDS, rounds=rounds,
                                                            max_len=max_len, ingest_draft=True))}
    for width in width_buckets(model.block_size)[1:]:
        for mode, tab in (("fixed", None), ("async", table)):
            out[f"spec w{width} {mode} (engine)"] = (rounds, functools.partial(
                timed, ds.SPEC_ROUNDS, table=tab, rounds=rounds, max_len=max_len, width=width, mode=mode,
                num_verify=width - 1 if mode == "fixed" else None, filtering=False))
    rs = state.round
    params = sampling.SamplingParams.make(slots, temperature=0.0)
    seeds = jnp.zeros((slots,), jnp.int32)
    propose = jax.jit(functools.partial(sr.draft_propose, model, filtering=False))
    forward = jax.jit(functools.partial(sr.backbone_forward, model))
    out["draft propose (alone)"] = (1, functools.partial(seconds, propose, weights, rs, params, seeds))
    for width in (1, model.block_size + 1):
        tokens = jnp.zeros((slots, width), jnp.int32)
        out[f"backbone forward w{width} (alone)"] = (1, functools.partial(seconds, forward, weights.backbone,
                                                                         rs.cache, tokens))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default="dspark_jax/assets/default")
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--rounds", type=int, default=4, help="rounds per engine call")
    ap.add_argument("--calls", type=int, default=50, help="timed calls per case")
    args = ap.parse_args()
    todo = cases(load_bundle(args.bundle), args.slots, args.max_len, args.rounds)
    for _, call in todo.values():  # compile
        call()
    ms = {name: [] for name in todo}
    for _ in range(args.calls):
        for name, (rounds, call) in todo.items():
            ms[name].append(call() / rounds * 1e3)
    print(f"{args.bundle}, {args.slots} slot(s), max_len {args.max_len}, {args.calls} calls per case "
          f"(CPU figures if run on a CPU); ms per round")
    print(f"{'program':32s} {'min':>7s} {'p25':>7s} {'median':>7s}")
    for name, t in ms.items():
        print(f"{name:32s} {np.min(t):7.2f} {np.percentile(t, 25):7.2f} {np.median(t):7.2f}")


if __name__ == "__main__":
    main()
