"""The embedded default model (dspark_jax/assets/default): strict loading and lossless greedy decoding.

Skipped when the assets are absent (a checkout without the trained weights).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dspark_jax import assets

DEFAULT = assets.default_bundle_path()
pytestmark = pytest.mark.skipif(DEFAULT is None, reason="embedded default model not present")


@pytest.fixture(scope="module")
def bundle():
    from dspark_jax.bundle import load_bundle

    return load_bundle(DEFAULT)


def test_bundle_contents(bundle):
    meta = json.loads((DEFAULT / "bundle.json").read_text())
    assert meta["backbone"]["family"] == "mhc"
    assert bundle.model.block_size == 7 and bundle.model.cfg.markov_rank > 0
    assert bundle.tokenizer is not None and bundle.tokenizer.get_vocab_size() == bundle.model.backbone.vocab_size
    assert bundle.tokenizer.token_to_id("<|noise|>") == bundle.model.cfg.noise_token_id
    assert bundle.calibration is not None and bundle.calibration.num_positions == 7
    prompts = [json.loads(line) for line in open(DEFAULT / "prompts.jsonl")]
    assert len(prompts) >= 8 and all(p["prompt"] for p in prompts)


def test_variants_load_strictly(bundle):
    from dspark_jax.bench.acceptance import load_variant

    for name, block, rank0 in (("parallel", 7, True), ("onetoken", 1, False)):
        model, weights, cal = load_variant(bundle, name)
        assert model.block_size == block
        assert (model.cfg.markov_rank == 0) == rank0
        assert model.backbone is bundle.model.backbone
        assert cal is not None and cal.num_positions == block


def test_strict_loading_rejects_extra_and_missing_tensors(tmp_path):
    from dspark_jax.bundle import load_bundle
    from dspark_jax.checkpoint.safetensors_io import CheckpointError, open_checkpoint, save_file

    src = open_checkpoint(DEFAULT / "draft.safetensors")
    tensors = {n: np.asarray(src.read(n)) for n in src.names}
    for case in ("extra", "missing"):
        d = tmp_path / case
        shutil.copytree(DEFAULT, d, ignore=shutil.ignore_patterns("variants"))
        bad = dict(tensors)
        if case == "extra":
            bad["unexpected.weight"] = np.zeros((2, 2), np.float32)
        else:
            bad.pop(sorted(bad)[0])
        save_file(d / "draft.safetensors", bad)
        with pytest.raises(CheckpointError, match="unexpected" if case == "extra" else "missing"):
            load_bundle(d)


@pytest.mark.slow  # ~40 s of compiles; test_spec_round.py checks the same property at default speed
def test_greedy_speculative_equals_plain(bundle):
    from dspark_jax.bench.acceptance import make_requests, read_prompts
    from dspark_jax.serve.engine import Engine, EngineConfig

    prompts = read_prompts(DEFAULT / "prompts.jsonl", 2)
    reqs = make_requests(prompts, bundle.tokenizer, max_tokens=24, temperature=0.0, max_prompt_tokens=64)
    outs = {}
    for mode in ("plain", "off"):
        eng = Engine(bundle.model, bundle.weights, EngineConfig(max_slots=2, max_len=128, mode=mode, progress=False))
        outs[mode] = [r.tokens for r in eng.generate(reqs)]
        if mode == "off":
            assert eng.metrics.rounds >= 1 and eng.metrics.tau >= 1.0
    assert all(len(t) == 24 for t in outs["plain"])
    assert outs["off"] == outs["plain"]
