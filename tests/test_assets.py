"""The embedded default models (dspark_jax.assets): the mHC + V4.1 default (assets/default) and the Qwen3 +
DeepSpec one (assets/default_qwen3): contents, strict loading, the DeepSpec export of the second, and lossless
greedy decoding.

Each test is skipped when its assets are absent (a checkout without the trained weights).
"""

from __future__ import annotations

import json
import shutil

import functools

import jax
import numpy as np
import pytest
from helpers import REPO

from dspark_jax import assets
from dspark_jax.checkpoint import deepspec as ckpt

DEFAULT = assets.default_bundle_path()
needs_default = pytest.mark.skipif(DEFAULT is None, reason="embedded default model not present")


@pytest.fixture(scope="module")
def bundle():
    from dspark_jax.bundle import load_bundle

    return load_bundle(DEFAULT)


@needs_default
def test_bundle_contents(bundle):
    meta = json.loads((DEFAULT / "bundle.json").read_text())
    assert meta["backbone"]["family"] == "mhc"
    assert bundle.model.block_size == 7 and bundle.model.cfg.markov_rank > 0
    assert bundle.tokenizer is not None and bundle.tokenizer.get_vocab_size() == bundle.model.backbone.vocab_size
    assert bundle.tokenizer.token_to_id("<|noise|>") == bundle.model.cfg.noise_token_id
    assert bundle.calibration is not None and bundle.calibration.num_positions == 7
    prompts = [json.loads(line) for line in open(DEFAULT / "prompts.jsonl")]
    assert len(prompts) >= 8 and all(p["prompt"] for p in prompts)


@needs_default
def test_variants_load_strictly(bundle):
    from dspark_jax.evaluation import load_variant

    for name, block, rank0 in (("parallel", 7, True), ("onetoken", 1, False)):
        model, weights, cal = load_variant(bundle, name)
        assert model.block_size == block
        assert (model.cfg.markov_rank == 0) == rank0
        assert model.backbone is bundle.model.backbone
        assert cal is not None and cal.num_positions == block


@needs_default
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


@needs_default
@pytest.mark.slow  # ~40 s of compiles; test_spec_round.py checks the same property at default speed
def test_greedy_speculative_equals_plain(bundle):
    from dspark_jax.evaluation import make_requests, read_prompts
    from dspark_jax.serve.engine import Engine, EngineConfig

    prompts = read_prompts(DEFAULT / "prompts.jsonl", 2)
    reqs = make_requests(prompts, bundle.tokenizer, max_tokens=24, temperature=0.0, max_prompt_tokens=64)
    outs = {}
    for mode in ("plain", "off"):
        eng = Engine(bundle.model, bundle.weights, EngineConfig(max_slots=2, max_len=128, mode=mode, progress=False))
        outs[mode] = [r.tokens for r in eng.generate(reqs)]
        if mode == "off":
            # The trained draft is accepted: tau (tokens per request-round, the bonus token included) is
            # 1.586 here (17 drafts accepted in 29 request-rounds; acc@1 0.56, measured on CPU). These two
            # prompts are the set's hardest at 24 tokens (the 16 prompts give 1.86, and 2.10 at 56 tokens;
            # BENCHMARKS.md: 2.23 at 128). A draft that is never accepted gives exactly 1.0 (a randomised
            # draft did: 46 rounds, 0 accepted), so 1.3 fails it by ~9 accepted drafts and leaves the
            # trained draft ~8 (0.29 of tau) of room for numerics that flip a near-tied argmax.
            assert eng.metrics.rounds >= 1 and eng.metrics.tau >= 1.3, eng.metrics.summary()
    assert all(len(t) == 24 for t in outs["plain"])
    assert outs["off"] == outs["plain"]


# ---------------------------------------------------------------------------------------------------
# The second embedded default (dspark_jax/assets/default_qwen3; skipped when absent)
# ---------------------------------------------------------------------------------------------------

DEFAULT_QWEN3 = REPO / "dspark_jax" / "assets" / "default_qwen3"
needs_default_qwen3 = pytest.mark.skipif(not (DEFAULT_QWEN3 / "bundle.json").is_file(),
                                         reason="embedded default_qwen3 model not present")


@functools.lru_cache(maxsize=None)
def default_qwen3():
    from dspark_jax.bundle import load_bundle

    return load_bundle(DEFAULT_QWEN3, impl="xla")


@needs_default_qwen3
def test_default_qwen3_bundle_and_its_deepspec_export(tmp_path):
    b = default_qwen3()
    assert b.backbone_family == "qwen3" and b.model.cfg.family == "qwen3" and b.model.tap_mode == "output"
    assert b.model.block_size == 7 and b.model.cfg.markov_rank > 0 and b.model.cfg.enable_confidence_head
    assert b.tokenizer.token_to_id("<|noise|>") == b.model.cfg.mask_token_id
    assert b.calibration is not None and b.calibration.num_positions == 7
    # The committed draft leaves in the DeepSpec layout and comes back unchanged.
    tied = {k: np.asarray(v) for k, v in b.weights.tied.items()}
    ckpt.export_deepspec_draft(jax.device_get(b.weights.draft), tied, b.model.cfg, tmp_path / "out")
    cfg, params, tied2 = ckpt.load_deepspec_draft(tmp_path / "out", dtype="float32")
    assert cfg.replace(compute_dtype="float32") == b.model.cfg
    for (p, a), (_, c) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                              jax.tree_util.tree_flatten_with_path(jax.device_get(b.weights.draft))[0]):
        np.testing.assert_array_equal(a, c, err_msg=str(p))
    np.testing.assert_array_equal(tied2["embed"], tied["embed"])


@needs_default_qwen3
def test_default_qwen3_variants_load_strictly():
    # The comparison drafts (same data and budget as the DSpark draft) against the same target.
    from dspark_jax.evaluation import load_variant

    b = default_qwen3()
    for name, block, rank0 in (("parallel", 7, True), ("onetoken", 1, False)):
        model, weights, cal = load_variant(b, name)
        assert model.cfg.family == "qwen3" and model.block_size == block
        assert (model.cfg.markov_rank == 0) == rank0
        assert model.cfg.confidence_head_with_markov == (not rank0)
        assert model.backbone is b.model.backbone and model.tap_mode == "output"
        assert cal is not None and cal.num_positions == block


@needs_default_qwen3
@pytest.mark.slow
def test_default_qwen3_greedy_speculative_equals_plain_and_accepts():
    from dspark_jax.evaluation import make_requests, read_prompts
    from dspark_jax.serve.engine import Engine, EngineConfig

    b = default_qwen3()
    reqs = make_requests(read_prompts(DEFAULT_QWEN3 / "prompts.jsonl", 2), b.tokenizer, max_tokens=24,
                         temperature=0.0, max_prompt_tokens=64)
    outs, tau = {}, None
    for mode in ("plain", "off"):
        eng = Engine(b.model, b.weights, EngineConfig(max_slots=2, max_len=128, mode=mode, progress=False))
        outs[mode] = [r.tokens for r in eng.generate(reqs)]
        tau = eng.metrics.tau
    assert outs["off"] == outs["plain"] and all(len(t) == 24 for t in outs["plain"])
    assert tau > 1.2, tau  # the trained draft really gets drafts accepted (a random one gives ~1.0)


@pytest.mark.slow  # ~1 min of compiles per bundle (a plain and a speculative engine)
@pytest.mark.parametrize("which", ["default", "default_qwen3"])
def test_sampled_invariant_speculative_equals_plain_and_streams_to_its_text(which, request):
    """Issue 44 on both trained defaults (the V4.1 and the DeepSpec draft family): sampled requests (T = 1; T = 0.7 with top-p) under the invariant
    coupling emit plain decoding's tokens while the draft is accepted, and each output streamed token by token
    through TextStream (byte-level tokens, characters split across them) gives its whole decode."""
    import dataclasses

    from dspark_jax.evaluation import make_requests, read_prompts
    from dspark_jax.serve.engine import Engine, EngineConfig
    from dspark_jax.serve.openai_api import TextStream

    if which == "default":
        if DEFAULT is None:
            pytest.skip("embedded default model not present")
        bundle = request.getfixturevalue("bundle")
    else:
        if not (DEFAULT_QWEN3 / "bundle.json").is_file():
            pytest.skip("embedded default_qwen3 model not present")
        bundle = default_qwen3()
    prompts = read_prompts(bundle.path / "prompts.jsonl", 4)
    reqs = [dataclasses.replace(r, coupling="invariant", top_p=0.9 if i % 2 else 1.0, temperature=0.7 if i % 2 else 1.0)
            for i, r in enumerate(make_requests(prompts, bundle.tokenizer, max_tokens=48, temperature=1.0,
                                                max_prompt_tokens=64))]
    outs = {}
    for mode in ("plain", "off"):
        eng = Engine(bundle.model, bundle.weights, EngineConfig(max_slots=4, max_len=128, mode=mode, progress=False))
        outs[mode] = [r.tokens for r in eng.generate(reqs)]
        if mode == "off":
            assert eng.metrics.tau > 1.3, eng.metrics.summary()  # drafts are accepted under the invariant rule
    assert outs["off"] == outs["plain"]
    for tokens in outs["off"]:
        stream = TextStream(bundle.tokenizer, [])
        text = "".join(stream.push([t]) for t in tokens) + stream.push([], final=True)
        assert text == bundle.tokenizer.decode(tokens)
