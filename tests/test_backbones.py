"""Backbones (dspark_jax.backbones): Qwen3 parity with transformers, cache + rollback, batch-row
independence, taps, config and checkpoint strictness, and the V4.1-style mHC backbone against a plain
cache-free reference written here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from spec_helpers import assert_within_one_fp8_step

from dspark_jax.backbones.base import BackboneOutput
from dspark_jax.backbones.mhc import MhcBackbone, MhcCache, MhcConfig
from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Cache, Qwen3Config, load_qwen3_hf
from dspark_jax.checkpoint.safetensors_io import CheckpointError
from dspark_jax.config import ConfigError
from dspark_jax.nn.mhc import hc_mixes, hc_post, hc_pre
from dspark_jax.nn.moe import moe_ffn, moe_route, swiglu_mlp
from dspark_jax.nn.norm import rms_norm
from dspark_jax.nn.quant import fp8_quant_dequant
from dspark_jax.nn.rope import apply_rope_interleaved

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
QWEN_JSON = CONFIGS / "tiny_qwen3_backbone.json"
MHC_JSON = CONFIGS / "tiny_mhc_backbone.json"
B, MAX_LEN, N = 2, 24, 16  # batch, cache length, tokens of the reference sequences


_FORWARDS = {}


def _jit_forward(bb):
    """One jitted forward per (family, config), so tests sharing shapes share executables."""
    key = (type(bb), bb.cfg)
    if key not in _FORWARDS:
        _FORWARDS[key] = jax.jit(bb.forward, static_argnames=("taps", "tap_mode"))
    return _FORWARDS[key]


def _tokens(seed, shape, vocab=512):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def _decode_schedule(bb, fwd, params, seq, prefill, steps, *, taps=(), garbage_seed=7):
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


# ---------------------------------------------------------------------------------------------------
# Qwen3 vs transformers
# ---------------------------------------------------------------------------------------------------


def _hf_model(tied: bool):
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


def _hf_fixture(tied, tmp_path_factory):
    torch = pytest.importorskip("torch")
    model = _hf_model(tied)
    folder = tmp_path_factory.mktemp("qwen3_tied" if tied else "qwen3")
    model.save_pretrained(folder)
    cfg, params = load_qwen3_hf(folder)
    seq = _tokens(0, (B, N))
    with torch.no_grad():
        ref = model(torch.tensor(seq, dtype=torch.long), output_hidden_states=True)
    hidden = [h.float().numpy() for h in ref.hidden_states]
    return model, folder, cfg, params, seq, ref.logits.float().numpy(), hidden


@pytest.fixture(scope="module")
def qwen3_hf(tmp_path_factory):
    """Untied: (torch model, checkpoint folder, loaded cfg, loaded params, seq, HF logits, HF hidden)."""
    return _hf_fixture(False, tmp_path_factory)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qwen3_hf_both(request, tmp_path_factory, qwen3_hf):
    return _hf_fixture(True, tmp_path_factory) if request.param else qwen3_hf


def test_qwen3_full_forward_matches_transformers(qwen3_hf_both):
    _, _, cfg, params, seq, ref, _ = qwen3_hf_both
    assert cfg.tie_word_embeddings == ("lm_head" not in params)
    bb = Qwen3Backbone(cfg)
    out = _jit_forward(bb)(params, bb.init_cache(B, MAX_LEN), jnp.asarray(seq))
    assert isinstance(out, BackboneOutput) and isinstance(out.cache, Qwen3Cache)
    assert out.logits.dtype == jnp.float32 and out.logits.shape == (B, N, cfg.vocab_size)
    assert out.taps.shape == (B, N, 0)
    np.testing.assert_allclose(np.asarray(out.logits), ref, atol=1e-4, rtol=0)


def test_qwen3_incremental_decoding_with_rollback_matches_transformers(qwen3_hf):
    _, _, cfg, params, seq, ref, hidden = qwen3_hf
    bb = Qwen3Backbone(cfg)
    logits, feats, cache = _decode_schedule(bb, _jit_forward(bb), params, seq, PREFILL, STEPS, taps=FAMILY_TAPS)
    m = logits.shape[1]
    assert m == PREFILL + sum(n for _, n in STEPS) and np.all(np.asarray(cache.length) == m)
    np.testing.assert_allclose(logits, ref[:, :m], atol=1e-4, rtol=0)
    want = np.concatenate([hidden[i][:, :m] for i in FAMILY_TAPS], axis=-1)
    np.testing.assert_allclose(feats, want, atol=1e-4, rtol=0)


def test_qwen3_taps_match_transformers_hidden_states(qwen3_hf):
    """HF hidden_states[i] is the entry of layer i (i < L); its last one is the final-normed output."""
    _, _, cfg, params, seq, _, hidden = qwen3_hf
    bb = Qwen3Backbone(cfg)
    fwd = _jit_forward(bb)
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


def test_qwen3_sharded_and_bf16_checkpoints_load(qwen3_hf, tmp_path):
    model, _, cfg, params, _, _, _ = qwen3_hf
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    cfg2, params2 = load_qwen3_hf(sharded)
    assert cfg2 == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)

    import torch
    half = tmp_path / "bf16"
    model.to(torch.bfloat16).save_pretrained(half)
    model.float()
    _, p16 = load_qwen3_hf(half, param_dtype="bfloat16")
    assert p16["embed"].dtype == jnp.bfloat16
    want = jax.tree.map(lambda a: np.asarray(a.astype(jnp.bfloat16)), params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), p16, want)

    # bf16 compute: f32 logits, bf16 taps and cache, close to the f32 model (bf16 rounding only).
    bb16 = Qwen3Backbone(cfg.replace(param_dtype="bfloat16", compute_dtype="bfloat16"))
    seq = jnp.asarray(_tokens(0, (B, N)))
    out16 = _jit_forward(bb16)(p16, bb16.init_cache(B, MAX_LEN), seq, taps=FAMILY_TAPS)
    out32 = _jit_forward(Qwen3Backbone(cfg))(params, Qwen3Backbone(cfg).init_cache(B, MAX_LEN), seq, taps=FAMILY_TAPS)
    assert (out16.logits.dtype, out16.taps.dtype, out16.cache.k.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)
    assert float(jnp.max(jnp.abs(out16.logits - out32.logits))) < 0.25 * float(jnp.std(out32.logits))


# ---------------------------------------------------------------------------------------------------
# Config and checkpoint strictness
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


def _rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_qwen3_loader_is_strict(qwen3_hf_both, tmp_path):
    _, folder, cfg, _, _, _, _ = qwen3_hf_both
    name = "model.layers.2.self_attn.k_proj.weight"
    bad = _rewrite(folder, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing.*'model\.layers\.2\.self_attn\.k_proj\.weight'"):
        load_qwen3_hf(bad)
    extra = {"model.layers.9.mlp.extra.weight": np.zeros(3, np.float32)}
    bad = _rewrite(folder, tmp_path / "extra", lambda t: t.update(extra))
    with pytest.raises(CheckpointError, match=r"unexpected.*'model\.layers\.9\.mlp\.extra\.weight'"):
        load_qwen3_hf(bad)
    bad = _rewrite(folder, tmp_path / "shape", lambda t: t.update({name: t[name][:-1]}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.self_attn\.k_proj\.weight' has shape \[63, 64\], "
                                              r"expected \[64, 64\]"):
        load_qwen3_hf(bad)
    if cfg.tie_word_embeddings:  # a stored head must then BE the embedding
        def differing_head(t):
            t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1
        with pytest.raises(CheckpointError, match=r"'lm_head\.weight' differs from 'model\.embed_tokens\.weight'"):
            load_qwen3_hf(_rewrite(folder, tmp_path / "head", differing_head))
        _, p = load_qwen3_hf(_rewrite(folder, tmp_path / "same_head", lambda t: t.update(
            {"lm_head.weight": t["model.embed_tokens.weight"]})))
        assert "lm_head" not in p
    else:  # an untied checkpoint without its head is incomplete
        with pytest.raises(CheckpointError, match=r"missing.*'lm_head\.weight'"):
            load_qwen3_hf(_rewrite(folder, tmp_path / "nohead", lambda t: t.pop("lm_head.weight")))


# ---------------------------------------------------------------------------------------------------
# The mHC backbone
# ---------------------------------------------------------------------------------------------------


def _mhc_fixture(moe: bool, kv_fp8: bool = True):
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
    return bb, params, _jit_forward(bb)


@pytest.fixture(scope="module")
def mhc():
    """The tiny config as shipped (MoE FFN)."""
    return _mhc_fixture(True)


@pytest.fixture(scope="module", params=["moe", "dense"])
def mhc_both(request, mhc):
    return mhc if request.param == "moe" else _mhc_fixture(False)


@pytest.fixture(scope="module", params=["kv_fp8", "smooth"])
def mhc_fp8_and_smooth(request, mhc):
    """The shipped tiny config, and the same weights with the fp8 KV rounding off."""
    return mhc if request.param == "kv_fp8" else _mhc_fixture(True, kv_fp8=False)


def reference_mhc(params, cfg: MhcConfig, tokens, attend_kv=None):
    """Cache-free, scan-free forward written from SPEC 2.4-2.6 with causal attention over the sequence.
    -> (logits [B, T, V], stream means at every layer entry and after the last layer [L+1][B, T, D],
    the reference's own latent KV rows [L, B, T, hd] (fp8-rounded when kv_fp8)).

    attend_kv [L, B, T, hd]: attend with these KV rows (the model's cache) instead of the reference's own.
    The model computes the same rows in another op order, so they differ in the last bits, and the fp8
    rounding turns a last-bit difference at a value near a rounding midpoint into a one-fp8-step change
    that moves the logits by up to 0.1 (measured). The caller checks the model's rows against the
    returned own rows to within one fp8 step; attending with the model's rows keeps everything after the
    rounding a smooth comparison."""
    b, t = tokens.shape
    hi = jax.lax.Precision.HIGHEST
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    rope = lambda x, p, inv=False: apply_rope_interleaved(x, p, theta=cfg.rope_theta, rope_dim=cfg.rope_head_dim,
                                                          inverse=inv)
    x = params["embed"][tokens]
    X = jnp.repeat(x[:, :, None, :], cfg.hc_mult, axis=2)
    pre = jnp.zeros((b, t, cfg.hc_mult)).at[..., 0].set(1.0)
    means, own_kv = [], []
    for i in range(cfg.n_layers):
        p = jax.tree.map(lambda a: a[i], params["layers"])
        means.append(X.mean(axis=2))
        mix = lambda hc: hc_mixes(X, hc["fn"], hc["base"], hc["scale"], iters=cfg.hc_sinkhorn_iters,
                                  eps=cfg.hc_eps, norm_eps=cfg.norm_eps)
        attn_pre, attn_post, attn_comb = mix(p["hc_attn"])
        h = rms_norm(hc_pre(X, pre), p["attn_norm"]["scale"], cfg.norm_eps)
        a = p["attn"]
        q = jnp.dot(rms_norm(jnp.dot(h, a["wq_a"]["kernel"], precision=hi), a["q_norm"]["scale"], cfg.norm_eps),
                    a["wq_b"]["kernel"], precision=hi).reshape(b, t, cfg.n_heads, cfg.head_dim)
        q = rope(q, pos[..., None])
        kv = rms_norm(jnp.dot(h, a["wkv"]["kernel"], precision=hi), a["kv_norm"]["scale"], cfg.norm_eps)
        kv = rope(kv, pos)
        if cfg.kv_fp8:
            kv = fp8_quant_dequant(kv)
        own_kv.append(kv)
        if attend_kv is not None:
            kv = jnp.asarray(attend_kv[i])
        s = jnp.einsum("bthd,bsd->bhts", q, kv, precision=hi) * cfg.head_dim ** -0.5
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        s = jnp.concatenate([s, jnp.broadcast_to(a["sink"][None, :, None, None], (b, cfg.n_heads, t, 1))], -1)
        w = jax.nn.softmax(s, axis=-1)[..., :-1]  # the sink takes probability mass, carries no value
        o = rope(jnp.einsum("bhts,bsd->bthd", w, kv, precision=hi), pos[..., None], True)
        o = o.reshape(b, t, cfg.o_groups, -1)
        o = jnp.einsum("btgi,gio->btgo", o, a["wo_a"]["kernel"], precision=hi).reshape(b, t, -1)
        y = jnp.dot(o, a["wo_b"]["kernel"], precision=hi)
        X = hc_post(y, X, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = mix(p["hc_ffn"])
        h = rms_norm(hc_pre(X, attn_pre), p["ffn_norm"]["scale"], cfg.norm_eps)
        f = p["ffn"]
        if cfg.n_routed_experts:
            flat = h.reshape(-1, cfg.dim)
            wts, idx = moe_route(flat, f["gate"]["kernel"], f["gate"]["bias"], top_k=cfg.n_activated_experts,
                                 route_scale=cfg.route_scale, score_func=cfg.score_func,
                                 norm_topk_prob=cfg.norm_topk_prob)
            y = moe_ffn(flat, wts, idx, f["experts"], f.get("shared"), limit=cfg.swiglu_limit).reshape(h.shape)
        else:
            y = swiglu_mlp(h, f["w1"], f["w3"], f["w2"], limit=cfg.swiglu_limit)
        X = hc_post(y, X, ffn_post, ffn_comb)
        pre = ffn_pre
    means.append(X.mean(axis=2))
    h = rms_norm(hc_pre(X, pre), params["norm"]["scale"], cfg.norm_eps)
    return jnp.einsum("btd,vd->btv", h, params["head"], precision=hi), means, jnp.stack(own_kv)


def test_mhc_full_forward_and_taps_match_reference(mhc_both):
    """Logits, taps and the cached KV rows against the reference. The KV rows go through the fp8
    rounding on both sides, computed in different op orders: they must agree to within one fp8 step
    (and at most 1% of them differ at all; a wrong position, a missing rounding or a wrong row fails);
    the reference then attends with the model's rows (see `reference_mhc`) so the logits and taps are
    a smooth comparison at 1e-4, which any error in attention, mixing, FFN or head exceeds."""
    bb, params, fwd = mhc_both
    cfg, D = bb.cfg, bb.dim
    seq = _tokens(1, (B, N))
    cache = bb.init_cache(B, MAX_LEN)
    out = fwd(params, cache, jnp.asarray(seq), taps=FAMILY_TAPS)
    assert isinstance(out.cache, MhcCache) and out.taps.shape == (B, N, 3 * D)
    model_kv = np.asarray(out.cache.kv[:, :, :N])
    ref_logits, means, ref_kv = reference_mhc(params, cfg, jnp.asarray(seq), attend_kv=model_kv)
    assert_within_one_fp8_step(model_kv, ref_kv, what="cached KV values")
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref_logits), atol=1e-4, rtol=0)
    assert float(jnp.std(ref_logits)) > 0.1  # not a degenerate model
    for j, layer in enumerate(FAMILY_TAPS):  # entry of layer i = mean of the streams entering it
        np.testing.assert_allclose(np.asarray(out.taps[..., j * D:(j + 1) * D]), np.asarray(means[layer]),
                                   atol=1e-4, rtol=0)
    np.testing.assert_array_equal(np.asarray(out.taps[..., :D]), np.asarray(bb.embed(params, jnp.asarray(seq))))
    if not cfg.n_routed_experts:
        return  # output-mode taps are the same code path; checked once (saves a compile)
    outp = fwd(params, cache, jnp.asarray(seq), taps=(-1, 2, cfg.n_layers - 1), tap_mode="output")
    for j, state in enumerate((0, 3, cfg.n_layers)):  # output of i = entry of i + 1; -1 = embeddings
        np.testing.assert_allclose(np.asarray(outp.taps[..., j * D:(j + 1) * D]), np.asarray(means[state]),
                                   atol=1e-4, rtol=0)


def test_mhc_incremental_decoding_with_rollback_matches_full(mhc_fp8_and_smooth):
    """Prefill + decode calls of 4 and 1 tokens with rollbacks = one full forward: the committed KV rows
    with the shipped fp8 rounding, the logits and taps with it off.

    The two sides compute the same rows in [B, 4], [B, 1] and [B, 16] calls, which XLA:CPU rounds
    differently in the last bits (~5e-6 on the KV rows). With the fp8 KV rounding a value sitting near a
    rounding midpoint then moves by one fp8 step, and every later logit of that row by up to 0.1, so with
    kv_fp8 on only the cache is compared: every committed row within one fp8 step, at most 1% of the values
    different. A wrong slot, a leaked rejected draft or a wrong position changes most of a row by O(1) and
    fails both variants; without the rounding the logits and taps must agree to 1e-4."""
    bb, params, fwd = mhc_fp8_and_smooth
    seq = _tokens(2, (B, N))
    taps = FAMILY_TAPS
    full = fwd(params, bb.init_cache(B, MAX_LEN), jnp.asarray(seq), taps=taps)
    logits, feats, cache = _decode_schedule(bb, fwd, params, seq, PREFILL, STEPS, taps=taps)
    m = logits.shape[1]
    assert np.all(np.asarray(cache.length) == m)
    if bb.cfg.kv_fp8:
        assert_within_one_fp8_step(cache.kv[:, :, :m], full.cache.kv[:, :, :m], what="cached KV values")
    else:
        np.testing.assert_allclose(cache.kv[:, :, :m], full.cache.kv[:, :, :m], atol=1e-4, rtol=0)
        np.testing.assert_allclose(logits, np.asarray(full.logits[:, :m]), atol=1e-4, rtol=0)
        np.testing.assert_allclose(feats, np.asarray(full.taps[:, :m]), atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------
# Both families: row independence, out-of-range writes, interface details
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_random():
    bb = Qwen3Backbone(Qwen3Config.from_hf_json(QWEN_JSON, tie_word_embeddings=False))  # = qwen3_hf's
    return bb, bb.init_params(jax.random.key(5)), _jit_forward(bb)


@pytest.fixture(params=["qwen3", "mhc"])
def family(request, qwen3_random, mhc):
    return qwen3_random if request.param == "qwen3" else mhc


def _cache_rows(cache):
    return [a for a in cache[1:]]  # the layer-stacked arrays [L, B, S, ...]


def test_rows_are_independent(family):
    """Rows with different committed lengths: changing the other row's tokens, length and cache contents
    leaves a row's logits, taps and cache unchanged."""
    bb, params, fwd = family

    def run(seq, lengths):
        out = fwd(params, bb.init_cache(B, MAX_LEN), jnp.asarray(seq[:, :N]), taps=FAMILY_TAPS)
        cache = bb.commit(out.cache, jnp.asarray(lengths, jnp.int32))
        return fwd(params, cache, jnp.asarray(seq[:, N:]), taps=FAMILY_TAPS)

    seq = _tokens(3, (B, N + 4))
    for row, other in ((0, 1), (1, 0)):
        changed = seq.copy()
        changed[other] = _tokens(4 + row, (N + 4,))
        lengths = [5, 12] if row == 0 else [12, 5]
        a = run(seq, lengths)
        c = run(changed, [lengths[row], 9] if row == 0 else [9, lengths[row]])
        np.testing.assert_allclose(np.asarray(a.logits[row]), np.asarray(c.logits[row]), atol=1e-6, rtol=0)
        np.testing.assert_allclose(np.asarray(a.taps[row]), np.asarray(c.taps[row]), atol=1e-6, rtol=0)
        for x, y in zip(_cache_rows(a.cache), _cache_rows(c.cache)):
            np.testing.assert_allclose(np.asarray(x[:, row]), np.asarray(y[:, row]), atol=1e-6, rtol=0)
        assert not np.allclose(np.asarray(a.logits[other]), np.asarray(c.logits[other]), atol=1e-3)


def test_writes_past_max_len_are_dropped_and_stale_entries_never_leak(family):
    bb, params, fwd = family
    seq = _tokens(5, (B, N))
    out = fwd(params, bb.init_cache(B, MAX_LEN), jnp.asarray(seq), taps=FAMILY_TAPS)
    cache = bb.commit(out.cache, jnp.asarray([N, 3], jnp.int32))
    # Row 0 writes positions 16..31 (only 16..23 fit); row 1 writes 3..18.
    new = _tokens(6, (B, N))
    out = fwd(params, cache, jnp.asarray(new), taps=FAMILY_TAPS)
    # Same call with other tokens at the positions that do not fit: the slots that do fit must not care
    # (no clipping of out-of-range writes onto the last slot).
    new2 = new.copy()
    new2[0, MAX_LEN - N:] = _tokens(7, (2 * N - MAX_LEN,))
    out2 = fwd(params, cache, jnp.asarray(new2), taps=FAMILY_TAPS)
    for before, after, after2 in zip(_cache_rows(cache), _cache_rows(out.cache), _cache_rows(out2.cache)):
        assert after.shape == before.shape
        np.testing.assert_array_equal(np.asarray(after[:, 0, :N]), np.asarray(before[:, 0, :N]))
        np.testing.assert_array_equal(np.asarray(after[:, 1, :3]), np.asarray(before[:, 1, :3]))
        assert not np.array_equal(np.asarray(after[:, 0, N:]), np.asarray(before[:, 0, N:]))
        np.testing.assert_array_equal(np.asarray(after2), np.asarray(after))
    assert np.all(np.isfinite(np.asarray(out.logits)))
    # Poison every uncommitted slot with NaN: a later call must not see it (masked AND zeroed).
    def poison(a):
        stale = jnp.arange(MAX_LEN)[None, :] >= cache.length[:, None]  # [B, S]
        return jnp.where(stale.reshape((1, B, MAX_LEN) + (1,) * (a.ndim - 3)), jnp.nan, a)
    poisoned = cache._replace(**{f: poison(getattr(cache, f)) for f in cache._fields[1:]})
    clean = fwd(params, cache, jnp.asarray(seq[:, :1]), taps=FAMILY_TAPS)
    dirty = fwd(params, poisoned, jnp.asarray(seq[:, :1]), taps=FAMILY_TAPS)
    np.testing.assert_array_equal(np.asarray(clean.logits), np.asarray(dirty.logits))
    np.testing.assert_array_equal(np.asarray(clean.taps), np.asarray(dirty.taps))


def test_interface_details(family):
    bb, params, fwd = family
    abstract = bb.abstract_params()
    assert jax.tree.structure(abstract) == jax.tree.structure(params)
    jax.tree.map(lambda a, p: (a.shape, a.dtype) == (p.shape, p.dtype) or pytest.fail(f"{a} vs {p.shape}"),
                 abstract, params)
    axes = bb.logical_axes()
    for spec in jax.tree.leaves(axes["layers"], is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)):
        assert spec[0] == "layers"
    tied = bb.tied(params)
    assert tied["embed"].shape == tied["head"].shape == (bb.vocab_size, bb.dim)
    ids = jnp.asarray([[1, 2, 3]])
    np.testing.assert_array_equal(np.asarray(bb.embed(params, ids)), np.asarray(tied["embed"][ids]))
    cache = bb.init_cache(2, 8)
    assert cache.length.dtype == jnp.int32 and cache.length.shape == (2,)
    with pytest.raises(ValueError, match=r"'taps' \[4\] out of range for tap_mode='entry' with 4 layers"):
        bb.forward(params, cache, jnp.zeros((2, 1), jnp.int32), taps=(4,))
    with pytest.raises(ValueError, match=r"'taps' \[-2\] out of range for tap_mode='output'"):
        bb.forward(params, cache, jnp.zeros((2, 1), jnp.int32), taps=(-2,), tap_mode="output")
    with pytest.raises(ValueError, match=r"'tap_mode' must be one of"):
        bb.forward(params, cache, jnp.zeros((2, 1), jnp.int32), tap_mode="exit")
    with pytest.raises(ValueError, match=r"'tokens' has batch 3 but the cache was built for batch 2"):
        bb.forward(params, cache, jnp.zeros((3, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"'n' must have shape \(2,\)"):
        bb.commit(cache, jnp.zeros((3,), jnp.int32))
    committed = jax.jit(bb.commit)(cache, jnp.asarray([2, 0]))
    assert committed.length.tolist() == [2, 0]


def test_mhc_config_errors():
    raw = json.loads(MHC_JSON.read_text())
    assert MhcConfig.from_dict({**raw, "vocab": 512}).vocab_size == 512
    with pytest.raises(ConfigError, match=r"'vocab_size' and its alias 'vocab' disagree"):
        MhcConfig.from_dict({**raw, "vocab": 100})
    with pytest.raises(ConfigError, match=r"'n_mtp_layers' is not an MhcConfig field"):
        MhcConfig.from_dict({**raw, "n_mtp_layers": 1})
    with pytest.raises(ConfigError, match=r"'o_groups': expected a divisor of n_heads=4"):
        MhcConfig.from_dict({**raw, "o_groups": 3})
    with pytest.raises(ConfigError, match=r"'head_dim': expected a multiple of 32 when kv_fp8"):
        MhcConfig.from_dict({**raw, "head_dim": 48})
    with pytest.raises(ConfigError, match=r"'n_activated_experts': expected at most n_routed_experts=4"):
        MhcConfig.from_dict({**raw, "n_activated_experts": 5})
