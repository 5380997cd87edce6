"""Hugging Face Qwen3 checkpoints -> `Qwen3Backbone` params: the name table and the strict loader.

    cfg, params = load_qwen3_hf("path/to/Qwen3-8B")          # config.json + (sharded) safetensors

The name map is data: `hf_layer_map(cfg)` lists each per-layer tensor as (HF suffix after
`model.layers.{i}.`, our (module, leaf) under `layers`, HF shape, HF -> ours transform); the embedding,
final norm and untied head are fixed names (`hf_expected_shapes`). `transposed` and `unchanged` are
their own inverses, so the same table drives the reverse direction (`dspark_jax.bench.peer`,
`scripts/train_backbone_qwen3.py`).

The loader is strict (`dspark_jax.checkpoint.trees.check_tree`): a missing, unexpected or mis-shaped
tensor is a `CheckpointError` naming it and the checkpoint; the tree it builds is checked against
`Qwen3Backbone.abstract_params()` (names, shapes, dtypes) by the same check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.backbones.base import as_dtype
from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Config
from dspark_jax.checkpoint.formats import check_finite
from dspark_jax.checkpoint.safetensors_io import CheckpointError, open_checkpoint
from dspark_jax.checkpoint.trees import check_tree, flatten_paths


def transposed(w: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w.T)


def unchanged(w: np.ndarray) -> np.ndarray:
    return w


def hf_layer_map(cfg: Qwen3Config) -> list[tuple[str, tuple[str, str], tuple[int, ...], Any]]:
    """Per-layer tensors: (HF suffix after `model.layers.{i}.`, our (module, leaf), HF shape, HF -> ours)."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    h, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return [
        ("input_layernorm.weight", ("attn_norm", "scale"), (d,), unchanged),
        ("self_attn.q_proj.weight", ("q_proj", "kernel"), (h, d), transposed),
        ("self_attn.k_proj.weight", ("k_proj", "kernel"), (kv, d), transposed),
        ("self_attn.v_proj.weight", ("v_proj", "kernel"), (kv, d), transposed),
        ("self_attn.o_proj.weight", ("o_proj", "kernel"), (d, h), transposed),
        ("self_attn.q_norm.weight", ("q_norm", "scale"), (hd,), unchanged),
        ("self_attn.k_norm.weight", ("k_norm", "scale"), (hd,), unchanged),
        ("post_attention_layernorm.weight", ("ffn_norm", "scale"), (d,), unchanged),
        ("mlp.gate_proj.weight", ("gate_proj", "kernel"), (f, d), transposed),
        ("mlp.up_proj.weight", ("up_proj", "kernel"), (f, d), transposed),
        ("mlp.down_proj.weight", ("down_proj", "kernel"), (d, f), transposed),
    ]


def hf_expected_shapes(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor name a Qwen3 checkpoint of this config must hold, with its shape."""
    out = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "model.norm.weight": (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_hidden_layers):
        for suffix, _, shape, _ in hf_layer_map(cfg):
            out[f"model.layers.{i}.{suffix}"] = shape
    return out


def load_qwen3_hf(path: str | Path, **overrides) -> tuple[Qwen3Config, dict]:
    """Load a Hugging Face Qwen3 checkpoint folder (config.json + model.safetensors, or sharded with
    model.safetensors.index.json) -> (config, params). Strict: a missing, unexpected or mis-shaped tensor
    raises `CheckpointError` naming it. `overrides` set config fields (e.g. param_dtype="bfloat16")."""
    path = Path(path)
    cfg = Qwen3Config.from_hf_json(path / "config.json", **overrides)
    reader = open_checkpoint(path)
    names = list(reader.names)
    if cfg.tie_word_embeddings and "lm_head.weight" in names:
        # Some exporters store the tied head anyway; accept it only if it IS the embedding.
        names.remove("lm_head.weight")
        if not np.array_equal(reader.view("lm_head.weight"), reader.view("model.embed_tokens.weight")):
            raise CheckpointError(f"{path}: tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' "
                                  "but config.json says tie_word_embeddings=true")
    check_tree({n: reader.info(n) for n in names}, hf_expected_shapes(cfg), str(path))

    pd = np.dtype(as_dtype(cfg.param_dtype))

    def read(name, transform=unchanged):
        dtype = reader.info(name).dtype
        if dtype not in ("F32", "F16", "BF16"):
            raise CheckpointError(f"{path}: tensor '{name}' has dtype {dtype}, expected F32, F16 or BF16")
        value = reader.view(name)
        check_finite(value, f"{path}: tensor '{name}'")
        return transform(np.asarray(value, np.float32)).astype(pd)

    layers: dict[str, dict[str, np.ndarray]] = {}
    for suffix, (mod, leaf), _, transform in hf_layer_map(cfg):
        stacked = np.stack([read(f"model.layers.{i}.{suffix}", transform) for i in range(cfg.num_hidden_layers)])
        layers.setdefault(mod, {})[leaf] = stacked
    params = {"embed": read("model.embed_tokens.weight"), "layers": layers,
              "norm": {"scale": read("model.norm.weight")}}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = read("lm_head.weight")
    params = jax.tree.map(jnp.asarray, params)
    # Our own mapping-bug guard: the built tree must be the module's exactly (names, shapes, dtypes).
    check_tree(flatten_paths(params), flatten_paths(Qwen3Backbone(cfg).abstract_params()),
               f"{path}: loaded params vs Qwen3Backbone.abstract_params()", noun="param", dtypes=True)
    return cfg, params
