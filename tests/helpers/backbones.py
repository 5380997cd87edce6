"""Set-up shared by the backbone tests (backbones/, checkpoint/test_qwen3_hf.py): one jitted forward per
config, a decode schedule with rollbacks, a random Qwen3 model saved by transformers with its reference
outputs, and the tiny mHC backbone with non-trivial routing and mixing."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.backbones.mhc import MhcBackbone, MhcConfig
from dspark_jax.checkpoint.qwen3_hf import load_qwen3_hf

from helpers.paths import CONFIGS

QWEN_JSON = CONFIGS / "tiny_qwen3_backbone.json"
MHC_JSON = CONFIGS / "tiny_mhc_backbone.json"
B, MAX_LEN, N = 2, 24, 16  # batch, cache length, tokens of the reference sequences


_FORWARDS = {}


def jit_forward(bb):
    """One jitted forward per (family, config), so tests sharing shapes share executables."""
    key = (type(bb), bb.cfg)
    if key not in _FORWARDS:
        _FORWARDS[key] = jax.jit(bb.forward, static_argnames=("taps", "tap_mode"))
    return _FORWARDS[key]


def random_tokens(seed, shape, vocab=512):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def decode_schedule(bb, fwd, params, seq, prefill, steps, *, taps=(), garbage_seed=7):
    """Prefill `prefill` tokens, then per step forward T tokens of which the first n are the true
    continuation and the rest are junk (rejected drafts), commit n. Returns logits [B, M, V] and taps
    of the committed positions, in order, and the final cache."""
    b = seq.shape[0]
    rng = np.random.default_rng(garbage_seed)
    cache = bb.init_cache(b, MAX_LEN)
    out = fwd(params, cache, jnp.asarray(seq[:, :prefill]), taps=taps)
    cache = bb.commit(out.cache, jnp.full((b,), prefill, jnp.int32))
    logits, feats, pos = [out.logits], [out.taps], prefill
    for t, n in steps:
        chunk = np.concatenate([seq[:, pos:pos + n], rng.integers(0, 512, (b, t - n)).astype(np.int32)], axis=1)
        out = fwd(params, cache, jnp.asarray(chunk), taps=taps)
        assert int(out.cache.length[0]) == pos  # forward never advances the length
        cache = bb.commit(out.cache, jnp.full((b,), n, jnp.int32))
        logits.append(out.logits[:, :n])
        feats.append(out.taps[:, :n])
        pos += n
    return np.asarray(jnp.concatenate(logits, 1)), np.asarray(jnp.concatenate(feats, 1)), cache


# Calls of T = 4 or 1 tokens (few shapes, few compiles) committing fewer tokens than written (rollback),
# nothing (a fully rejected round), or all of them.
PREFILL = 4
FAMILY_TAPS = (0, 3, 1)  # most calls use these taps, so tests share compiled executables
STEPS = [(4, 2), (4, 1), (1, 1), (4, 4), (4, 0), (4, 3), (1, 1)]  # 4 + 12 committed = N


def hf_model(tied: bool):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    raw = json.loads(QWEN_JSON.read_text())
    raw["tie_word_embeddings"] = tied
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in raw.items() if k != "torch_dtype"})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(1 if tied else 0)
    model = transformers.Qwen3ForCausalLM(hf_cfg).eval().float()
    with torch.no_grad():  # random everything, norms around 1, so a swapped or mis-transposed tensor shows
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def qwen3_hf_fixture(tied, tmp_path_factory):
    torch = pytest.importorskip("torch")
    model = hf_model(tied)
    folder = tmp_path_factory.mktemp("qwen3_tied" if tied else "qwen3")
    model.save_pretrained(folder)
    cfg, params = load_qwen3_hf(folder)
    seq = random_tokens(0, (B, N))
    with torch.no_grad():
        ref = model(torch.tensor(seq, dtype=torch.long), output_hidden_states=True)
    hidden = [h.float().numpy() for h in ref.hidden_states]
    return model, folder, cfg, params, seq, ref.logits.float().numpy(), hidden


def mhc_fixture(moe: bool, kv_fp8: bool = True):
    # 4 Sinkhorn rounds instead of 20: half the compile time; nothing tested here depends on the count.
    cfg = MhcConfig.from_json(MHC_JSON).replace(hc_sinkhorn_iters=4, kv_fp8=kv_fp8)
    if not moe:
        cfg = cfg.replace(n_routed_experts=0)
    bb = MhcBackbone(cfg)
    params = bb.init_params(jax.random.key(3))
    # Random gate biases and hc biases, so that neither routing nor stream mixing is trivial.
    k1, k2 = jax.random.split(jax.random.key(4))
    layers = params["layers"]
    for sub in ("hc_attn", "hc_ffn"):
        layers[sub]["base"] = 0.5 * jax.random.normal(k1, layers[sub]["base"].shape)
    if cfg.n_routed_experts:
        layers["ffn"]["gate"]["bias"] = 0.3 * jax.random.normal(k2, layers["ffn"]["gate"]["bias"].shape)
    layers["attn"]["sink"] = jax.random.normal(k2, layers["attn"]["sink"].shape)
    return bb, params, jit_forward(bb)
