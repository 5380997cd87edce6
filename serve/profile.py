"""Measure the cost table (SPEC 6) on the engine's own jitted round, over the widths it compiles.

SPS(B) is 1 / (median seconds per round) with all slots active and every row verifying width - 1
drafts, so B = slots * width batch tokens; the draft pass is inside the timed round, as it should be
when its cost matters. The table is made monotone by CostTable (with a warning) if noise demands it.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from dspark_jax import sampling
from dspark_jax import spec_round as sr
from dspark_jax.schedule import CostTable


def profile_cost_table(model: sr.SpecModel, weights: sr.Weights, *, slots: int, max_len: int,
                       widths=None, repeats: int = 5, prompt_len: int = 8, progress: bool = True,
                       seed: int = 0) -> CostTable:
    k = model.block_size
    widths = sorted(set(widths or range(1, k + 2)))
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(0, model.backbone.vocab_size, (slots, prompt_len)), jnp.int32)
    plen = jnp.full((slots,), prompt_len)
    active = jnp.ones((slots,), bool)
    sp = sampling.SamplingParams.make(slots, temperature=1.0)
    seeds = jnp.arange(slots, dtype=jnp.uint32)
    from dspark_jax.serve.engine import _ROUND as rnd
    from dspark_jax.serve.engine import _START

    # The engine's own jitted programs (shared with every Engine), so the table times what serving runs.
    state0, _ = _START(model, weights, sr.init_state(model, slots, max_len), prompt, plen, active, sp, seeds)
    batch_tokens, sps = [], []
    for w in tqdm(widths, desc="profiling verify widths", disable=not progress):
        nv = jnp.full((slots,), w - 1, jnp.int32)
        run = lambda st: rnd(model, weights, st, sp, seeds, active, width=w, mode="fixed",  # noqa: E731
                             num_verify=nv, draft_cap=nv, filtering=False)
        jax.block_until_ready(run(state0))  # compile
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(run(state0))
            times.append(time.perf_counter() - t0)
        batch_tokens.append(slots * w)
        sps.append(1.0 / float(np.median(times)))
    return CostTable(np.asarray(batch_tokens), np.asarray(sps, np.float32), max_batch_tokens=slots * (k + 1))
