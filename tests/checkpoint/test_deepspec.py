"""DeepSpec draft checkpoints (dspark_jax.checkpoint.deepspec): a checkpoint in DeepSpec's own layout
(helpers.deepspec, written by torch's safetensors) loads strictly, runs, and exports to an identical file set."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.deepspec import released_like, write_checkpoint

from dspark_jax import drafts, sampling
from dspark_jax.checkpoint import deepspec as ckpt
from dspark_jax.checkpoint.safetensors_io import CheckpointError, open_checkpoint


# Every Markov head type DeepSpec writes (SPEC 4.1); the config value is read case-insensitively.
@pytest.fixture(scope="module", params=["vanilla", "Gated", "rnn"])
def checkpoint(request, tmp_path_factory):
    """A DeepSpec-layout checkpoint folder of the tiny config -> (folder, float64 weights, raw config)."""
    return released_like(str(tmp_path_factory.mktemp("deepspec")), request.param)


def test_checkpoint_loads_runs_and_exports_an_identical_file_set(checkpoint, tmp_path):
    folder, _, raw = checkpoint
    cfg, params, tied = ckpt.load_deepspec_draft(folder)  # bf16, as released
    assert jax.tree.structure(params) == jax.tree.structure(drafts.abstract_params(cfg))

    @jax.jit
    def run(params, tied):
        st = drafts.prefill(params, cfg, drafts.init_state(cfg, 1, 8), jnp.ones((1, 3, cfg.main_hidden_dim)),
                            jnp.asarray([3]))
        return drafts.propose(params, tied, cfg, st, jnp.asarray([7]), sampling.SamplingParams.greedy(1),
                              jnp.zeros((1,), jnp.uint32))

    out = run(params, tied)
    assert np.isfinite(np.asarray(out.logits)).all() and np.isfinite(np.asarray(out.conf_logits)).all()
    for name, path in (("export", tmp_path / "export"), ("convert", tmp_path / "convert")):
        if name == "export":
            ckpt.export_deepspec_draft(params, tied, cfg, path)
        else:
            ckpt.convert_deepspec_safetensors(folder, path)
        assert json.loads((path / "config.json").read_text()) == raw
        a, b = open_checkpoint(folder), open_checkpoint(path)
        assert sorted(a.names) == sorted(b.names)
        for n in a.names:
            ia, ib = a.info(n), b.info(n)
            assert (ia.dtype, ia.shape) == (ib.dtype, ib.shape), n
            assert a.view(n).tobytes() == b.view(n).tobytes(), n


def test_checkpoint_loader_is_strict_and_names_the_tensor(checkpoint, tmp_path):
    folder, weights, raw = checkpoint
    cases = {
        "missing": ({k: v for k, v in weights.items() if k != "layers.1.self_attn.k_norm.weight"},
                    "missing.*layers.1.self_attn.k_norm.weight"),
        "extra": ({**weights, "layers.2.input_layernorm.weight": weights["norm.weight"]},
                  "unexpected.*layers.2.input_layernorm.weight"),
        "shape": ({**weights, "fc.weight": weights["fc.weight"][:, :-1]}, "'fc.weight' has shape"),
        "prefixed": ({f"model.{k}": v for k, v in weights.items()}, "missing"),
        "nan": ({**weights, "fc.weight": np.where(np.arange(weights["fc.weight"].size).reshape(weights["fc.weight"].shape)
                                                  == 1, np.nan, weights["fc.weight"])},
                "tensor 'fc.weight': 1 non-finite value"),
    }
    head = raw["markov_head_type"].lower()
    if head == "gated":  # the head's gate_proj, not a layer's mlp.gate_proj, is named
        cases["no gate bias"] = ({k: v for k, v in weights.items() if k != "markov_head.gate_proj.bias"},
                                 "missing.*'markov_head.gate_proj.bias'")
        cases["gate shape"] = ({**weights, "markov_head.gate_proj.weight": np.ascontiguousarray(weights["markov_head.gate_proj.weight"].T)},
                               "'markov_head.gate_proj.weight' has shape")
    if head == "rnn":
        cases["no joint"] = ({k: v for k, v in weights.items() if not k.startswith("markov_head.joint_proj")},
                             "missing.*markov_head.joint_proj.bias.*markov_head.joint_proj.weight")
        cases["joint under a vanilla config"] = (weights, "unexpected.*markov_head.joint_proj")
    if head == "vanilla":
        cases["a gate the config does not declare"] = (
            {**weights, "markov_head.gate_proj.bias": weights["norm.weight"][:16]}, "unexpected.*markov_head.gate_proj")
    for name, (w, pattern) in cases.items():
        config = {**raw, "markov_head_type": "vanilla"} if name == "joint under a vanilla config" else raw
        write_checkpoint(tmp_path / name, config, w)
        with pytest.raises(CheckpointError, match=pattern):
            ckpt.load_deepspec_draft(tmp_path / name)
