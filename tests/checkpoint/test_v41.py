"""The V4.1 `mtp.*` mapping (dspark_jax.checkpoint.v41): full-size fp8 / fp4 tensors dequantised bit-exactly,
strict loading of synthetic official-layout checkpoints, export -> load round trips, streaming conversion,
and loaded weights driving the draft.

The oracles are independent of the package (helpers.checkpoint): bit-layout encoders in plain numpy, a
10-line safetensors writer, and the V4.1 layout and its mapping onto our tree spelled out again from SPEC
section 3 and docs/params.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers.checkpoint import (F32_LEAVES, TINY, as_f64, build_v41_checkpoint, expected_tree, flat,
                                np_fp4_decode, np_fp4_encode, np_fp8_decode, np_fp8_encode, scale_of, st_write,
                                v41_layout)

from dspark_jax.checkpoint import v41
from dspark_jax.checkpoint.safetensors_io import CheckpointError, open_checkpoint
from dspark_jax.checkpoint.trees import unflatten_paths
from dspark_jax.drafts.v41.config import DSparkConfig

# ---------------------------------------------------------------------------------------------
# Full-size V4.1 tensors, read through the checkpoint path, bit-exact against numpy
# ---------------------------------------------------------------------------------------------
def test_full_size_fp8_wq_b_and_fp4_expert_dequantize_bit_exact(tmp_path):
    rng = np.random.default_rng(3)
    wq_b = "mtp.0.attn.wq_b.weight"
    q = rng.integers(0, 256, size=(32768, 1280), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x00
    qs = rng.integers(100, 150, size=(1024, 40), dtype=np.uint8)
    w1 = "mtp.0.ffn.experts.0.w1.weight"
    p = rng.integers(0, 256, size=(2304, 1280), dtype=np.uint8)
    ps = rng.integers(100, 150, size=(2304, 80), dtype=np.uint8)
    st_write(tmp_path / "a.safetensors", [
        (wq_b, "F8_E4M3", (32768, 1280), q.tobytes()), (scale_of(wq_b), "F8_E8M0", (1024, 40), qs.tobytes()),
        (w1, "I8", (2304, 1280), p.tobytes()), (scale_of(w1), "F8_E8M0", (2304, 80), ps.tobytes()),
        ("mtp.0.ffn.experts.1.w1.weight", "F4", (2304, 2560), p.tobytes()),
        ("mtp.0.ffn.experts.1.w1.scale", "F8_E8M0", (2304, 80), ps.tobytes()),
    ])
    reader = open_checkpoint(tmp_path / "a.safetensors")
    src = v41.detect(reader, wq_b, (32768, 1280))
    assert src.fmt == "fp8"
    got = v41.read_dequantized(reader, src, np.float32)
    ref = np_fp8_decode(q, qs)
    assert np.array_equal(got.astype(np.float64), ref)
    got16 = v41.read_dequantized(reader, src, ml_dtypes.bfloat16)  # fp8 values are exact in bf16
    assert np.array_equal(got16.astype(np.float64), ref)
    del got, got16, ref
    ref = np_fp4_decode(p, ps)
    for name in (w1, "mtp.0.ffn.experts.1.w1.weight"):  # I8 [out, in/2] and F4 [out, in] spellings
        src = v41.detect(reader, name, (2304, 2560))
        assert src.fmt == "fp4"
        got = v41.read_dequantized(reader, src, ml_dtypes.bfloat16)
        assert got.shape == (2304, 2560)
        assert np.array_equal(got.astype(np.float64), ref)


# ---------------------------------------------------------------------------------------------
# The V4.1 loader
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vision", [False, True])
def test_table_agrees_with_draft_and_docs(vision):
    cfg = TINY.replace(vision=vision)
    v41.check_table_against_draft(cfg)  # raises on any disagreement with dspark_jax.drafts
    from dspark_jax import drafts

    shapes = {tuple(str(k.key) for k in kp): tuple(x.shape) for kp, x in
              jax.tree_util.tree_flatten_with_path(drafts.abstract_params(cfg))[0]}
    assert shapes == v41.expected_shapes(cfg)
    # the router's image-token bias exists exactly in models with a vision tower
    assert (("blocks_0", "ffn", "gate", "bias_vl") in shapes) == vision


def _both_config_spellings(tmp_path) -> list[Path]:
    c = TINY
    common = {"vocab_size": c.vocab_size, "dspark_block_size": c.block_size, "dspark_noise_token_id": c.noise_token_id,
              "dspark_target_layer_ids": list(c.target_layer_ids), "dspark_markov_rank": c.markov_rank,
              "dspark_n_routed_experts": c.n_routed_experts, "n_shared_experts": c.n_shared_experts,
              "head_dim": c.head_dim, "q_lora_rank": c.q_lora_rank, "o_groups": c.o_groups,
              "o_lora_rank": c.o_lora_rank, "param_dtype": c.param_dtype, "compute_dtype": c.compute_dtype}
    hf = {"text_config": {**common, "hidden_size": c.dim, "num_nextn_predict_layers": c.n_layers,
                          "dspark_num_experts_per_tok": c.n_activated_experts,
                          "moe_intermediate_size": c.moe_inter_dim, "num_attention_heads": c.n_heads,
                          "qk_rope_head_dim": c.rope_head_dim, "sliding_window": c.window}}
    inference = {**common, "dim": c.dim, "n_mtp_layers": c.n_layers,
                 "dspark_n_activated_experts": c.n_activated_experts,
                 "moe_inter_dim": c.moe_inter_dim, "n_heads": c.n_heads, "rope_head_dim": c.rope_head_dim,
                 "window_size": c.window}
    paths = []
    for name, raw in (("hf", hf), ("inference", inference)):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(raw))
        paths.append(p)
    return paths


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_tiny_v41_matches_numpy(tiny_ckpt, tmp_path, dtype):
    folder, values = tiny_ckpt
    paths = _both_config_spellings(tmp_path)
    assert all(DSparkConfig.from_json(p) == TINY for p in paths)
    params, tied = v41.load_v41_draft(folder, paths[0] if dtype == "float32" else paths[1], dtype=dtype)
    got = flat(params)
    want = expected_tree(values, TINY)
    assert set(got) == set(want)
    for path, ref in want.items():
        leaf = got[path]
        assert leaf.shape == ref.shape, path
        is_f32 = path[-1] in F32_LEAVES or path[-2] in F32_LEAVES
        assert leaf.dtype == (np.float32 if is_f32 or dtype == "float32" else ml_dtypes.bfloat16), path
        assert np.array_equal(as_f64(leaf), ref), path  # fp8 / fp4 / bf16 values are exact in bf16
    assert np.array_equal(as_f64(tied["embed"]), values["embed.weight"])
    assert np.array_equal(as_f64(tied["head"]), values["head.weight"])


def test_load_fp4_as_F4_dtype_without_index(tmp_path):
    cfg = TINY.replace(n_layers=1)
    values = build_v41_checkpoint(tmp_path, cfg, seed=6, fp4_dtype="F4", n_files=2, index=False)
    params, _ = v41.load_v41_draft(tmp_path, cfg, dtype="float32")
    got, want = flat(params), expected_tree(values, cfg)
    for p in [k for k in want if "experts" in k]:
        assert np.array_equal(as_f64(got[p]), want[p])


def _tiny_case(tmp_path, **kw):
    build_v41_checkpoint(tmp_path, TINY, seed=7, n_files=2, **kw)
    return lambda: v41.load_v41_draft(tmp_path, TINY, dtype="float32")


@pytest.mark.parametrize("case,pattern", [
    ("missing", r"missing tensor 'mtp\.1\.attn\.wkv\.weight' \(expected shape \[64, 64\]\)"),
    ("missing_expert", r"missing tensor 'mtp\.0\.ffn\.experts\.7\.w2\.weight'"),
    ("missing_scale", r"tensor 'mtp\.0\.attn\.wq_b\.weight' is F8_E4M3 but its scale "
                      r"'mtp\.0\.attn\.wq_b\.scale' is missing"),
    ("missing_tied", r"missing tensor 'head\.weight'"),
    ("extra", r"unexpected tensor\(s\).*'mtp\.0\.attn\.foo\.weight'"),
    ("extra_expert", r"unexpected tensor\(s\).*'mtp\.1\.ffn\.experts\.8\.w1\.weight'"),
    ("extra_stage", r"unexpected tensor\(s\).*'mtp\.2\.norm\.weight'"),
    ("extra_scale", r"tensor 'mtp\.0\.ffn\.gate\.weight' is BF16 but 'mtp\.0\.ffn\.gate\.scale' exists"),
    ("misshaped", r"tensor 'mtp\.0\.attn\.wq_b\.weight': shape \[32, 256\], expected \[256, 32\]"),
    ("misshaped_plain", r"tensor 'mtp\.1\.markov_head\.embed\.weight': shape \[512, 8\], expected \[512, 16\]"),
    ("misshaped_fp4",
     r"tensor 'mtp\.0\.ffn\.experts\.3\.w1\.weight': shape \[32, 64\], expected \[32, 32\] \(packed fp4"),
    ("misshaped_scale", r"tensor 'mtp\.0\.attn\.wo_a\.scale': shape \[2, 2\], expected \[2, 4\]"),
    ("wrong_dtype", r"tensor 'mtp\.0\.attn\.wq_a\.weight': dtype I32 is not a weight storage dtype"),
    ("wrong_scale_dtype", r"tensor 'mtp\.0\.attn\.wkv\.scale': dtype U8, expected F8_E8M0"),
    ("nan_scale", r"mtp\.1\.attn\.wo_b\.scale: E8M0 scale byte 255 \(NaN\)"),
    ("nan_plain", r"tensor 'mtp\.1\.markov_head\.embed\.weight': 2 non-finite value\(s\) \(NaN or inf\)"),
])
def test_loader_is_strict(tmp_path, case, pattern):
    if case == "missing":
        load = _tiny_case(tmp_path, drop={"mtp.1.attn.wkv.weight"})
    elif case == "missing_expert":
        load = _tiny_case(tmp_path, drop={"mtp.0.ffn.experts.7.w2.weight", "mtp.0.ffn.experts.7.w2.scale"})
    elif case == "missing_scale":
        load = _tiny_case(tmp_path, drop={"mtp.0.attn.wq_b.scale"})
    elif case == "missing_tied":
        load = _tiny_case(tmp_path, drop={"head.weight"})
    elif case == "extra":
        load = _tiny_case(tmp_path, extra=[("mtp.0.attn.foo.weight", "BF16", (2,), bytes(4))])
    elif case == "extra_expert":
        load = _tiny_case(tmp_path, extra=[("mtp.1.ffn.experts.8.w1.weight", "I8", (32, 32), bytes(1024))])
    elif case == "extra_stage":
        load = _tiny_case(tmp_path, extra=[("mtp.2.norm.weight", "BF16", (64,), bytes(128))])
    elif case == "extra_scale":
        load = _tiny_case(tmp_path, extra=[("mtp.0.ffn.gate.scale", "F8_E8M0", (1, 2), bytes(2))])
    elif case == "misshaped":
        q = bytes(32 * 256)
        load = _tiny_case(tmp_path, replace={"mtp.0.attn.wq_b.weight": [("F8_E4M3", (32, 256), q),
                                                                        ("F8_E8M0", (1, 8), bytes(8))]})
    elif case == "misshaped_plain":
        load = _tiny_case(tmp_path, replace={"mtp.1.markov_head.embed.weight": [("BF16", (512, 8), bytes(512 * 16))]})
    elif case == "misshaped_fp4":
        load = _tiny_case(tmp_path, replace={"mtp.0.ffn.experts.3.w1.weight": [("I8", (32, 64), bytes(2048)),
                                                                               ("F8_E8M0", (32, 2), bytes(64))]})
    elif case == "misshaped_scale":
        load = _tiny_case(tmp_path, replace={"mtp.0.attn.wo_a.weight": [("F8_E4M3", (64, 128), bytes(8192)),
                                                                        ("F8_E8M0", (2, 2), bytes(4))]})
    elif case == "wrong_dtype":
        load = _tiny_case(tmp_path, replace={"mtp.0.attn.wq_a.weight": [("I32", (32, 64), bytes(4 * 2048))]})
    elif case == "wrong_scale_dtype":
        load = _tiny_case(tmp_path, replace={"mtp.0.attn.wkv.weight": [("F8_E4M3", (64, 64), bytes(4096)),
                                                                       ("U8", (2, 2), bytes(4))]})
    elif case == "nan_scale":
        load = _tiny_case(tmp_path, replace={"mtp.1.attn.wo_b.weight": [("F8_E4M3", (64, 64), bytes(4096)),
                                                                        ("F8_E8M0", (2, 2), b"\x7f\xff\x7f\x7f")]})
    elif case == "nan_plain":  # a bf16 NaN (0x7FC0) and +inf (0x7F80) among zeros
        load = _tiny_case(tmp_path, replace={"mtp.1.markov_head.embed.weight": [
            ("BF16", (512, 16), b"\xc0\x7f\x80\x7f" + bytes(512 * 16 * 2 - 4))]})
    with pytest.raises(CheckpointError, match=pattern):
        load()


# ---------------------------------------------------------------------------------------------
# Export -> load round trips, streaming conversion
# ---------------------------------------------------------------------------------------------
def _random_params(cfg, rng, dtype):
    shapes = v41.expected_shapes(cfg)
    tree = {}
    for p, s in shapes.items():
        f32 = p[-1] in F32_LEAVES or p[-2] in F32_LEAVES
        tree[p] = (rng.standard_normal(s) * 0.05).astype(np.float32 if f32 else dtype)
    return unflatten_paths(tree)


def test_export_bf16_roundtrip_is_exact(tmp_path):
    rng = np.random.default_rng(8)
    params = _random_params(TINY, rng, ml_dtypes.bfloat16)
    tied = {k: rng.standard_normal((TINY.vocab_size, TINY.dim)).astype(ml_dtypes.bfloat16) for k in ("embed", "head")}
    files = v41.export_v41_draft(params, tied, TINY, tmp_path, fmt="bf16", max_shard_bytes=200_000)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert idx["metadata"]["total_size"] == sum(open_checkpoint(f).total_bytes for f in files)
    reader = open_checkpoint(tmp_path)
    want = {n: ({"fp8": "BF16", "fp4": "BF16"}.get(k, k.upper()), shape) for n, k, shape in v41_layout(TINY)}
    assert {n: (reader.info(n).dtype, reader.info(n).shape) for n in reader.names} == want
    back, tied2 = v41.load_v41_draft(tmp_path, TINY, dtype="bfloat16")
    a, b = flat(params), flat(back)
    assert set(a) == set(b)
    for p in a:
        assert a[p].dtype == b[p].dtype and np.array_equal(a[p].view(np.uint8), b[p].view(np.uint8)), p
    for k in tied:
        assert np.array_equal(tied[k], tied2[k])


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_the_mtp_layout_refuses_a_non_vanilla_markov_head(tmp_path, head):
    """The official V4.1 layout has only the vanilla head: a gated / recurrent V4.1 draft is refused by
    name (export, load, conversion), pointing to the formats that hold it."""
    cfg = TINY.replace(markov_head_type=head)
    params = _random_params(TINY, np.random.default_rng(8), ml_dtypes.bfloat16)
    for call in (lambda: v41.export_v41_draft(params, None, cfg, tmp_path / "out", fmt="bf16"),
                 lambda: v41.load_v41_draft(tmp_path, cfg), lambda: v41.expand_table(cfg)):
        with pytest.raises(CheckpointError, match=f"only the vanilla Markov head.*'{head}'.*Orbax"):
            call()


@pytest.mark.parametrize("fp4_dtype", ["I8", "F4"])
def test_export_fp8_matches_reference_encoders(tmp_path, fp4_dtype):
    rng = np.random.default_rng(9)
    cfg = TINY
    params = _random_params(cfg, rng, np.float32)
    v41.export_v41_draft(params, None, cfg, tmp_path, fmt="fp8", fp4_dtype=fp4_dtype)
    reader = open_checkpoint(tmp_path / "model.safetensors")
    kinds = {n: (k, s) for n, k, s in v41_layout(cfg)}
    for n, (k, shape) in kinds.items():
        if n in v41.TIED.values():
            assert n not in reader
            continue
        info = reader.info(n)
        if k == "fp8":
            assert (info.dtype, info.shape) == ("F8_E4M3", shape)
            assert reader.info(scale_of(n)).shape == (-(-shape[0] // 32), -(-shape[1] // 32))
        elif k == "fp4":
            assert (info.dtype, info.shape) == (fp4_dtype, shape if fp4_dtype == "F4" else (shape[0], shape[1] // 2))
            assert reader.info(scale_of(n)).shape == (shape[0], shape[1] // 32)
        else:
            assert (info.dtype, info.shape) == (k.upper(), shape)
            assert n + ".scale" not in reader and not (n.endswith(".weight") and scale_of(n) in reader), n
    # The exported bytes are exactly those of the independent numpy encoders...
    wq_b = np.asarray(params["blocks_1"]["attn"]["wq_b"]["kernel"]).T
    rq, rs = np_fp8_encode(wq_b.astype(np.float64))
    assert np.array_equal(reader.read("mtp.1.attn.wq_b.weight").view(np.uint8), rq)
    assert np.array_equal(reader.read("mtp.1.attn.wq_b.scale").view(np.uint8), rs)
    w2 = np.asarray(params["blocks_0"]["ffn"]["experts"]["w2"][5]).T
    rp, rs = np_fp4_encode(w2.astype(np.float64))
    assert np.array_equal(reader.read("mtp.0.ffn.experts.5.w2.weight").view(np.uint8), rp)
    assert np.array_equal(reader.read("mtp.0.ffn.experts.5.w2.scale").view(np.uint8), rs)
    # ...and loading gives back every leaf within its format's precision (bf16 / f32 ones exactly).
    back, tied = v41.load_v41_draft(tmp_path, cfg, dtype="float32", with_tied=False)
    assert tied is None
    a, b = flat(params), flat(back)
    for p in a:
        x, y = as_f64(a[p]), as_f64(b[p])
        amax = np.abs(x).max()
        if p[-1] in F32_LEAVES or p[-2] in F32_LEAVES:
            assert np.array_equal(x, y), p
        elif "experts" in p:  # e2m1: spacing <= 1/3 of the value above 1 (4->6), 0.5 * scale below
            assert np.all(np.abs(x - y) <= np.maximum(np.abs(x) / 4, amax / 12)), p
        elif p[-1] == "kernel" and p[-2] in ("main_proj", "wq_a", "wq_b", "wkv", "wo_a", "wo_b") or "shared" in p:
            # e4m3: half a step is 2^-4 relative, or 2^-10 * scale < amax * 2^-17 in the subnormals
            assert np.all(np.abs(x - y) <= np.maximum(np.abs(x) * 2.0 ** -4, amax * 2.0 ** -17)), p
        else:  # stored bf16: round to nearest bf16
            assert np.array_equal(y, x.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)), p


def test_streaming_conversion_roundtrip(tiny_ckpt, tmp_path):
    folder, values = tiny_ckpt
    ref, ref_tied = v41.load_v41_draft(folder, TINY, dtype="float32")
    v41.convert_v41_safetensors(folder, TINY, tmp_path / "bf16", fmt="bf16", max_shard_bytes=100_000)
    v41.convert_v41_safetensors(tmp_path / "bf16", TINY, tmp_path / "fp8", fmt="fp8")
    r = open_checkpoint(tmp_path / "bf16")
    assert r.info("mtp.0.main_proj.weight").dtype == "BF16" and "layers.0.attn.wq_a.weight" not in r
    for d in ("bf16", "fp8"):  # dequantised and re-quantised values are all exact
        got, tied = v41.load_v41_draft(tmp_path / d, TINY, dtype="float32")
        for p, x in flat(ref).items():
            assert np.array_equal(x, flat(got)[p]), (d, p)
        assert np.array_equal(tied["embed"], ref_tied["embed"])


# ---------------------------------------------------------------------------------------------
# Loaded weights drive the draft
# ---------------------------------------------------------------------------------------------
def test_export_load_then_draft_propose(tmp_path):
    from dspark_jax import drafts, sampling

    cfg = TINY
    rng = np.random.default_rng(10)

    def init(path, a):  # drafts.init_params compiles for ~20 s on CPU; same tree, random values
        keys = [k.key for k in path]
        if keys[-1] == "scale" and keys[-2].endswith("norm"):
            return (1.0 + 0.1 * rng.standard_normal(a.shape)).astype(a.dtype)
        return (rng.standard_normal(a.shape) * 0.1).astype(a.dtype)

    params = jax.tree_util.tree_map_with_path(init, drafts.abstract_params(cfg))
    tied = {k: (rng.standard_normal((cfg.vocab_size, cfg.dim)) * 0.05).astype(np.float32) for k in ("embed", "head")}
    v41.export_v41_draft(params, tied, cfg, tmp_path, fmt="bf16")
    loaded, loaded_tied = v41.load_v41_draft(tmp_path, cfg, dtype="float32")
    assert jax.tree.structure(loaded) == jax.tree.structure(params)

    def through_bf16(path, x):  # what the bf16 layout keeps of each leaf
        keys = [k.key for k in path]
        if keys[-1] in F32_LEAVES or keys[-2] in F32_LEAVES:
            return x
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)

    expect = jax.tree_util.tree_map_with_path(through_bf16, params)
    expect_tied = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in tied.items()}
    for (kp, a), b in zip(jax.tree_util.tree_flatten_with_path(expect)[0], jax.tree.leaves(loaded)):
        assert np.array_equal(a, b), jax.tree_util.keystr(kp)

    batch = 2
    main_hidden = jnp.asarray(rng.standard_normal((batch, 7, cfg.main_hidden_dim)).astype(np.float32))
    anchor = jnp.array([3, 17], jnp.int32)
    sp = sampling.SamplingParams.greedy(batch)
    seeds = jnp.array([1, 2], jnp.uint32)

    @jax.jit
    def run(p, t):
        state = drafts.prefill(p, cfg, drafts.init_state(cfg, batch), main_hidden, jnp.array([7, 5], jnp.int32))
        return drafts.propose(p, t, cfg, state, anchor, sp, seeds)

    out = run(jax.tree.map(jnp.asarray, loaded), jax.tree.map(jnp.asarray, loaded_tied))
    ref = run(jax.tree.map(jnp.asarray, expect), jax.tree.map(jnp.asarray, expect_tied))
    assert out.tokens.shape == (batch, cfg.block_size) and out.logits.shape == (batch, cfg.block_size, cfg.vocab_size)
    assert bool(jnp.all(jnp.isfinite(out.logits))) and bool(jnp.all(jnp.isfinite(out.conf_logits)))
    assert np.array_equal(out.tokens, ref.tokens)
    assert np.array_equal(out.logits, ref.logits)
