"""Time the engine's plain step program three ways at the embedded sizes: without the draft (the plain
baseline), with the draft ingesting each step's position, and with the ingest deferred to a batched
catch-up every 8 calls (what a speculative engine runs when it verifies nothing).

    python scripts/profile_plain_step.py [BUNDLE]      # default: dspark_jax/assets/default_qwen3

Prints the median ms per plain step (4 steps per call, every slot running), best of two passes.
"""

import sys
import time

import jax
import numpy as np

from dspark_jax.bundle import load_bundle
from dspark_jax.serve import decode_state as ds
from dspark_jax.serve.engine import Request

MAX_LEN = 512


def step_ms(model, weights, rows, batch: int, ingest: bool, deferred: int, calls: int = 48) -> float:
    state = ds.init(model, batch, MAX_LEN, 1, deferred)
    state, _ = ds.ADMIT(model, weights, state, jax.device_put(rows), max_len=MAX_LEN)
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        if deferred and i % 8 == 7:
            state = ds.CATCH_UP(model, weights, state)
        state, d = ds.PLAIN_ROUNDS(model, weights, state, rounds=4, max_len=MAX_LEN, ingest_draft=ingest)
        jax.block_until_ready(d)
        times.append((time.perf_counter() - t0) / 4)
    return float(np.median(times[8:])) * 1e3


def main(path: str) -> None:
    bundle = load_bundle(path)
    for batch in (1, 8, 32):
        prompts = [[1 + i] * 16 for i in range(batch)]
        reqs = [Request(p, max_tokens=MAX_LEN) for p in prompts]
        rows = ds.joining_rows(list(range(batch)), prompts, reqs, batch, MAX_LEN, 1, 16)
        ways = {"plain": (False, 0), "ingest each step": (True, 0), "deferred ingest": (True, 32)}
        best = {name: min(step_ms(bundle.model, bundle.weights, rows, batch, *how) for _ in range(2))
                for name, how in ways.items()}
        print(f"batch {batch:>2}: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in best.items()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "dspark_jax/assets/default_qwen3")
