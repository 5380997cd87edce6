"""The Qwen3 backbone (dspark_jax.backbones.qwen3): parity with transformers for the full forward, cached
decoding with rollback and the taps, and its config's loading and errors.
(The Hugging Face checkpoint loader is checkpoint/test_qwen3_hf.py.)"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers.backbones import (B, FAMILY_TAPS, MAX_LEN, N, PREFILL, QWEN_JSON, STEPS, decode_schedule, jit_forward)

from dspark_jax.backbones.base import BackboneOutput
from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Cache, Qwen3Config
from dspark_jax.validation import ConfigError


# ---------------------------------------------------------------------------------------------------
# Qwen3 vs transformers
# ---------------------------------------------------------------------------------------------------


def test_qwen3_full_forward_matches_transformers(qwen3_hf_both):
    _, _, cfg, params, seq, ref, _ = qwen3_hf_both
    assert cfg.tie_word_embeddings == ("lm_head" not in params)
    bb = Qwen3Backbone(cfg)
    out = jit_forward(bb)(params, bb.init_cache(B, MAX_LEN), jnp.asarray(seq))
    assert isinstance(out, BackboneOutput) and isinstance(out.cache, Qwen3Cache)
    assert out.logits.dtype == jnp.float32 and out.logits.shape == (B, N, cfg.vocab_size)
    assert out.taps.shape == (B, N, 0)
    np.testing.assert_allclose(np.asarray(out.logits), ref, atol=1e-4, rtol=0)


def test_qwen3_incremental_decoding_with_rollback_matches_transformers(qwen3_hf):
    _, _, cfg, params, seq, ref, hidden = qwen3_hf
    bb = Qwen3Backbone(cfg)
    logits, feats, cache = decode_schedule(bb, jit_forward(bb), params, seq, PREFILL, STEPS, taps=FAMILY_TAPS)
    m = logits.shape[1]
    assert m == PREFILL + sum(n for _, n in STEPS) and np.all(np.asarray(cache.length) == m)
    np.testing.assert_allclose(logits, ref[:, :m], atol=1e-4, rtol=0)
    want = np.concatenate([hidden[i][:, :m] for i in FAMILY_TAPS], axis=-1)
    np.testing.assert_allclose(feats, want, atol=1e-4, rtol=0)


def test_qwen3_taps_match_transformers_hidden_states(qwen3_hf):
    """HF hidden_states[i] is the entry of layer i (i < L); its last one is the final-normed output."""
    _, _, cfg, params, seq, _, hidden = qwen3_hf
    bb = Qwen3Backbone(cfg)
    fwd = jit_forward(bb)
    cache = bb.init_cache(B, MAX_LEN)
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    entry = np.asarray(fwd(params, cache, jnp.asarray(seq), taps=(2, 0, 3), tap_mode="entry").taps)
    assert entry.shape == (B, N, 3 * D)
    for j, layer in enumerate((2, 0, 3)):  # concatenated in the order asked
        np.testing.assert_allclose(entry[..., j * D:(j + 1) * D], hidden[layer], atol=1e-4, rtol=0)
    out = np.asarray(fwd(params, cache, jnp.asarray(seq), taps=(-1, 1, L - 1), tap_mode="output").taps)
    np.testing.assert_allclose(out[..., :D], hidden[0], atol=1e-4, rtol=0)  # -1 = embeddings
    np.testing.assert_allclose(out[..., D:2 * D], hidden[2], atol=1e-4, rtol=0)  # output of 1 = entry of 2
    last = np.asarray(bb.final_norm(params, jnp.asarray(out[..., 2 * D:])))
    np.testing.assert_allclose(last, hidden[L], atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------


def _hf_raw():
    return json.loads(QWEN_JSON.read_text())


@pytest.mark.parametrize("change, match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_scaling.*'yarn' is not implemented"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling.*'linear' is not implemented"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, r"rope_parameters.*'dynamic'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, r"disagree on the RoPE base"),
    ({"use_sliding_window": True}, r"'use_sliding_window'"),
    ({"attention_bias": True}, r"'attention_bias'"),
    ({"hidden_act": "gelu"}, r"'hidden_act'"),
    ({"model_type": "qwen3_moe"}, r"'model_type'.*Qwen3-MoE"),
    ({"num_key_value_heads": 3}, r"'num_key_value_heads'.*divisor of num_attention_heads=4"),
    ({"hidden_size": "64"}, r"'hidden_size'.*positive integer"),
    ({"rms_norm_eps": 0}, r"'rms_norm_eps'"),
    ({"tie_word_embeddings": "yes"}, r"'tie_word_embeddings'"),
    # a malformed value is not read as "false" / "absent" by its falsiness
    ({"attention_bias": {}}, r"'attention_bias'"),
    ({"use_sliding_window": 0}, r"'use_sliding_window'"),
    ({"num_key_value_heads": {}}, r"'num_key_value_heads'"),
    ({"num_key_value_heads": 0}, r"'num_key_value_heads'"),
    ({"rope_theta": [1]}, r"'rope_theta'.*number > 1"),
    # a near miss of a key we read would leave that field at its default
    ({"rms_norm_epsilon": 1e-5}, r"'rms_norm_epsilon' \(did you mean 'rms_norm_eps'\?\)"),
    ({"num_key_value_head": 2}, r"'num_key_value_head' \(did you mean 'num_key_value_heads'\?\)"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}}, r"'rope_parameters.rope_theta'"),
])
def test_qwen3_config_errors_name_the_field(change, match):
    with pytest.raises(ConfigError, match=match):
        Qwen3Config.from_hf_dict({**_hf_raw(), **change})


def test_qwen3_config_loading(tmp_path):
    cfg = Qwen3Config.from_hf_json(QWEN_JSON)
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.head_dim, cfg.tie_word_embeddings) == (512, 4, 32, True)
    raw = _hf_raw()
    del raw["num_hidden_layers"]
    with pytest.raises(ConfigError, match=r"'num_hidden_layers' is missing"):
        Qwen3Config.from_hf_dict(raw)
    # transformers 5 spelling: rope_parameters instead of rope_theta
    raw = _hf_raw()
    del raw["rope_theta"], raw["rope_scaling"]
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 123456.0}
    assert Qwen3Config.from_hf_dict(raw).rope_theta == 123456.0
    # head_dim and num_key_value_heads default as in transformers
    raw = _hf_raw()
    del raw["head_dim"], raw["num_key_value_heads"]
    cfg2 = Qwen3Config.from_hf_dict(raw)
    assert (cfg2.head_dim, cfg2.num_key_value_heads) == (16, 4)
    assert Qwen3Config.from_hf_dict(cfg.to_hf_dict()) == cfg
    cfg16 = cfg.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    assert Qwen3Config.from_hf_dict(json.loads(json.dumps(cfg16.to_hf_dict()))) == cfg16
    with pytest.raises(ConfigError, match=r"'param_dtype'"):
        Qwen3Config.from_hf_json(QWEN_JSON, param_dtype="float16")
    with pytest.raises(ConfigError, match="config file not found"):
        Qwen3Config.from_hf_json(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"bad.json is not valid JSON"):
        Qwen3Config.from_hf_json(tmp_path / "bad.json")
    with pytest.raises(ValueError, match=r"'max_len' 4096 exceeds .* max_position_embeddings 2048"):
        Qwen3Backbone(cfg).init_cache(1, 4096)
