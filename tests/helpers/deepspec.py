"""The DeepSpec ("qwen3") draft family's test set-up: a DeepSpec checkpoint in its own layout, written
independently of our table, a numpy oracle that reads those tensors by their DeepSpec names (torch layout
[out, in]), and the tiny draft with a Qwen3 backbone (drafts/deepspec/, checkpoint/, test_bundle.py)."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import drafts
from dspark_jax import spec_round as sr
from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Config
from dspark_jax.checkpoint import deepspec as ckpt
from dspark_jax.checkpoint.trees import unflatten_paths

from helpers.oracles import np_markov_step
from helpers.paths import CONFIGS
from helpers.spec import scaled_markov_head

CFG = drafts.load_config(CONFIGS / "tiny_deepspec.json")
K = CFG.block_size
BCFG = Qwen3Config.from_hf_json(CONFIGS / "tiny_qwen3_backbone.json")


# ---------------------------------------------------------------------------------------------------
# A DeepSpec checkpoint in its own layout, written independently of our table, and a numpy oracle
# that reads those tensors by their DeepSpec names (torch layout [out, in]).
# ---------------------------------------------------------------------------------------------------


def hf_names(cfg):
    """The tensor names and shapes of a DeepSpec Qwen3 draft, spelled out from the format."""
    d, f, hd, v, r = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size, cfg.markov_rank
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out = {"embed_tokens.weight": (v, d), "lm_head.weight": (v, d), "norm.weight": (d,),
           "fc.weight": (d, len(cfg.target_layer_ids) * d), "hidden_norm.weight": (d,),
           "markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r),
           "confidence_head.proj.weight": (1, d + r), "confidence_head.proj.bias": (1,)}
    head = cfg.markov_head_type.lower()
    if head == "gated":  # full names: every layer also has an mlp.gate_proj
        out.update({"markov_head.gate_proj.weight": (r, d + r), "markov_head.gate_proj.bias": (r,)})
    if head == "rnn":
        out.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + d), "markov_head.joint_proj.bias": (3 * r,)})
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                    p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                    p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                    p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                    p + "mlp.down_proj.weight": (d, f)})
    return out


def random_hf_weights(cfg, seed=0):
    """bf16-representable float64 weights; norm scales far from 1 so a missing norm cannot hide."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in hf_names(cfg).items():
        if name.endswith("norm.weight"):
            w = 1.0 + 0.5 * rng.normal(size=shape)
        elif name == "confidence_head.proj.bias":
            w = np.array([0.7])
        elif name == "embed_tokens.weight":
            w = rng.normal(size=shape)
        else:
            w = rng.normal(size=shape) * shape[-1] ** -0.5
        out[name] = np.asarray(w.astype(ml_dtypes.bfloat16), np.float64)
    return out


def write_checkpoint(folder, cfg_dict, weights):
    """config.json + a bf16 model.safetensors, written by torch's safetensors (as DeepSpec releases are)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    try:
        import torch
        from safetensors.torch import save_file as torch_save
    except ImportError:  # our own writer then (still the DeepSpec names and layout)
        import ml_dtypes

        from dspark_jax.checkpoint.safetensors_io import save_file

        save_file(folder / "model.safetensors", {k: v.astype(ml_dtypes.bfloat16) for k, v in weights.items()})
        return
    torch_save({k: torch.tensor(v, dtype=torch.float32).to(torch.bfloat16) for k, v in weights.items()},
               str(folder / "model.safetensors"), metadata={"format": "pt"})


def np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_rope_half(x, pos, theta):
    """rotate_half RoPE with explicit pairs (i, i + d/2); x [n, heads, d], pos [n]."""
    x = np.asarray(x, np.float64)
    d = x.shape[-1]
    out = x.copy()
    for i in range(d // 2):
        ang = np.asarray(pos, np.float64) * theta ** (-2.0 * i / d)
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        out[..., i] = x[..., i] * c - x[..., i + d // 2] * s
        out[..., i + d // 2] = x[..., i + d // 2] * c + x[..., i] * s
    return out


def np_silu(x):
    return x / (1 + np.exp(-x))


def np_context(W, cfg, taps):
    """c = hidden_norm(fc(taps)) for taps [T, n_taps*D]."""
    return np_rms(taps @ W["fc.weight"].T, W["hidden_norm.weight"], cfg.rms_norm_eps)


def np_layer(W, cfg, i, x, block_pos, c, ctx_pos):
    """One DeepSpec layer: x [K, D] block rows, c [T, D] context features (all visible)."""
    p, eps, hd = f"layers.{i}.", cfg.rms_norm_eps, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    h = np_rms(x, W[p + "input_layernorm.weight"], eps)
    q = np_rms((h @ W[p + "self_attn.q_proj.weight"].T).reshape(len(x), nh, hd), W[p + "self_attn.q_norm.weight"], eps)
    q = np_rope_half(q, block_pos, cfg.rope_theta)

    def keys(src, pos):
        k = np_rms((src @ W[p + "self_attn.k_proj.weight"].T).reshape(len(src), nkv, hd),
                   W[p + "self_attn.k_norm.weight"], eps)
        return np_rope_half(k, pos, cfg.rope_theta), (src @ W[p + "self_attn.v_proj.weight"].T).reshape(len(src), nkv, hd)

    kc, vc = keys(c, ctx_pos)
    kb, vb = keys(h, block_pos)
    kk, vv = np.concatenate([kc, kb]), np.concatenate([vc, vb])  # context rows first
    o = np.zeros((len(x), nh, hd))
    for hh in range(nh):
        g = hh // (nh // nkv)
        s = q[:, hh] @ kk[:, g].T / np.sqrt(hd)  # no mask: every block row sees every key
        pr = np.exp(s - s.max(-1, keepdims=True))
        o[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ vv[:, g]
    x = x + o.reshape(len(x), -1) @ W[p + "self_attn.o_proj.weight"].T
    h = np_rms(x, W[p + "post_attention_layernorm.weight"], eps)
    return x + (np_silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)) @ \
        W[p + "mlp.down_proj.weight"].T


def np_propose(W, cfg, taps, anchor):
    """Greedy DeepSpec proposal for one request whose committed context is taps [T, n_taps*D] (positions
    0..T-1); the anchor sits at position T. -> (pre-norm h, biased logits, tokens, confidence logits)."""
    t = len(taps)
    c = np_context(W, cfg, taps)
    ids = [anchor] + [cfg.mask_token_id] * (cfg.block_size - 1)
    x = W["embed_tokens.weight"][ids]
    block_pos = t + np.arange(cfg.block_size)
    for i in range(cfg.num_hidden_layers):
        x = np_layer(W, cfg, i, x, block_pos, c, np.arange(t))
    final = np_rms(x, W["norm.weight"], cfg.rms_norm_eps)
    u = final @ W["lm_head.weight"].T
    w1, w2 = W["markov_head.markov_w1.weight"], W["markov_head.markov_w2.weight"]
    gate = joint = None
    if "markov_head.gate_proj.weight" in W:
        gate = W["markov_head.gate_proj.weight"], W["markov_head.gate_proj.bias"]
    if "markov_head.joint_proj.weight" in W:
        joint = W["markov_head.joint_proj.weight"], W["markov_head.joint_proj.bias"]
    prev, toks, logits, conf = anchor, [], [], []
    state = np.zeros(w1.shape[1])  # zero at the block start
    for k in range(cfg.block_size):
        _, bias, state = np_markov_step(cfg.markov_head_type.lower(), w1, w2, prev, final[k], state, gate, joint)
        lk = u[k] + bias  # Markov bias of the previous token (and, for rnn, of the ones before it)
        conf.append(np.concatenate([final[k], w1[prev]]) @ W["confidence_head.proj.weight"][0]
                    + W["confidence_head.proj.bias"][0])
        prev = int(np.argmax(lk))
        toks.append(prev)
        logits.append(lk)
    return x, np.array(logits), np.array(toks), np.array(conf)


@functools.lru_cache(maxsize=None)
def released_like(tmp_root, head_type="vanilla"):
    """A DeepSpec-layout checkpoint folder of the tiny config with a Markov head of `head_type` (written as
    given: DeepSpec reads it case-insensitively) -> (folder, float64 weights, raw config)."""
    from pathlib import Path

    folder = Path(tmp_root) / f"dspark_qwen3_tiny_block5_{head_type}"
    raw = {k: v for k, v in json.loads((CONFIGS / "tiny_deepspec.json").read_text()).items()
           if k not in ("family", "param_dtype", "compute_dtype")}
    raw.update(torch_dtype="bfloat16", num_anchors=512, bos_token_id=1, layer_types=["full_attention"] * 2,
               markov_head_type=head_type)
    weights = random_hf_weights(CFG.replace(markov_head_type=head_type), seed=3)
    write_checkpoint(folder, raw, weights)
    return folder, weights, raw


def our_params(weights, cfg=CFG):
    """Our tree from the float64 DeepSpec weights (through the loader's table transforms)."""
    flat = {}
    for it in ckpt.expand_table(cfg):
        fwd = ckpt.TRANSFORMS[it.entry.transform][0]
        parts = [fwd(weights[n]) for n in it.names]
        flat[it.path] = jnp.asarray(np.stack(parts) if it.entry.per_layer else parts[0], jnp.float32)
    return unflatten_paths(flat)


# ---------------------------------------------------------------------------------------------------
# The tiny draft with a Qwen3 backbone
# ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def pair(head_type="vanilla"):
    """(Qwen3 backbone, Weights) of the tiny pair; the draft has a Markov head of `head_type`, whose
    gate / joint parameters are drawn large enough to matter (their init is N(0, 0.02))."""
    bb = Qwen3Backbone(BCFG)
    bp = bb.init_params(jax.random.key(0))
    dp = drafts.init_params(CFG.replace(markov_head_type=head_type), jax.random.key(1))
    return bb, sr.Weights(bp, scaled_markov_head(dp, jax.random.key(2)), bb.tied(bp), jnp.ones(K))
