"""bf16 compute, the dtype the V4.1 weights are trained and served in, on XLA:CPU.

XLA:CPU has no BF16 x BF16 = F32 dot; every mixed product goes through `nn.linear.mixed_einsum`, which
widens the operands on CPU (exact: a product of two bf16 numbers fits in f32) and keeps them bf16 on
TPU/GPU. Here: the backbones, both draft families and the spec round run at bf16 on CPU, stay bf16
where the official forward is bf16, and agree with the same weights run at f32 to bf16 accuracy.
The bit-level agreement of the V4.1 draft with the official rounding points is
drafts/v41/test_official_numerics.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CONFIGS, oracle_propose, padded
from helpers import random_prompts as prompts

from dspark_jax import drafts, sampling
from dspark_jax import spec_round as sr
from dspark_jax.backbones.mhc import MhcBackbone, MhcConfig
from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Config

PAIRS = {"mhc": "tiny_v41.json", "qwen3": "tiny_deepspec.json"}


# An MoE routing choice between near-tied experts flips under any bf16-level difference (SPEC 2.9) and
# then moves a token's output by O(1); the bf16-vs-f32 comparisons below measure the dense math, so
# their MoEs have a single routed expert. Likewise the fp8 rounding of KV rows turns a last-bit change
# near a rounding edge into a whole fp8 step (6%), so it is off here. Both are covered, at bf16, by
# drafts/v41/test_official_numerics.py.
ONE_EXPERT = {"n_routed_experts": 1, "n_activated_experts": 1, "kv_fp8": False}


def _configs(name: str, dtype: str):
    dt = {"param_dtype": dtype, "compute_dtype": dtype}
    if name == "mhc":
        bb = MhcBackbone(MhcConfig.from_json(CONFIGS / "tiny_mhc_backbone.json").replace(**dt, **ONE_EXPERT))
        cfg = drafts.load_config(CONFIGS / PAIRS[name]).replace(**dt, **ONE_EXPERT)
    else:
        bb = Qwen3Backbone(Qwen3Config.from_hf_json(CONFIGS / "tiny_qwen3_backbone.json").replace(**dt))
        cfg = drafts.load_config(CONFIGS / PAIRS[name]).replace(**dt)  # DeepSpec: no MoE, no fp8
    return bb, cfg


def _like(tree, abstract):
    """`tree`'s values rounded to bf16 (so both precisions hold the same numbers), in `abstract`'s dtypes."""
    return jax.tree.map(lambda x, a: jnp.asarray(x, jnp.bfloat16).astype(a.dtype), tree, abstract)


@functools.lru_cache(maxsize=None)
def models(name: str, dtype: str):
    """(SpecModel, Weights) at `dtype` compute; the same bf16-valued weights for both dtypes."""
    bb32, cfg32 = _configs(name, "float32")
    bb, cfg = _configs(name, dtype)
    bp = _like(bb32.init_params(jax.random.key(0)), bb.abstract_params())
    dp = _like(drafts.init_params(cfg32, jax.random.key(1)), drafts.abstract_params(cfg))
    model = sr.SpecModel(bb, cfg, impl="xla")
    return model, sr.Weights(bp, dp, bb.tied(bp), jnp.ones(cfg.block_size))


def _rel_err(got, want):
    """max |got - want| over the spread of want (logits are compared on the scale they vary on)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.std(want))


# Measured max error over the spread of the f32 logits (2 x 30 positions x 512 logits, tiny random
# models): mhc backbone 0.11, qwen3 backbone 0.06, drafts 0.05-0.15. bf16 rounds each activation by up
# to 2^-9 relative, dozens of times per layer; a dropped rounding point or an f32 leak would not fail
# this, but a bf16 value misread as another dtype, a lost scale or a wrong cast order (O(1) errors) does.
TOL = 0.3


@pytest.mark.parametrize("name", [pytest.param("mhc", marks=pytest.mark.slow), "qwen3"])  # mhc: ~40 s
def test_backbone_runs_at_bf16_and_agrees_with_f32(name):
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 30)), jnp.int32)
    out = {}
    for dt in ("float32", "bfloat16"):
        model, w = models(name, dt)
        bb = model.backbone
        out[dt] = bb.forward(w.backbone, bb.init_cache(2, 64), toks, taps=model.cfg.target_layer_ids,
                             tap_mode=model.cfg.tap_mode)
    bf = out["bfloat16"]
    assert bf.logits.dtype == jnp.float32 and bf.taps.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(bf.logits)))
    assert _rel_err(bf.logits, out["float32"].logits) < TOL
    assert _rel_err(bf.taps, out["float32"].taps) < TOL


def _draft_run(name: str, dtype: str):
    """prefill 30 / 21 positions, propose, ingest 3 / 1 rows, propose again."""
    model, w = models(name, dtype)
    cfg, b = model.cfg, 2
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(b, 30, cfg.main_hidden_dim)), jnp.bfloat16).astype(cfg.compute_dtype)
    sp, seeds = sampling.SamplingParams.greedy(b), jnp.arange(b, dtype=jnp.uint32)
    st = drafts.prefill(w.draft, cfg, drafts.init_state(cfg, b, 64), hidden, jnp.array([30, 21]))
    first = drafts.propose(w.draft, w.tied, cfg, st, jnp.array([3, 4]), sp, seeds)
    st = drafts.ingest(w.draft, cfg, st, hidden[:, :3], jnp.array([3, 1]))
    second = drafts.propose(w.draft, w.tied, cfg, st, jnp.array([5, 6]), sp, seeds)
    return st, (first, second)


@pytest.mark.parametrize("name", ["mhc", "qwen3"])
def test_draft_prefill_ingest_propose_at_bf16(name):
    state, outs = _draft_run(name, "bfloat16")
    _, want = _draft_run(name, "float32")
    ctx = jax.tree.leaves(state)[0]
    assert ctx.dtype == jnp.bfloat16  # the context ring / K-V store is held in the compute dtype
    for got, ref in zip(outs, want):
        assert got.logits.dtype == jnp.float32 and got.conf_logits.dtype == jnp.float32  # heads are f32
        assert got.hidden.dtype == jnp.bfloat16
        assert np.all(np.isfinite(np.asarray(got.logits)))
        assert _rel_err(got.logits, ref.logits) < TOL
        assert _rel_err(got.conf_logits, ref.conf_logits) < TOL


def _teacher_forced(model, weights, prompt: list[int], generated: list[int]):
    """Plain decoding's view of a finished sequence: at each generated position, the backbone's argmax
    and its top-1 minus top-2 margin given the tokens before it, from one forward over the sequence."""
    bb = model.backbone
    seq = prompt + generated[:-1]
    row = jnp.asarray([seq + [0] * (96 - len(seq))], jnp.int32)  # one shape for every row: one compile
    logits = bb.forward(weights.backbone, bb.init_cache(1, 96), row).logits[0, len(prompt) - 1:len(seq)]
    logits = np.asarray(logits, np.float64)
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return logits.argmax(-1), top2[:, 1] - top2[:, 0]


@pytest.mark.slow  # ~1.5 min of compiles per family on 2 cores: in the slow CI step
@pytest.mark.parametrize("name", ["mhc", "qwen3"])
def test_spec_round_at_bf16_emits_the_backbone_argmax(name):
    """Greedy speculation emits, at every position, the backbone's argmax given the tokens before it.

    At bf16 a position scored inside the (K+1)-token verify forward and inside another forward differ
    by bf16 rounding that depends on the execution shape (measured up to 0.04 on these logits), so an
    argmax whose top-2 margin is below that noise may legitimately go either way. Every generated token
    is checked against a teacher-forced forward over the round's own output: equal, or a near-tie
    (margin < 0.1, 2.5x the measured noise). The draft is the oracle (the backbone's greedy continuation
    with corrupted positions), so rounds accept 0..K drafts and the accept path is exercised.
    """

    model, weights = models(name, "bfloat16")
    model = sr.SpecModel(model.backbone, model.cfg, impl="xla", propose_fn=oracle_propose)
    n, steps, maxlen, k = 6, 30, 128, model.block_size
    ps = prompts(n, seed=3)
    prompt, plen = padded(ps)
    sp, seeds, active = sampling.SamplingParams.greedy(n), jnp.arange(n, dtype=jnp.uint32), jnp.ones(n, bool)
    state, first = sr.start(model, weights, sr.init_state(model, n, maxlen), prompt, plen, active, sp, seeds)
    rnd = jax.jit(sr.spec_round, static_argnums=0, static_argnames=("width", "mode", "filtering"))
    got, accepted = [[int(f)] for f in first], np.zeros(k + 1, int)
    while min(len(g) for g in got) < steps + 1:
        state, out = rnd(model, weights, state, sp, seeds, active, width=k + 1, mode="fixed",
                         num_verify=jnp.full(n, k))
        out = jax.device_get(out)
        for r in range(n):
            got[r] += [int(t) for t in out.tokens[r, :out.num_emitted[r]]]
            accepted[out.num_accepted[r]] += 1
    near_ties = 0
    for r in range(n):
        want, margin = _teacher_forced(model, weights, ps[r], got[r])
        differ = np.asarray(got[r]) != want
        assert np.all(margin[differ] < 0.1), (r, np.flatnonzero(differ), margin[differ])
        near_ties += int(differ.sum())
    assert near_ties <= 0.05 * sum(len(g) for g in got), near_ties
    assert accepted[1:].sum() > 0 and accepted[k] > 0, accepted  # drafts were accepted, some in full


@pytest.mark.slow
def test_training_runs_at_bf16(tmp_path):
    """`dspark train` of the tiny run config with bf16 draft activations (the recipe's compute dtype)."""
    import json
    import os
    import subprocess
    import sys

    text = (CONFIGS / "train_tiny.yaml").read_text().replace("compute_dtype: float32", "compute_dtype: bfloat16")
    for rel in ("tiny_mhc_backbone.json", "tiny_v41.json", "../tests/data/tiny_train.jsonl"):
        text = text.replace(rel, str((CONFIGS / rel).resolve()))
    assert "compute_dtype: bfloat16" in text
    (tmp_path / "run.yaml").write_text(text)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-m", "dspark_jax", "train", "--config", str(tmp_path / "run.yaml"),
                        "--run-dir", str(run_dir), "--no-progress", "--steps", "3"],
                       env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == 3 and all(np.isfinite(rec["loss"]) for rec in recs)
