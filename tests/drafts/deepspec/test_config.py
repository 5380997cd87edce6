"""The DeepSpec draft config (dspark_jax.drafts.deepspec.config): read from a DeepSpec config.json, written
back in DeepSpec's spelling and ours, and errors that name the field."""

import jax
import numpy as np
import pytest

from dspark_jax import drafts
from dspark_jax.checkpoint import deepspec as ckpt
from dspark_jax.drafts import config_from_dict
from dspark_jax.drafts.deepspec.config import DeepSpecConfig
from dspark_jax.drafts.v41.config import DSparkConfig
from dspark_jax.validation import ConfigError


def test_config_from_a_deepspec_config_json_and_errors():
    raw = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": 4096, "vocab_size": 151936,
           "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
           "num_target_layers": 36, "block_size": 7, "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33],
           "markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
           "confidence_head_with_markov": True, "num_anchors": 512, "torch_dtype": "bfloat16",
           "tie_word_embeddings": False}
    cfg = config_from_dict(raw)
    assert isinstance(cfg, DeepSpecConfig) and cfg.family == "qwen3" and cfg.tap_mode == "output"
    assert (cfg.block_size, cfg.noise_token_id, cfg.dim, cfg.n_taps, cfg.main_hidden_dim, cfg.confidence_in_dim) == \
        (7, 151669, 4096, 5, 5 * 4096, 4096 + 256)
    assert cfg.to_hf_dict() == {**raw, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert config_from_dict(cfg.to_dict()) == cfg  # our spelling round-trips (bundles)
    shapes = {k: v.shape for k, v in jax.tree_util.tree_flatten_with_path(drafts.abstract_params(cfg))[0]}
    assert sum(int(np.prod(s)) for s in shapes.values()) == sum(
        int(np.prod(s)) for n, s in ckpt.expected_tensors(cfg).items() if n not in ckpt.TIED.values())
    for change, word in ((dict(target_layer_ids=[1, 9, 35]), "last layer"), (dict(markov_head_type="fir"), "vanilla.*gated.*rnn"),
                         (dict(mask_token_id=151936), "mask_token_id"), (dict(target_layer_ids=[9, 1]), "increasing"),
                         (dict(attention_bias=True), "attention_bias"),
                         (dict(target_layer_ids="1234"), "target_layer_ids"), (dict(markov_rank=True), "markov_rank")):
        with pytest.raises(ConfigError, match=word):
            config_from_dict({**raw, **change})
    for arch in (True, "Qwen3DSparkModel"):  # a malformed list is no family's claim; the class itself names it
        with pytest.raises(ConfigError, match="'architectures'"):
            DeepSpecConfig.from_dict({**raw, "architectures": arch})
    for key in ("block_size", "markov_rank", "enable_confidence_head"):  # DeepSpec's loader requires them too
        with pytest.raises(ConfigError, match=f"'{key}' is missing"):
            config_from_dict({k: v for k, v in raw.items() if k != key})
        with pytest.raises(ConfigError, match=f"'{key}' is missing"):  # null is not a value to default from
            config_from_dict({**raw, key: None})
    # What DeepSpec's loader needs is written even when the source lacked it; no head type without a head.
    bare = {k: v for k, v in raw.items() if k not in ("num_anchors", "tie_word_embeddings")}
    written = config_from_dict({**bare, "markov_rank": 0, "confidence_head_with_markov": False}).to_hf_dict()
    assert written["num_anchors"] == 512 and written["tie_word_embeddings"] is False
    assert "markov_head_type" not in written
    with pytest.raises(ConfigError, match="DeepSpecConfig"):
        DSparkConfig(family="qwen3")


def test_every_markov_head_type_is_read_case_insensitively_and_exported_as_written():
    """DeepSpec compares `markov_head_type` lower-cased (SPEC 4.1); we read it the same way and write back
    the file's own spelling (a byte-identical export); the head's parameters follow the type."""
    from helpers.deepspec import CFG

    raw = CFG.to_hf_dict()
    for written, extra in (("vanilla", set()), ("Gated", {"gate"}), ("RNN", {"joint"})):
        cfg = config_from_dict({**raw, "markov_head_type": written})
        assert cfg.to_hf_dict()["markov_head_type"] == written
        assert set(drafts.abstract_params(cfg)["markov"]) == {"embed", "head"} | extra
