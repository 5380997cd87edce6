"""The tiny V4.1 draft with non-trivial parameters (drafts/v41/test_model.py, nn/test_attention.py)."""

import functools

import jax

from dspark_jax import drafts
from dspark_jax.drafts.v41.config import DSparkConfig

from helpers.paths import CONFIGS

CFG = DSparkConfig.from_json(CONFIGS / "tiny_v41.json")


@functools.lru_cache(maxsize=None)
def tiny(seed=0):
    params = drafts.init_params(CFG, jax.random.key(seed))
    # Non-trivial sinks, gate biases and hc params so the tests can see them.
    k = jax.random.split(jax.random.key(seed + 100), 4)
    for s in range(CFG.n_layers):
        blk = params[f"blocks_{s}"]
        blk["attn"]["sink"] = jax.random.normal(k[0], blk["attn"]["sink"].shape)
        blk["hc_attn"]["base"] = jax.random.normal(k[1], blk["hc_attn"]["base"].shape)
        blk["hc_ffn"]["fn"] = blk["hc_ffn"]["fn"] * 20
    v, d = CFG.vocab_size, CFG.dim
    tied = {"embed": jax.random.normal(k[2], (v, d)), "head": jax.random.normal(k[3], (v, d)) * d ** -0.5}
    return params, tied
