import json

import pytest

from conftest import CONFIGS

from dspark_jax.config import ConfigError, DSparkConfig

FULL = CONFIGS / "deepseek_v41_flash.json"

# SPEC 2.1 values, spelled out once more here so a drifting config file is caught.
SPEC_VALUES = dict(dim=5120, vocab_size=129280, n_layers=3, block_size=5, noise_token_id=128799,
                   target_layer_ids=(37, 38, 39), markov_rank=256, n_routed_experts=128, n_activated_experts=3,
                   n_shared_experts=1, moe_inter_dim=2304, n_heads=64, head_dim=512, rope_head_dim=64,
                   rope_theta=10000.0, q_lora_rank=1280, o_groups=8, o_lora_rank=1024, window=128, hc_mult=4,
                   hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-20, score_func="sqrtsoftplus", route_scale=1.5,
                   swiglu_limit=10.0, norm_topk_prob=True, temperature=1.0)

HF_STYLE = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "text_config": {
        "hidden_size": 5120, "vocab_size": 129280, "num_nextn_predict_layers": 3, "dspark_block_size": 5,
        "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3, "n_shared_experts": 1,
        "moe_intermediate_size": 2304, "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64,
        "rope_theta": 10000, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-20,
        "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "norm_topk_prob": True,
        "num_hidden_layers": 40,
    },
}

INFERENCE_STYLE = {
    "dim": 5120, "vocab_size": 129280, "n_mtp_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256, "dspark_n_routed_experts": 128,
    "dspark_n_activated_experts": 3, "n_shared_experts": 1, "moe_inter_dim": 2304, "n_heads": 64,
    "head_dim": 512, "rope_head_dim": 64, "rope_theta": 10000.0, "q_lora_rank": 1280, "o_groups": 8,
    "o_lora_rank": 1024, "window_size": 128, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "norm_eps": 1e-20, "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0,
}


def test_full_config_has_every_spec_value():
    cfg = DSparkConfig.from_json(FULL)
    for k, v in SPEC_VALUES.items():
        assert getattr(cfg, k) == v, k


def test_hf_and_inference_spellings_load_to_the_same_config(tmp_path):
    (tmp_path / "hf.json").write_text(json.dumps(HF_STYLE))
    (tmp_path / "inf.json").write_text(json.dumps(INFERENCE_STYLE))
    hf = DSparkConfig.from_json(tmp_path / "hf.json")
    inf = DSparkConfig.from_json(tmp_path / "inf.json")
    assert hf == inf == DSparkConfig.from_json(FULL)


@pytest.mark.parametrize("key,value,field", [
    ("dspark_block_size", 0, "block_size"),
    ("dspark_noise_token_id", 200000, "noise_token_id"),
    ("o_groups", 7, "o_groups"),
    ("score_func", "relu", "score_func"),
    ("dspark_n_activated_experts", 500, "n_activated_experts"),
    ("rope_head_dim", 63, "rope_head_dim"),
])
def test_wrong_value_names_the_field(tmp_path, key, value, field):
    bad = dict(INFERENCE_STYLE, **{key: value})
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=f"'{field}'"):
        DSparkConfig.from_json(tmp_path / "bad.json")


def test_conflicting_aliases_and_bad_files(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(dict(INFERENCE_STYLE, hidden_size=4096)))
    with pytest.raises(ConfigError, match="disagree"):
        DSparkConfig.from_json(tmp_path / "c.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        DSparkConfig.from_json(tmp_path / "broken.json")
    with pytest.raises(ConfigError, match="not found"):
        DSparkConfig.from_json(tmp_path / "missing.json")


def test_round_trip(tmp_path):
    cfg = DSparkConfig.from_json(CONFIGS / "tiny_v41.json")
    cfg.to_json(tmp_path / "t.json")
    assert DSparkConfig.from_json(tmp_path / "t.json") == cfg
