"""The V4.1 draft config (dspark_jax.drafts.v41.config): SPEC 2.1 values, the HF / inference / our
spellings, the real V4.1-Flash config.json files, and errors that name the field."""

import json

import pytest
from helpers import CONFIGS, FIXTURES

from dspark_jax.drafts.v41.config import DSparkConfig
from dspark_jax.validation import ConfigError

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
    assert hf == inf == DSparkConfig.from_json(FULL).replace(vision=False, act_fp8=False)  # minimal: no vision, bf16


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


# ---- the real V4.1-Flash config.json files (issue 13): whole-model configs, backbone keys beside the draft's

import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

HF_FULL = FIXTURES / "v41_flash_hf_config.json"
INFERENCE_FULL = FIXTURES / "v41_flash_inference_config.json"


def _load(raw: dict, tmp_path, name="config.json"):
    (tmp_path / name).write_text(json.dumps(raw))
    return DSparkConfig.from_json(tmp_path / name)


def _fixture(path) -> dict:
    return json.loads(path.read_text())


def test_real_flash_configs_load_to_the_spec_config():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key of the full files is a known key
        hf = DSparkConfig.from_json(HF_FULL)
        inf = DSparkConfig.from_json(INFERENCE_FULL)
    # The backbone's keys (43 layers, 384 experts, top-6, temperature, ...) did not leak into the draft.
    # The real model has a vision tower and fp8/fp4 weights: configs/deepseek_v41_flash.json says so too.
    assert hf == inf == DSparkConfig.from_json(FULL)
    assert hf.vision and hf.act_fp8
    assert DSparkConfig.from_dict(hf.to_dict()) == hf  # our spelling round-trips, `vision` included
    assert hf.to_dict()["vision"] is True and isinstance(hf.to_dict()["rope_theta"], float)


def test_fixture_carries_every_model_args_field():
    from dspark_jax.drafts.v41.config import _INFERENCE_KEYS

    assert set(_fixture(INFERENCE_FULL)) == _INFERENCE_KEYS
    hf = _fixture(HF_FULL)
    assert (hf["num_hidden_layers"], hf["n_routed_experts"], hf["num_experts_per_tok"]) == (43, 384, 6)


def test_flash_draft_has_14_2b_parameters():
    from dspark_jax.drafts import abstract_params, count_params

    n = count_params(abstract_params(DSparkConfig.from_json(HF_FULL)))  # tied embedding / head not counted
    assert round(n / 1e9, 1) == 14.2, n


@pytest.mark.parametrize("path,dspark,backbone", [
    (HF_FULL, {"dspark_n_routed_experts": "n_routed_experts", "dspark_num_experts_per_tok": "num_experts_per_tok"},
     (384, 6)),
    (INFERENCE_FULL, {"dspark_n_routed_experts": "n_routed_experts",
                      "dspark_n_activated_experts": "n_activated_experts"}, (384, 6)),
])
@pytest.mark.parametrize("how", ["absent", "zero"])
def test_expert_counts_fall_back_to_the_backbone(tmp_path, path, dspark, backbone, how):
    raw = _fixture(path)
    for key in dspark:
        if how == "absent":
            del raw[key]
        else:
            raw[key] = 0
    cfg = _load(raw, tmp_path)
    assert (cfg.n_routed_experts, cfg.n_activated_experts) == backbone
    # one of the two given: only the missing one falls back
    raw = _fixture(path)
    raw[next(iter(dspark))] = 0
    assert _load(raw, tmp_path).n_routed_experts == 384 and _load(raw, tmp_path).n_activated_experts == 3


def test_text_only_and_vision_detection(tmp_path):
    hf, inf = _fixture(HF_FULL), _fixture(INFERENCE_FULL)
    text_hf = {k: v for k, v in hf.items() if k != "vision_config"}
    text_inf = dict(inf, vision_n_layers=0)
    assert _load(text_hf, tmp_path).vision is False
    assert _load(text_inf, tmp_path) == DSparkConfig.from_json(FULL).replace(vision=False)
    assert _load(dict(hf, vision_config=None), tmp_path).vision is False
    assert _load(dict(hf, vision_config={}), tmp_path).vision is False
    assert _load(dict(hf, vision_config={**hf["vision_config"], "num_hidden_layers": 0}), tmp_path).vision is False
    assert _load(dict(hf, vision_config={"hidden_size": 1024}), tmp_path).vision is True
    no_layers = {k: v for k, v in inf.items() if k != "vision_n_layers"}
    assert _load(no_layers, tmp_path).vision is False
    ours = DSparkConfig.from_json(FULL).to_dict()
    assert _load(dict(ours, vision=True), tmp_path).vision is True
    with pytest.raises(ConfigError, match="'vision_n_layers'"):
        _load(dict(inf, vision_n_layers="24"), tmp_path)
    with pytest.raises(ConfigError, match="'vision'"):
        _load(dict(ours, vision="yes"), tmp_path)


def test_hf_text_config_is_hoisted(tmp_path):
    hf = _fixture(HF_FULL)
    top = ("architectures", "model_type", "transformers_version", "torch_dtype", "image_token_id", "vision_config")
    nested = {**{k: hf[k] for k in top}, "text_config": {k: v for k, v in hf.items() if k not in top}}
    assert _load(nested, tmp_path) == DSparkConfig.from_json(HF_FULL)


def test_foreign_temperature_is_the_backbones(tmp_path):
    assert _load(dict(_fixture(INFERENCE_FULL), temperature=0.6), tmp_path).temperature == 1.0
    assert _load(dict(_fixture(HF_FULL), temperature=0.6), tmp_path).temperature == 1.0


def test_numerics_switches_are_read_in_foreign_files(tmp_path):
    cfg = _load(dict(_fixture(INFERENCE_FULL), param_dtype="float32", kv_fp8=False), tmp_path)
    assert (cfg.param_dtype, cfg.kv_fp8) == ("float32", False)


def test_conflicting_draft_keys_error_but_backbone_keys_do_not(tmp_path):
    # n_routed_experts 384 vs dspark_n_routed_experts 128 is fine (backbone vs draft); dim vs hidden_size is not.
    with pytest.raises(ConfigError, match=r"'dim' and 'hidden_size' \(both field 'dim'\) disagree: 4096 vs 5120"):
        _load(dict(_fixture(HF_FULL), dim=4096), tmp_path)
    with pytest.raises(ConfigError, match=r"'window' and 'window_size'"):
        _load(dict(_fixture(INFERENCE_FULL), window=64), tmp_path)


def test_bad_foreign_value_names_file_field_and_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(dict(_fixture(INFERENCE_FULL), dspark_block_size=0), tmp_path, "bad.json")
    msg = str(err.value)
    assert "bad.json" in msg and "'block_size'" in msg and "'dspark_block_size'" in msg


def _two_error_config() -> dict:
    # two conflicts: the first field in dataclass order (dim) must be the one reported, whatever the key order
    return dict(_fixture(INFERENCE_FULL), hidden_size=4096, num_attention_heads=32)


def test_error_text_is_deterministic(tmp_path):
    raw = _two_error_config()
    messages = set()
    rng = random.Random(0)
    for i in range(5):
        items = list(raw.items())
        rng.shuffle(items)
        with pytest.raises(ConfigError) as err:
            _load(dict(items), tmp_path)
        messages.add(str(err.value))
    assert len(messages) == 1 and "'dim'" in messages.pop()
    # ... and across processes (string hashing, hence set order, differs with PYTHONHASHSEED)
    (tmp_path / "two.json").write_text(json.dumps(raw))
    code = ("import sys\nfrom dspark_jax.drafts.v41.config import DSparkConfig\n"
            "from dspark_jax.validation import ConfigError\n"
            "try: DSparkConfig.from_json(sys.argv[1])\nexcept ConfigError as e: print(e)")
    outs = {subprocess.run([sys.executable, "-c", code, str(tmp_path / "two.json")], capture_output=True, text=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": seed}, check=True).stdout
            for seed in ("1", "2", "3")}
    assert len(outs) == 1 and "disagree" in outs.pop()


def test_unknown_keys_in_our_spelling_are_errors(tmp_path):
    raw = DSparkConfig.from_json(FULL).to_dict()
    raw["markov_rnak"] = raw.pop("markov_rank")
    with pytest.raises(ConfigError, match=r"'markov_rnak' \(did you mean 'markov_rank'\?\)") as err:
        _load(raw, tmp_path, "typo.json")
    assert "typo.json" in str(err.value)
    # without `family` and without foreign keys it still reads as ours
    bare = {k: v for k, v in raw.items() if k != "family"}
    with pytest.raises(ConfigError, match="markov_rnak"):
        DSparkConfig.from_dict(bare)
    # both typos reported, sorted
    with pytest.raises(ConfigError, match=r"'blok_size'.*'markov_rnak'"):
        DSparkConfig.from_dict(dict(raw, blok_size=5))


@pytest.mark.parametrize("path,key", [
    (INFERENCE_FULL, "dspark_markov_rnak"),  # a dspark_ key that is none of ours
    (HF_FULL, "dspark_markov_rnak"),
    (HF_FULL, "dspark_n_activated_experts"),  # the inference spelling's key in an HF file
    (INFERENCE_FULL, "dspark_num_experts_per_tok"),  # and the other way round
    (HF_FULL, "num_nextn_predict_layer"),  # near miss of a draft key
    (INFERENCE_FULL, "n_mtp_layer"),
    (HF_FULL, "n_mtp_layers"),  # the other spelling's draft key
])
def test_foreign_draft_key_typos_are_errors(tmp_path, path, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        _load(dict(_fixture(path), **{key: 1}), tmp_path)


def test_other_spellings_draft_key_hints_this_spellings_key(tmp_path):
    with pytest.raises(ConfigError, match=r"'dspark_num_experts_per_tok' \(did you mean 'dspark_n_activated_experts'"):
        _load(dict(_fixture(INFERENCE_FULL), dspark_num_experts_per_tok=3), tmp_path)
    with pytest.raises(ConfigError, match=r"'n_mtp_layers' \(did you mean 'num_nextn_predict_layers'"):
        _load(dict(_fixture(HF_FULL), n_mtp_layers=3), tmp_path)


@pytest.mark.parametrize("path", [HF_FULL, INFERENCE_FULL])
def test_unknown_backbone_keys_warn_and_load(tmp_path, path):
    raw = dict(_fixture(path), zz_new_backbone_knob=1, mtp_loss_weight=0.3)
    with pytest.warns(UserWarning, match=r"\['mtp_loss_weight', 'zz_new_backbone_knob'\]"):
        cfg = _load(raw, tmp_path)
    assert cfg == DSparkConfig.from_json(path)
    # new members of the growing backbone key families are known
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _load(dict(_fixture(path), engram_new_knob=1, vision_new_knob=2, index_new_knob=3), tmp_path)


def test_spelling_detection():
    from dspark_jax.drafts.v41.config import _spelling

    assert _spelling({"family": "deepseek_v41", "hidden_size": 8}) == "ours"
    assert _spelling({"dim": 8, "n_layers": 2}) == "ours"
    assert _spelling({"dim": 8, "n_mtp_layers": 2}) == "inference"
    assert _spelling({"dim": 8, "window_size": 2}) == "inference"
    assert _spelling({"text_config": {}}) == "hf"
    assert _spelling({"n_mtp_layers": 2, "model_type": "x"}) == "hf"
    assert _spelling(_fixture(HF_FULL)) == "hf" and _spelling(_fixture(INFERENCE_FULL)) == "inference"


def test_act_fp8_follows_the_declared_weight_format(tmp_path):
    """The official forward quantizes activations before fp8/fp4 GEMMs exactly when the model's weights
    are fp8 (inference `dtype`, HF `quantization_config`); an explicit `act_fp8` key wins."""
    hf, inf = _fixture(HF_FULL), _fixture(INFERENCE_FULL)
    assert _load(inf, tmp_path).act_fp8 and _load(hf, tmp_path).act_fp8
    assert not _load(dict(inf, dtype="bf16"), tmp_path).act_fp8
    assert not _load({k: v for k, v in hf.items() if k != "quantization_config"}, tmp_path).act_fp8
    assert not _load(dict(inf, act_fp8=False), tmp_path).act_fp8
    with pytest.raises(ConfigError, match="'dtype'"):
        _load(dict(inf, dtype="fp16"), tmp_path)


def test_markov_head_type_is_ours_and_read_case_insensitively():
    """The gated / recurrent heads are a training option of our spelling; DeepSeek's files describe the
    vanilla head only, so a foreign config always loads as vanilla."""
    base = DSparkConfig.from_json(CONFIGS / "tiny_v41.json")
    assert base.markov_head_type == "vanilla"
    assert DSparkConfig.from_dict({**base.to_dict(), "markov_head_type": "GATED"}).markov_head_type == "GATED"
    with pytest.raises(ConfigError, match="markov_head_type.*vanilla.*gated.*rnn"):
        DSparkConfig.from_dict({**base.to_dict(), "markov_head_type": "lstm"})


@pytest.mark.parametrize("key,value", [
    ("target_layer_ids", "135"),  # a string would iterate as digits (1, 3, 5)
    ("target_layer_ids", [1.9, 3.2, 5.7]),  # floats would truncate
    ("target_layer_ids", None),
    ("target_layer_ids", []),
    ("target_layer_ids", [1, True]),
    ("n_shared_experts", True),  # JSON true is not the integer 1
    ("markov_rank", True),
    ("noise_token_id", True),
    ("noise_token_id", 1.5),
    ("noise_token_id", "1"),
])
def test_ints_are_ints_not_bools_strings_or_floats(key, value):
    raw = json.loads((CONFIGS / "tiny_v41.json").read_text())
    DSparkConfig.from_dict(raw)  # the intact file loads
    with pytest.raises(ConfigError, match=f"config field '{key}': expected"):
        DSparkConfig.from_dict(dict(raw, **{key: value}))


@pytest.mark.parametrize("change,needle", [
    (dict(target_layer_ids=[1, 2, 99]), "'target_layer_ids': 'taps' [99] out of range"),
    (dict(vocab_size=1024, noise_token_id=5), "'vocab_size': expected the backbone's"),
    (dict(dim=128), "differs from the backbone's"),
])
def test_a_draft_that_does_not_fit_its_backbone_is_refused_before_any_compile(change, needle):
    from dspark_jax import spec_round as sr
    from dspark_jax.backbones.mhc import MhcBackbone, MhcConfig

    backbone = MhcBackbone(MhcConfig.from_json(CONFIGS / "tiny_mhc_backbone.json"))
    raw = json.loads((CONFIGS / "tiny_v41.json").read_text())
    sr.SpecModel(backbone, DSparkConfig.from_dict(raw))  # the shipped pair fits
    with pytest.raises(ConfigError) as info:
        sr.SpecModel(backbone, DSparkConfig.from_dict(dict(raw, **change)))
    assert needle in str(info.value), info.value


def test_moe_routing_is_ours_and_checked(tmp_path):
    """`moe_routing` (ours, default "auto") picks the MoE path; a wrong value names the field."""
    ours = DSparkConfig.from_json(CONFIGS / "tiny_v41.json").to_dict()
    assert ours["moe_routing"] == "auto"
    assert _load(dict(ours, moe_routing="dense"), tmp_path).moe_routing == "dense"
    with pytest.raises(ConfigError, match="'moe_routing'"):
        _load(dict(ours, moe_routing="sparse"), tmp_path)
