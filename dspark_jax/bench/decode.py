"""`dspark bench decode`: speculative vs plain decoding tokens/s, with L = (T_draft + T_verify) / tau.

Both engines serve the same requests in the same process (compiled programs warmed up first). The
split is measured on the same model: T_draft = one jitted draft propose, T_verify = one backbone
forward over K+1 tokens, both at the batch's slot count; tau comes from the speculative run.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import draft as draft_lib
from dspark_jax import sampling
from dspark_jax import spec_round as sr
from dspark_jax.serve.cli_common import add_model_arguments, load_model
from dspark_jax.serve.engine import Engine, EngineConfig, Request


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--batches", default="1,8", help="comma-separated slot counts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=5)


def _median_time(fn, repeats):
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _prompts(bundle, n, seed=0):
    rng = np.random.default_rng(seed)
    if bundle.tokenizer is not None and bundle.path is not None and (bundle.path / "prompts.jsonl").is_file():
        import json

        lines = (bundle.path / "prompts.jsonl").read_text().splitlines()
        texts = [json.loads(x)["prompt"] for x in lines if x.strip()]
        return [bundle.tokenizer.encode(texts[i % len(texts)]).ids for i in range(n)]
    return [rng.integers(0, bundle.model.backbone.vocab_size, 12).tolist() for _ in range(n)]


def split_times(model: sr.SpecModel, weights: sr.Weights, batch: int, repeats: int):
    """(T_draft, T_verify) seconds per round at `batch` slots, K+1 verify tokens."""
    k = model.block_size
    state = sr.init_state(model, batch, 256)
    sp = sampling.SamplingParams.make(batch, temperature=1.0)
    seeds = jnp.arange(batch, dtype=jnp.uint32)
    prompt = jnp.ones((batch, 16), jnp.int32)
    state, _ = jax.jit(sr.start, static_argnums=0)(model, weights, state, prompt, jnp.full((batch,), 16),
                                                    jnp.ones(batch, bool), sp, seeds)
    prop = jax.jit(lambda w, s: draft_lib.propose(w.draft, w.tied, model.cfg, s.draft, s.anchor, sp, seeds,
                                                  impl=model.impl, filtering=False))
    toks = jnp.ones((batch, k + 1), jnp.int32)
    ver = jax.jit(lambda w, s: model.backbone.forward(w.backbone, s.cache, toks, taps=model.cfg.target_layer_ids,
                                                      tap_mode=model.tap_mode))
    return _median_time(lambda: prop(weights, state), repeats), _median_time(lambda: ver(weights, state), repeats)


def run(args: argparse.Namespace) -> int:
    bundle = load_model(args)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        reqs = [Request(p, max_tokens=args.max_tokens, temperature=args.temperature, seed=i, id=i)
                for i, p in enumerate(_prompts(bundle, b))]
        res = {}
        for mode in ("plain", "off"):
            ec = EngineConfig(max_slots=b, max_len=256, mode=mode, progress=False)
            Engine(bundle.model, bundle.weights, ec).generate(reqs)  # warm-up: compiles every width it uses
            eng = Engine(bundle.model, bundle.weights, ec)
            eng.generate(reqs)
            res[mode] = eng.metrics
        t_draft, t_verify = split_times(bundle.model, bundle.weights, max(b, 2), args.repeats)
        tau = res["off"].tau
        rows.append((b, res["plain"].tokens_per_s, res["off"].tokens_per_s, tau, t_draft * 1e3, t_verify * 1e3,
                     (t_draft + t_verify) / tau * 1e3, res["off"].tokens_per_s / res["plain"].tokens_per_s))
    print(f"{'batch':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'tau':>5} {'T_draft ms':>10} {'T_verify ms':>11} "
          f"{'L=(Td+Tv)/tau ms':>16} {'speedup':>7}")
    for r in rows:
        print(f"{r[0]:>5} {r[1]:>11.1f} {r[2]:>10.1f} {r[3]:>5.2f} {r[4]:>10.2f} {r[5]:>11.2f} {r[6]:>16.2f} {r[7]:>7.2f}")
    print(f"(CPU, {jax.devices()[0].platform}; K={bundle.model.block_size}; temperature {args.temperature}; "
          f"L is per request-round; tokens/s over all requests)")
    return 0
