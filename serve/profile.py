"""Measure the cost table (SPEC 6) on the serving engine itself, over the verify widths it compiles.

SPS(B) is 1 / (seconds per round) of an engine in mode "fixed" with `num_verify = width - 1`, for each
verify width the engine compiles (schedule.width_buckets), every slot busy, in steady state: the
overlapped loop at the engine's rounds per call, where a step's wall time is the device's time for its
rounds once the pipeline is full (the median of a few steps, the best of two sweeps over the widths).
So B = slots * width batch tokens, and the draft pass is inside the timed round. Width 1 (nothing
verified) is the plain step program, what the engine runs when it verifies nothing: Theta(0) is plain
decoding's rate, and the scheduler speculates only when that is predicted to beat plain decoding. The
table is made monotone by CostTable (with a warning) if noise demands it.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from tqdm.auto import tqdm

from dspark_jax import spec_round as sr
from dspark_jax import user_cache
from dspark_jax.schedule import CostTable, width_buckets
from dspark_jax.serve.engine import Engine, EngineConfig, Request


def round_seconds(engine, requests, *, warmup: int = 3, repeats: int = 5) -> float:
    """Median wall seconds per round of an engine in steady state (every request running throughout; a
    step runs `rounds_per_call` rounds)."""
    for r in requests:
        engine.submit(r)
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(repeats):
        before = engine.metrics.rounds
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) / max(engine.metrics.rounds - before, 1))
    engine.cancel_all()  # the requests outlive the measurement on purpose
    while not engine.idle:
        engine.step()
    return float(np.median(times))


def profile_cost_table(model: sr.SpecModel, weights: sr.Weights, *, slots: int, max_len: int,
                       widths=None, repeats: int = 5, sweeps: int = 2, prompt_len: int = 8, progress: bool = True,
                       seed: int = 0) -> CostTable:
    """The cost table of an engine with `slots` slots: `sweeps` passes over the widths (each width's
    best median is kept, so a slow spell of a shared machine during one pass does not skew one width
    against the others)."""
    k = model.block_size
    widths = sorted(set(widths or width_buckets(k)))
    rng = np.random.default_rng(seed)
    # Rounds per call as the engine serves (its default), or fewer when the cache cannot hold that many
    # rounds of up to K+1 tokens each (warm-up, timed and in-flight steps).
    calls = 4 + repeats
    per_call = min(EngineConfig.rounds_per_call, (max_len - prompt_len - 2) // (calls * (k + 1)))
    if per_call < 1:
        raise ValueError(f"profile: max_len {max_len} is too short for {calls} rounds of up to {k + 1} tokens "
                         f"after a {prompt_len}-token prompt")
    requests = [Request(rng.integers(0, model.backbone.vocab_size, prompt_len).tolist(), max_tokens=max_len,
                        temperature=1.0, seed=i) for i in range(slots)]
    seconds = {w: float("inf") for w in widths}
    bar = tqdm(total=sweeps * len(widths), desc="profiling verify widths", disable=not progress)
    for _ in range(sweeps):
        for w in widths:
            # "lazy": the profile runs one width per engine and warms up what it times itself; compiling
            # every program of every one of these engines ahead of time would be all waste.
            engine = Engine(model, weights, EngineConfig(max_slots=slots, max_len=max_len, mode="fixed",
                                                         num_verify=w - 1, progress=False,
                                                         rounds_per_call=per_call, compile="lazy"))
            seconds[w] = min(seconds[w], round_seconds(engine, requests, repeats=repeats))
            bar.update()
    bar.close()
    sps = np.asarray([1.0 / seconds[w] for w in widths], np.float32)
    return CostTable(np.asarray([slots * w for w in widths]), sps, max_batch_tokens=slots * (k + 1))


def cached_cost_table(bundle, *, slots: int, max_len: int, progress: bool = True) -> tuple[CostTable, str]:
    """The bundle's cost table for this machine, slot count and cache length: measured once, then read
    back from the user's cache folder (dspark_jax/user_cache.py: keyed by the bundle's content, the machine
    and the shape; nothing is written inside the bundle or the package). A bundle without a folder (random
    weights) is measured every time. -> (table, where it came from)."""
    if bundle.path is None:
        table = profile_cost_table(bundle.model, bundle.weights, slots=slots, max_len=max_len, progress=progress)
        return table, "measured now (a bundle without a folder is not cached)"
    path = user_cache.cost_table_path(bundle.path, jax.devices()[0], slots=slots, max_len=max_len)
    if path.is_file():
        return CostTable.from_json(path), f"cached {path}"
    table = profile_cost_table(bundle.model, bundle.weights, slots=slots, max_len=max_len, progress=progress)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        table.to_json(path)
    except OSError as err:
        return table, f"measured now (not cached: {path}: {err.strerror})"
    return table, f"measured now, cached at {path}"
