#!/usr/bin/env python
"""What cheaper formulations of the draft pass and the backbone forward would buy, side by side.

Times three programs of the embedded mhc default (the draft's hidden pass over its 7 block positions,
the backbone forward of 1 token and of 8 tokens per row) under each formulation:
  current      the code as it is
  head [D,V]   the tied head's logits from a transposed copy of the head (the bundle keeps [V, D])
  sinkhorn     mHC's Sinkhorn rounds in a lax.fori_loop instead of unrolled
  bf16 draft   the draft at param / compute dtype bfloat16 (the official V4.1 dtypes), weights cast
All programs are compiled in one process and called in turn, call by call, so a slow spell of a shared
machine hits them alike; with several programs' weights alternating in the cache every time sits above
what the engine's own programs take: read the ratios. `round/step` = (hidden + forward w8) / forward w1.
Then the weight-read check: eight distinct [V, D] heads (more than the cache) in one program, f32 and
bf16, at N rows; and a profiler trace of the draft's hidden pass (its costliest ops). The formulations
are patched in for this measurement only.

    python scripts/ab_draft_formulations.py [--bundle dspark_jax/assets/default] [--batches 1,8] [--calls 300]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import dspark_jax.backbones.mhc as mhc_backbone
import dspark_jax.drafts.base as draft_base
from dspark_jax import drafts, sampling
from dspark_jax.bench.decode import started_state
from dspark_jax.bundle import load_bundle
from dspark_jax.nn import head as head_lib
from dspark_jax.nn import mhc

HI = jax.lax.Precision.HIGHEST


def sinkhorn_loop(logits, iters, eps):
    """mhc.sinkhorn's exact sequence of normalisations, the repeated rounds in a fori_loop."""
    c = jax.nn.softmax(logits, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def one_round(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, one_round, c)


def set_head(fn):
    """The head function both callers imported by name."""
    mhc_backbone.f32_head_logits = fn
    draft_base.f32_head_logits = fn


def programs(model, weights, state, batch, variant):
    """[hidden, forward w1, forward w8] compiled under `variant`; each takes (weights, state, head_t)."""
    cfg = model.cfg
    if variant == "bf16 draft":
        cfg = dataclasses.replace(cfg, param_dtype="bfloat16", compute_dtype="bfloat16")
    current_sinkhorn, current_head, slot = mhc.sinkhorn, head_lib.f32_head_logits, {}
    if variant == "sinkhorn":
        mhc.sinkhorn = sinkhorn_loop
    if variant == "head [D,V]":  # the transposed head arrives as a program argument, like a weight
        set_head(lambda x, head, tile_rows=None: jnp.einsum("...d,dv->...v", x.astype(jnp.float32), slot["t"],
                                                            precision=HI))
    fam = drafts.family_of(cfg)

    def with_head(fn):
        def call(w, s, head_t):
            slot["t"] = head_t
            return fn(w, s)
        return call

    toks = {n: jnp.ones((batch, n), jnp.int32) for n in (1, 8)}
    fns = [lambda w, s: fam.draft_hidden(w.draft, w.tied, cfg, s.draft, s.anchor, impl=model.impl)]
    fns += [lambda w, s, n=n: model.backbone.forward(w.backbone, s.cache, toks[n], taps=cfg.target_layer_ids,
                                                     tap_mode=model.tap_mode) for n in (1, 8)]
    try:
        w = weights
        if variant == "bf16 draft":
            w = weights._replace(draft=jax.tree.map(lambda a, spec: a.astype(spec.dtype), weights.draft,
                                                    drafts.abstract_params(cfg)))
        head_t = jnp.asarray(np.asarray(weights.tied["head"]).T)
        return [jax.jit(with_head(f)).lower(w, state, head_t).compile() for f in fns], (w, state, head_t)
    finally:
        mhc.sinkhorn = current_sinkhorn
        set_head(current_head)


def ab_table(bundle, batch: int, calls: int) -> None:
    model, weights = bundle.model, bundle.weights
    state, _ = started_state(model, weights, batch, sampling.SamplingParams.greedy(batch))
    variants = ["current", "head [D,V]", "sinkhorn", "bf16 draft"]
    built = {v: programs(model, weights, state, batch, v) for v in variants}
    ref = [jax.tree.leaves(f(*built["current"][1])) for f in built["current"][0]]
    times = {v: [[], [], []] for v in variants}
    for _ in range(calls):
        for v in variants:
            fns, args = built[v]
            for i, f in enumerate(fns):
                t0 = time.perf_counter()
                jax.block_until_ready(f(*args))
                times[v][i].append(time.perf_counter() - t0)
    print(f"\nbatch {batch}: median ms of {calls} calls each, taken in turn")
    print(f"{'formulation':12s} {'hidden':>8s} {'fwd w1':>8s} {'fwd w8':>8s} {'round/step':>10s} {'max |diff|':>10s}")
    for v in variants:
        fns, args = built[v]
        hid, w1, w8 = (float(np.median(t)) * 1e3 for t in times[v])
        diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32))))
                   for i, f in enumerate(fns) for a, r in zip(jax.tree.leaves(f(*args)), ref[i])
                   if jnp.issubdtype(r.dtype, jnp.floating))
        print(f"{v:12s} {hid:8.3f} {w1:8.3f} {w8:8.3f} {(hid + w8) / w1:10.3f} {diff:10.2e}")


def weight_read_table(vocab: int, dim: int, calls: int) -> None:
    """Eight distinct heads per call: if the dot is bound by reading weights, time ~ bytes / bandwidth."""
    heads = [jax.random.normal(jax.random.PRNGKey(i), (vocab, dim)) for i in range(8)]
    half = [h.astype(jnp.bfloat16) for h in heads]
    f32 = jax.jit(lambda x, *hs: sum(jnp.einsum("nd,vd->nv", x, h, precision=HI) for h in hs))
    bf16 = jax.jit(lambda x, *hs: sum(jnp.einsum("nd,vd->nv", x.astype(jnp.bfloat16), h,
                                                 preferred_element_type=jnp.float32) for h in hs))
    print(f"\neight distinct [{vocab}, {dim}] heads per call ({8 * vocab * dim * 4 / 2**20:.0f} MiB f32): "
          "us per head, median")
    print(f"{'rows':>4s} {'f32':>8s} {'GB/s':>6s} {'bf16':>8s}")
    for n in (1, 7, 8):
        x = jax.random.normal(jax.random.PRNGKey(99), (n, dim))
        row = []
        for fn, hs in ((f32, heads), (bf16, half)):
            jax.block_until_ready(fn(x, *hs))
            ts = []
            for _ in range(calls // 3):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(x, *hs))
                ts.append(time.perf_counter() - t0)
            row.append(float(np.median(ts)) / 8 * 1e6)
        print(f"{n:4d} {row[0]:8.0f} {vocab * dim * 4 / row[0] / 1e3:6.1f} {row[1]:8.0f}")


def trace_hidden(bundle, calls: int, top: int = 6) -> None:
    """The draft's hidden pass at batch 1 under jax.profiler: its costliest compiled ops, us per call.
    (The profiler inflates short ops; the long ones are what to read.)"""
    import collections
    import glob
    import gzip
    import json
    import tempfile

    model, weights = bundle.model, bundle.weights
    state, _ = started_state(model, weights, 1, sampling.SamplingParams.greedy(1))
    fns, args = programs(model, weights, state, 1, "current")
    hidden = fns[0]
    for _ in range(10):
        jax.block_until_ready(hidden(*args))
    folder = tempfile.mkdtemp()
    jax.profiler.start_trace(folder)
    for _ in range(calls):
        jax.block_until_ready(hidden(*args))
    jax.profiler.stop_trace()
    events = json.load(gzip.open(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True)[0]))["traceEvents"]
    per_op = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and ("fusion" in e["name"] or e["name"].startswith("dot")):
            per_op[e["name"]] += e.get("dur", 0) / calls
    ops = {op.split(" = ")[0].strip().lstrip("%"): op for op in hidden.as_text().splitlines() if " = " in op}
    print(f"\nthe draft's hidden pass at batch 1 under the profiler ({calls} calls): costliest ops, us per call")
    for name, us in per_op.most_common(top):
        line = ops.get(name, "")
        shape = line.split(" = ")[1].split(" ")[0] if line else "?"
        where = line.split('op_name="')[1].split('"')[0].split("/")[-2:] if 'op_name="' in line else ["?"]
        print(f"{us:8.1f}  {name:18s} {shape:22s} {'/'.join(where)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default="dspark_jax/assets/default")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    bundle = load_bundle(args.bundle)
    for batch in (int(b) for b in args.batches.split(",")):
        ab_table(bundle, batch, args.calls)
    weight_read_table(bundle.model.cfg.vocab_size, bundle.model.cfg.dim, args.calls)
    trace_hidden(bundle, 50)
    print(f"(jax {jax.__version__}, {jax.devices()[0].platform}; CPU figures on this machine)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
