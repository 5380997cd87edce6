"""The deprecated import paths of the issue-18 restructure still work for one release, with a
DeprecationWarning, and name the very objects of their new homes."""

import importlib
import warnings

import pytest

from dspark_jax.checkpoint.qwen3_hf import load_qwen3_hf

ALIASES = {  # old module: (what its warning says, {name: the module that now holds it})
    "dspark_jax.draft": (r"dspark_jax\.draft is deprecated: use dspark_jax\.drafts", {
        "init_params": "dspark_jax.drafts", "propose": "dspark_jax.drafts", "DraftOutput": "dspark_jax.drafts",
        "reset_rows": "dspark_jax.drafts", "DSparkDraft": "dspark_jax.drafts.v41.model",
        "DraftState": "dspark_jax.drafts.v41.model", "draft_hidden": "dspark_jax.drafts.v41.model",
        "confidence_logits": "dspark_jax.drafts.v41.heads"}),
    "dspark_jax.config": (r"dspark_jax\.config is deprecated: use dspark_jax\.drafts", {
        "DSparkConfig": "dspark_jax.drafts.v41.config", "ConfigError": "dspark_jax.validation",
        "check_field": "dspark_jax.validation"}),
    "dspark_jax.deepspec": (r"dspark_jax\.deepspec is deprecated: use dspark_jax\.drafts\.deepspec", {
        "DeepSpecConfig": "dspark_jax.drafts.deepspec.config", "context_kv": "dspark_jax.drafts.deepspec.model",
        "propose": "dspark_jax.drafts.deepspec.model", "confidence_logits": "dspark_jax.drafts.deepspec.heads",
        "train_forward": "dspark_jax.drafts.deepspec.train_forward"}),
    "dspark_jax.heads": (r"dspark_jax\.heads is deprecated: use dspark_jax\.drafts\.markov", {
        "draft_noise": "dspark_jax.drafts.markov", "sample_block": "dspark_jax.drafts.markov"}),
}


@pytest.mark.parametrize("old", list(ALIASES))
def test_deprecated_modules_warn_and_alias_the_new_homes(old):
    message, names = ALIASES[old]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module(old)  # the first import in this process warns here
    with pytest.warns(DeprecationWarning, match=message):
        importlib.reload(module)  # ... and every (re)execution of the module warns
    for name, home in names.items():
        assert getattr(module, name) is getattr(importlib.import_module(home), name), (old, name)


def test_qwen3_loader_lives_in_checkpoint_with_a_deprecated_alias():
    """Model modules never import checkpoint/ (issue 18); the old import path still works, with a warning."""
    import subprocess
    import sys

    code = ("import sys, dspark_jax.backbones, dspark_jax.backbones.qwen3; "
            "print(sorted(m for m in sys.modules if m.startswith('dspark_jax.checkpoint')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    import dspark_jax.backbones
    import dspark_jax.backbones.qwen3

    for mod in (dspark_jax.backbones.qwen3, dspark_jax.backbones):
        with pytest.warns(DeprecationWarning, match=r"moved to dspark_jax\.checkpoint\.qwen3_hf\.load_qwen3_hf"):
            old = mod.load_qwen3_hf
        assert old is load_qwen3_hf
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = dspark_jax.backbones.qwen3.no_such_name


def test_the_old_vanilla_loop_is_the_vanilla_head():
    """heads.markov_sample_loop(base, anchor, w1, w2, ...) = drafts.markov.sample_block("vanilla", ...)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dspark_jax import sampling
    from dspark_jax.drafts import markov

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        heads = importlib.import_module("dspark_jax.heads")
    k = jax.random.split(jax.random.key(0), 3)
    base, w1, w2 = (jax.random.normal(k[0], (2, 3, 40)), jax.random.normal(k[1], (40, 4)),
                    jax.random.normal(k[2], (40, 4)))
    anchor, seeds, first = jnp.array([1, 2]), jnp.array([3, 4], jnp.uint32), jnp.array([5, 6])
    sp = sampling.SamplingParams.make(2, temperature=[0.0, 1.0])
    old = heads.markov_sample_loop(base, anchor, w1, w2, sp, seeds, first)
    new = markov.sample_block("vanilla", {"embed": w1, "head": w2}, base, anchor, None, sp, seeds, first)
    for a, b in zip(old, new):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
