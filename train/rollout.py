"""Rollouts on the shared speculative round (`dspark_jax.spec_round`): on-policy data regeneration,
tau / per-position acceptance measurement, and confidence records for `dspark calibrate`.

    model, weights = trainer.spec_pair()            # or sr.SpecModel(...), sr.Weights(...)
    res = rollout(model, weights, prompts, RolloutConfig(max_new_tokens=256, temperature=1.0))
    res.tau, res.acceptance                          # SPEC 9 definitions (serve.engine.Metrics)
    write_calibration_records("rounds.jsonl", res.records)       # -> dspark calibrate rounds.jsonl
    write_training_jsonl("regen.jsonl", prompts, res.responses)  # -> a data.train file

Rollouts run on the serving engine (`dspark_jax.serve.engine`, mode "fixed": each row verifies
min(num_verify, tokens left - 1) drafts), so the records label every verified position. Because
verification is lossless, the responses are distributed exactly as the backbone's own samples (with
temperature 0: its greedy continuation): on-policy data for the draft. Prompts share `batch_size`
slots with continuous batching.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np

from dspark_jax import sampling
from dspark_jax import spec_round as sr
from dspark_jax.serve.engine import Engine, EngineConfig, Metrics, Request
from dspark_jax.train.regenerate import cache_len_for, training_record


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
    engine = Engine(model, weights, EngineConfig(
        max_slots=cfg.batch_size, max_len=cache_len_for(prompts, cfg.max_new_tokens, k), mode="fixed", num_verify=num_verify,
        max_stop_tokens=max(1, len(cfg.stop_tokens)), progress=False, record_rounds=True))
    requests = [Request([int(t) for t in p], max_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                        top_k=cfg.top_k, top_p=cfg.top_p, seed=(cfg.seed * 1_000_003 + i) % 2 ** 32,
                        stop_tokens=tuple(int(t) for t in cfg.stop_tokens), id=i)
                for i, p in enumerate(prompts)]
    results = engine.generate(requests)
    rec = engine.take_records()
    records = [{"logits": [float(z) for z in logits], "num_accepted": int(a), "num_verified": int(m)}
               for logits, a, m in zip(rec["logits"], rec["num_accepted"], rec["num_verified"]) if m > 0]
    return RolloutResult([r.tokens for r in results], records, engine.metrics)


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
            f.write(json.dumps(training_record(p, r)) + "\n")
