"""The Hugging Face Qwen3 checkpoint loader (dspark_jax.checkpoint.qwen3_hf): sharded and bf16 checkpoints
saved by transformers load exactly, and the loader is strict (missing, unexpected, mis-shaped and untied
heads are named errors)."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.backbones import B, FAMILY_TAPS, MAX_LEN, N, jit_forward, random_tokens
from safetensors.numpy import load_file, save_file

from dspark_jax.backbones.qwen3 import Qwen3Backbone
from dspark_jax.checkpoint.qwen3_hf import load_qwen3_hf
from dspark_jax.checkpoint.safetensors_io import CheckpointError


def test_qwen3_sharded_and_bf16_checkpoints_load(qwen3_hf, tmp_path):
    model, _, cfg, params, _, _, _ = qwen3_hf
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    cfg2, params2 = load_qwen3_hf(sharded)
    assert cfg2 == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)

    import torch
    half = tmp_path / "bf16"
    model.to(torch.bfloat16).save_pretrained(half)
    model.float()
    _, p16 = load_qwen3_hf(half, param_dtype="bfloat16")
    assert p16["embed"].dtype == jnp.bfloat16
    want = jax.tree.map(lambda a: np.asarray(a.astype(jnp.bfloat16)), params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), p16, want)

    # bf16 compute: f32 logits, bf16 taps and cache, close to the f32 model (bf16 rounding only).
    bb16 = Qwen3Backbone(cfg.replace(param_dtype="bfloat16", compute_dtype="bfloat16"))
    seq = jnp.asarray(random_tokens(0, (B, N)))
    out16 = jit_forward(bb16)(p16, bb16.init_cache(B, MAX_LEN), seq, taps=FAMILY_TAPS)
    out32 = jit_forward(Qwen3Backbone(cfg))(params, Qwen3Backbone(cfg).init_cache(B, MAX_LEN), seq, taps=FAMILY_TAPS)
    assert (out16.logits.dtype, out16.taps.dtype, out16.cache.k.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)
    assert float(jnp.max(jnp.abs(out16.logits - out32.logits))) < 0.25 * float(jnp.std(out32.logits))


def _rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_qwen3_loader_is_strict(qwen3_hf_both, tmp_path):
    _, folder, cfg, _, _, _, _ = qwen3_hf_both
    name = "model.layers.2.self_attn.k_proj.weight"
    bad = _rewrite(folder, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing.*'model\.layers\.2\.self_attn\.k_proj\.weight'"):
        load_qwen3_hf(bad)
    extra = {"model.layers.9.mlp.extra.weight": np.zeros(3, np.float32)}
    bad = _rewrite(folder, tmp_path / "extra", lambda t: t.update(extra))
    with pytest.raises(CheckpointError, match=r"unexpected.*'model\.layers\.9\.mlp\.extra\.weight'"):
        load_qwen3_hf(bad)
    bad = _rewrite(folder, tmp_path / "shape", lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.self_attn\.k_proj\.weight' has shape \[63, 64\], "
                                              r"expected \[64, 64\]"):
        load_qwen3_hf(bad)
    def nan_norm(t):
        t["model.norm.weight"] = t["model.norm.weight"].copy()
        t["model.norm.weight"][3] = np.nan
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight': 1 non-finite value\(s\)"):
        load_qwen3_hf(_rewrite(folder, tmp_path / "nan", nan_norm))
    if cfg.tie_word_embeddings:  # a stored head must then BE the embedding
        def differing_head(t):
            t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1
        with pytest.raises(CheckpointError, match=r"'lm_head\.weight' differs from 'model\.embed_tokens\.weight'"):
            load_qwen3_hf(_rewrite(folder, tmp_path / "head", differing_head))
        _, p = load_qwen3_hf(_rewrite(folder, tmp_path / "same_head", lambda t: t.update(
            {"lm_head.weight": t["model.embed_tokens.weight"]})))
        assert "lm_head" not in p
    else:  # an untied checkpoint without its head is incomplete
        with pytest.raises(CheckpointError, match=r"missing.*'lm_head\.weight'"):
            load_qwen3_hf(_rewrite(folder, tmp_path / "nohead", lambda t: t.pop("lm_head.weight")))
