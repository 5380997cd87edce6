"""Running drafts of a bundle on held-out prompts: the embedded default model, its draft variants,
prompt records -> engine requests, and timed runs (with the STS calibration records when asked).

Shared by `dspark demo`, `dspark bench acceptance` and scripts/fit_calibration.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from dspark_jax import assets
from dspark_jax import drafts
from dspark_jax import spec_round as sr
from dspark_jax.bundle import INVARIANT_CALIBRATION, coupling_temperatures, unflatten_strict
from dspark_jax.calibration import Calibration
from dspark_jax.checkpoint.safetensors_io import open_checkpoint
from dspark_jax.errors import UserError
from dspark_jax.serve.engine import Engine, Metrics, Request
from dspark_jax.serve.request_check import prompt_record
from dspark_jax.validation import is_int


def default_dir() -> Path | None:
    return assets.default_bundle_path()


def missing_default_message(what: str, random_tiny: bool = True) -> str:
    msg = (f"{what}: the embedded default model is not installed (no dspark_jax/assets/default/bundle.json).\n"
           "  Rebuild it with `bash scripts/build_default.sh` (a few hours on 2 CPU cores), or pass --bundle DIR")
    if random_tiny:
        msg += (",\n  or run `dspark demo --random-tiny` for a plumbing check on random weights (acceptance,"
                " speed-up and text are then meaningless)")
    return msg + "."


def load_variant(bundle, name: str):
    """(SpecModel, Weights, Calibration | None) of draft `name` against the bundle's backbone: 'dspark' is
    the bundle's own draft; other names load <bundle>/variants/<name>/{draft.json, draft.safetensors,
    calibration.json} strictly (every tensor present with its shape, nothing else)."""
    if name == "dspark":
        return bundle.model, bundle.weights, bundle.calibration
    vdir = Path(bundle.path) / "variants" / name
    if not (vdir / "draft.json").is_file():
        raise FileNotFoundError(f"{vdir}: no draft.json (variant '{name}' is not in this bundle)")
    cfg = drafts.load_config(vdir / "draft.json")
    params = unflatten_strict(open_checkpoint(vdir / "draft.safetensors"), drafts.abstract_params(cfg),
                              str(vdir / "draft.safetensors"))
    cal = Calibration.load(vdir / "calibration.json") if (vdir / "calibration.json").is_file() else None
    inv_path = vdir / INVARIANT_CALIBRATION
    inv = Calibration.load(inv_path) if inv_path.is_file() else None
    temps = coupling_temperatures(cal, inv, cfg.block_size)
    model = sr.SpecModel(bundle.model.backbone, cfg, tap_mode=bundle.model.tap_mode, impl=bundle.model.impl)
    return model, sr.Weights(bundle.weights.backbone, params, bundle.weights.tied, temps), cal


def save_variant(bundle_dir, name: str, cfg, params: dict, dtype) -> None:
    """Write draft `name` as a variant of the bundle in `bundle_dir`, the folder `load_variant` reads:
    variants/<name>/draft.json (the config) and draft.safetensors (the parameters cast to `dtype`)."""
    from dspark_jax.bundle import flatten  # noqa: PLC0415
    from dspark_jax.checkpoint.safetensors_io import save_file  # noqa: PLC0415

    vdir = Path(bundle_dir) / "variants" / name
    vdir.mkdir(parents=True, exist_ok=True)
    (vdir / "draft.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    save_file(vdir / "draft.safetensors",
              {k: np.asarray(v, np.float32).astype(dtype) for k, v in flatten(params).items()})


def with_temperatures(weights, temperatures):
    return weights._replace(temperatures=jnp.asarray(temperatures, jnp.float32))


def read_prompts(path, limit: int | None = None) -> list[dict]:
    """The first `limit` (None: all) prompt records of a JSONL file; a bad line is a UserError naming the
    file and line (`request_check.prompt_record`, the parser `dspark generate` uses; other keys, e.g. the
    held-out files' "path", are kept as metadata)."""
    if limit is not None and (not is_int(limit) or limit < 1):
        # 0 used to mean "all" (`recs[:limit] if limit`); a count of prompts is at least one.
        raise UserError(f"prompts limit: expected an integer >= 1 (None: all), got {limit!r}")
    path = Path(path)
    lines = path.read_bytes().splitlines()  # a missing file: an OSError naming it (one line at the CLI)
    recs = []
    for number, raw in enumerate(lines, 1):
        try:
            rec = prompt_record(raw)
        except UserError as err:
            raise UserError(f"{path} line {number}: {err}") from None
        if rec is not None:
            recs.append(rec)
    if not recs:
        raise UserError(f"{path}: no prompts (every line is blank)")
    return recs if limit is None else recs[:limit]


def make_requests(prompts: list[dict], tokenizer, *, max_tokens: int, temperature: float, seed0: int = 0,
                  max_prompt_tokens: int = 192):
    """Engine requests from prompt records ({"prompt": text} or {"tokens": ids}); long prompts keep their
    last `max_prompt_tokens` tokens (the end is what the model continues)."""
    reqs = []
    for i, rec in enumerate(prompts):
        ids = list(rec["tokens"]) if "tokens" in rec else tokenizer.encode(rec["prompt"]).ids
        reqs.append(Request(ids[-max_prompt_tokens:], max_tokens=max_tokens, temperature=temperature,
                            seed=seed0 + i, id=rec.get("id", i)))
    return reqs


def recording_engine(model, weights, config, cost_table=None):
    """An Engine that also keeps, per active request-round, the raw confidence logits, the verify length
    and the accepted count (the STS calibration records: `engine.take_records()`)."""
    return Engine(model, weights, dataclasses.replace(config, record_rounds=True), cost_table=cost_table)


def timed_generate(engine, requests, warmup_tokens: int = 16):
    """Warm up (compile) on the same prompts with short budgets, then run and return (results, Metrics)
    of the measured run only."""
    engine.metrics = Metrics(engine.k)  # the warm-up must not land in a previous run's metrics object
    if warmup_tokens:
        # The first round after the prompt verifies min(K, max_tokens - 2) drafts, so these budgets compile
        # every verify-width bucket (1, 2, 4, ..., K+1) and the prompt bucket before the timed run.
        budgets = sorted({min(b, r.max_tokens) for r in requests for b in (2, 3, 5, 9, warmup_tokens)})
        for b in budgets:
            engine.generate([dataclasses.replace(r, max_tokens=b) for r in requests])
    engine.metrics = Metrics(engine.k)
    if hasattr(engine, "take_records"):
        engine.take_records()
    results = engine.generate(requests)
    return results, engine.metrics
