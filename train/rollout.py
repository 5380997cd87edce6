"""Rollouts on the shared speculative round (`dspark_jax.spec_round`): on-policy data regeneration,
tau / per-position acceptance measurement, and confidence records for `dspark calibrate`.

    model, weights = trainer.spec_pair()            # or sr.SpecModel(...), sr.Weights(...)
    res = rollout(model, weights, prompts, RolloutConfig(max_new_tokens=256, temperature=1.0))
    res.tau, res.acceptance                          # SPEC 9 definitions (serve.engine.Metrics)
    write_calibration_records("rounds.jsonl", res.records)       # -> dspark calibrate rounds.jsonl
    write_training_jsonl("regen.jsonl", prompts, res.responses)  # -> a data.train file

Every round runs with the round's "fixed" admission (each row verifies min(num_verify, tokens left - 1)
drafts) at one compiled width (1 + num_verify), so the records label every verified position.
Because verification is lossless, the responses are distributed exactly as the backbone's own
samples (with temperature 0: its greedy continuation): on-policy data for the draft. Prompts run in
static batches of `batch_size` slots (rollouts are offline; the serving engine does continuous
batching).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import sampling
from dspark_jax import spec_round as sr
from dspark_jax.serve.engine import Metrics


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    num_verify: int | None = None  # drafts verified per round (None = the block size K)
    batch_size: int = 8
    seed: int = 0
    stop_tokens: tuple[int, ...] = ()


@dataclasses.dataclass
class RolloutResult:
    responses: list[list[int]]  # generated tokens per prompt (after the prompt)
    records: list[dict]  # one per row-round with >= 1 verified draft: {"logits", "num_accepted", "num_verified"}
    metrics: Metrics

    @property
    def tau(self) -> float:
        return self.metrics.tau

    @property
    def acceptance(self) -> np.ndarray:
        return self.metrics.acceptance


def rollout(model: sr.SpecModel, weights: sr.Weights, prompts: Sequence[Sequence[int]],
            cfg: RolloutConfig = RolloutConfig()) -> RolloutResult:
    k = model.block_size
    num_verify = k if cfg.num_verify is None else int(cfg.num_verify)
    if not 0 <= num_verify <= k:
        raise ValueError(f"num_verify: expected an integer in [0, {k}], got {cfg.num_verify}")
    if cfg.max_new_tokens < 1 or cfg.batch_size < 1:
        raise ValueError("max_new_tokens and batch_size must be >= 1")
    vocab = model.backbone.vocab_size
    for i, p in enumerate(prompts):
        if len(p) == 0 or any(not 0 <= int(t) < vocab for t in p):
            raise ValueError(f"prompt {i}: expected a non-empty list of token ids in [0, {vocab})")
    sampling.validate([cfg.temperature], [cfg.top_k], [cfg.top_p])
    start = jax.jit(sr.start, static_argnums=0)
    round_fn = jax.jit(sr.spec_round, static_argnums=0, static_argnames=("width", "mode", "filtering"))
    filtering = cfg.top_k > 0 or cfg.top_p < 1
    metrics = Metrics(k)
    responses: list[list[int]] = [[] for _ in prompts]
    records: list[dict] = []
    b = cfg.batch_size
    stops = set(int(t) for t in cfg.stop_tokens)
    for lo in range(0, len(prompts), b):
        rows = list(range(lo, min(lo + b, len(prompts))))
        longest = max(len(prompts[i]) for i in rows)
        max_len = longest + cfg.max_new_tokens + k + 2
        prompt = np.zeros((b, longest), np.int32)
        plen = np.ones((b,), np.int32)
        joining = np.zeros((b,), bool)
        seeds = np.zeros((b,), np.uint32)
        for s, i in enumerate(rows):
            prompt[s, :len(prompts[i])] = prompts[i]
            plen[s], joining[s] = len(prompts[i]), True
            seeds[s] = (cfg.seed * 1_000_003 + i) % 2 ** 32
        params = sampling.SamplingParams.make(b, cfg.temperature, cfg.top_k, cfg.top_p)
        state = sr.init_state(model, b, max_len)
        state, first = start(model, weights, state, jnp.asarray(prompt), jnp.asarray(plen), jnp.asarray(joining),
                             params, jnp.asarray(seeds))
        active = joining.copy()
        first = np.asarray(first)
        for s, i in enumerate(rows):
            active[s] = _append(responses[i], [int(first[s])], cfg.max_new_tokens, stops)
        while active.any():
            cap = np.zeros((b,), np.int32)
            for s, i in enumerate(rows):
                cap[s] = max(0, min(num_verify, cfg.max_new_tokens - len(responses[i]) - 1)) if active[s] else 0
            state, out = round_fn(model, weights, state, params, jnp.asarray(seeds), jnp.asarray(active),
                                  width=1 + num_verify, mode="fixed", num_verify=jnp.full((b,), num_verify, jnp.int32),
                                  draft_cap=jnp.asarray(cap), filtering=filtering)
            out = jax.device_get(out._asdict())
            metrics.record(out["num_verify"], out["num_accepted"], out["num_emitted"], active)
            for s, i in enumerate(rows):
                if not active[s]:
                    continue
                m = int(out["num_verify"][s])
                if m > 0:
                    records.append({"logits": [float(z) for z in out["conf_logits"][s]],
                                    "num_accepted": int(out["num_accepted"][s]), "num_verified": m})
                n = int(out["num_emitted"][s])
                active[s] = _append(responses[i], out["tokens"][s, :n].tolist(), cfg.max_new_tokens, stops)
    return RolloutResult(responses, records, metrics)


def _append(response: list[int], tokens: list[int], limit: int, stops: set[int]) -> bool:
    """Append until a stop token or the limit; -> whether the row stays active."""
    for t in tokens:
        response.append(int(t))
        if t in stops or len(response) >= limit:
            return False
    return True


def write_calibration_records(path: str | os.PathLike, records: list[dict]) -> None:
    """JSON lines `{"logits": [z_1..z_K], "num_accepted": n, "num_verified": m}` (`dspark calibrate`)."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def write_training_jsonl(path: str | os.PathLike, prompts: Sequence[Sequence[int]],
                         responses: Sequence[Sequence[int]]) -> None:
    """Regenerated data: `{"tokens": prompt + response, "loss_mask": [0]*len(prompt) + [1]*len(response)}`."""
    with open(path, "w") as f:
        for p, r in zip(prompts, responses):
            f.write(json.dumps({"tokens": [int(t) for t in p] + [int(t) for t in r],
                                "loss_mask": [0] * len(p) + [1] * len(r)}) + "\n")
