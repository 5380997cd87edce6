"""Weights resident at checkpoint precision (dspark_jax.nn.packed): fp8 / fp4 kernels stay packed on
device and are dequantised inside the jitted computation.

The packed decoders are checked bit for bit against `checkpoint.formats` (itself checked against the
independent `official_writer`); a tiny V4.1 draft written by `official_writer` in the official fp8 / fp4
layout runs identically from its packed and its load-time-dequantised trees; the packed tree's bytes are
the checkpoint's; shardings and shape errors name what they concern.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import CONFIGS
from helpers.official_writer import official_v41_tensors, write_sharded

from dspark_jax import drafts, sampling
from dspark_jax import spec_round as sr
from dspark_jax.backbones.mhc import MhcBackbone, MhcConfig
from dspark_jax.checkpoint import formats, v41
from dspark_jax.checkpoint.safetensors_io import open_checkpoint
from dspark_jax.drafts.v41.config import DSparkConfig
from dspark_jax.nn import packed
from dspark_jax.parallel import make_mesh
from dspark_jax.serve import decode_state as ds

TINY = DSparkConfig.from_json(CONFIGS / "tiny_v41.json")
BF16_OFFICIAL = dict(param_dtype="bfloat16", compute_dtype="bfloat16", act_fp8=True)  # SPEC 2.9 numerics


# ---------------------------------------------------------------------------------------------
# (a) the jnp decoders equal the host decoders, bit for bit
# ---------------------------------------------------------------------------------------------
def _random_bytes(rng, shape, exclude=()):
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    for x in exclude:  # redraw forbidden bytes as a fixed valid one
        b[b == x] = 0x3C
    return b


def _exponents(rng, shape):
    # Exponent bytes whose products stay normal numbers: backends may flush subnormals (module doc).
    return rng.integers(64, 191, size=shape, dtype=np.uint8)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(64, 96), (40, 50), (33, 1), (3, 70, 36)])  # [..., out, in] (checkpoint)
def test_fp8_blocks_dequantize_equals_formats(shape, dtype):
    rng = np.random.default_rng(sum(shape))
    *lead, n_out, n_in = shape
    w = _random_bytes(rng, shape, exclude=(0x7F, 0xFF))  # every E4M3 code but NaN
    s = _exponents(rng, (*lead, *formats.fp8_scale_shape((n_out, n_in))))
    node = packed.Fp8Blocks(np.swapaxes(w, -1, -2).view(ml_dtypes.float8_e4m3fn), np.swapaxes(s, -1, -2))
    assert node.shape == (*lead, n_in, n_out)
    got = jax.jit(packed.dequantize, static_argnums=1)(node, dtype)
    assert got.shape == (*lead, n_in, n_out) and got.dtype == dtype
    ref_dt = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float32
    w2, s2 = w.reshape(-1, n_out, n_in), s.reshape(-1, *s.shape[-2:])
    want = np.stack([formats.dequantize_fp8_block(w2[i], s2[i], ref_dt).T for i in range(w2.shape[0])])
    np.testing.assert_array_equal(_bits(got).reshape(want.shape), _bits(want))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(64, 96), (40, 50), (33, 2), (3, 20, 48)])  # [..., out, in]; in even
def test_fp4_blocks_dequantize_equals_formats(shape, dtype):
    rng = np.random.default_rng(sum(shape))
    *lead, n_out, n_in = shape
    p = _random_bytes(rng, (*lead, n_out, n_in // 2))  # every pair of E2M1 codes
    s = _exponents(rng, (*lead, *formats.fp4_scale_shape((n_out, n_in))))
    node = packed.Fp4Blocks(np.swapaxes(p, -1, -2), np.swapaxes(s, -1, -2))
    assert node.shape == (*lead, n_in, n_out)
    got = jax.jit(packed.dequantize, static_argnums=1)(node, dtype)
    assert got.shape == (*lead, n_in, n_out) and got.dtype == dtype
    ref_dt = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float32
    p2, s2 = p.reshape(-1, n_out, n_in // 2), s.reshape(-1, *s.shape[-2:])
    want = np.stack([formats.dequantize_fp4(p2[i], s2[i], ref_dt).T for i in range(p2.shape[0])])
    np.testing.assert_array_equal(_bits(got).reshape(want.shape), _bits(want))


def test_as_compute_leaves_plain_arrays_to_astype():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4)), jnp.float32)
    np.testing.assert_array_equal(_bits(packed.as_compute(x, jnp.bfloat16)), _bits(x.astype(jnp.bfloat16)))
    assert not packed.is_packed(x)


# ---------------------------------------------------------------------------------------------
# A tiny official-layout checkpoint, loaded both ways
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("official_fp8")
    write_sharded(d, official_v41_tensors(TINY, np.random.default_rng(0), fmt="fp8"), 3, metadata={"format": "pt"})
    return d


@functools.lru_cache(maxsize=None)
def _load(path, weights):
    return v41.load_v41_draft(path, TINY, weights=weights)


def _leaf(tree, path):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def test_packed_load_keeps_the_stored_bytes(ckpt):
    pp, _ = _load(ckpt, "packed")
    r = open_checkpoint(ckpt)
    wq_a = _leaf(pp, "blocks_1/attn/wq_a/kernel")
    assert isinstance(wq_a, packed.Fp8Blocks) and wq_a.values.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(wq_a.values.view(np.uint8), r.view("mtp.1.attn.wq_a.weight").view(np.uint8).T)
    np.testing.assert_array_equal(wq_a.exponents, r.view("mtp.1.attn.wq_a.scale").view(np.uint8).T)
    w2 = _leaf(pp, "blocks_0/ffn/experts/w2")
    assert isinstance(w2, packed.Fp4Blocks) and w2.shape == (TINY.n_routed_experts, TINY.moe_inter_dim, TINY.dim)
    np.testing.assert_array_equal(w2.packed[5], r.view("mtp.0.ffn.experts.5.w2.weight").view(np.uint8).T)
    np.testing.assert_array_equal(w2.exponents[5], r.view("mtp.0.ffn.experts.5.w2.scale").view(np.uint8).T)
    assert isinstance(_leaf(pp, "blocks_0/ffn/shared/w1"), packed.Fp8Blocks)
    assert isinstance(_leaf(pp, "main_proj/kernel"), packed.Fp8Blocks)
    # wo_a (regrouped layout) and the bf16 / f32 tensors are plain, as in the dequantised tree
    pd, _ = _load(ckpt, "dequantized")
    for path in ("blocks_0/attn/wo_a/kernel", "blocks_0/ffn/gate/kernel", "blocks_0/hc_attn/fn", "markov/embed"):
        a, b = _leaf(pp, path), _leaf(pd, path)
        assert isinstance(a, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), path
    # every packed leaf dequantises to the dequantised loader's leaf
    for path, node in _packed_leaves(pp):
        want = np.asarray(_leaf(pd, path), np.float32)
        np.testing.assert_array_equal(np.asarray(packed.dequantize(node, jnp.float32)), want, err_msg=path)


def _packed_leaves(tree):
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=packed.is_packed)
    return [("/".join(k.key for k in kp), x) for kp, x in flat if packed.is_packed(x)]


def test_abstract_packed_params_is_the_loaded_tree(ckpt):
    pp, _ = _load(ckpt, "packed")
    ab = v41.abstract_packed_params(TINY)
    assert jax.tree.structure(ab) == jax.tree.structure(pp)
    for a, x in zip(jax.tree.leaves(ab), jax.tree.leaves(pp)):
        assert (a.shape, np.dtype(a.dtype)) == (x.shape, x.dtype)
    assert len(_packed_leaves(pp)) == 1 + TINY.n_layers * 10  # main_proj; wq_a, wq_b, wkv, wo_b, 3 shared, 3 experts


def test_bf16_checkpoint_stays_unquantised_when_packed(tmp_path):
    write_sharded(tmp_path, official_v41_tensors(TINY, np.random.default_rng(0), fmt="bf16"), 1)
    pp, _ = v41.load_v41_draft(tmp_path, TINY, weights="packed")
    assert not _packed_leaves(pp)
    with pytest.raises(v41.CheckpointError, match="weights 'fp8': expected one of"):
        v41.load_v41_draft(tmp_path, TINY, weights="fp8")


# ---------------------------------------------------------------------------------------------
# (b) the draft computes the same from both trees
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=1)
def _prefill_propose(params, cfg, tied, hidden, num_valid, anchor):
    b = anchor.shape[0]
    st = drafts.prefill(params, cfg, drafts.init_state(cfg, b), hidden, num_valid, impl="xla")
    sp, seeds = sampling.SamplingParams.greedy(b), jnp.arange(b, dtype=jnp.uint32)
    return drafts.propose(params, tied, cfg, st, anchor, sp, seeds, impl="xla")


@pytest.mark.parametrize("numerics", ["f32", "bf16_official"])
def test_propose_from_packed_weights_equals_dequantised(ckpt, numerics):
    """Identical, not merely close: the packed tree dequantises to the very numbers the loader gives."""
    cfg = TINY.replace(**BF16_OFFICIAL) if numerics == "bf16_official" else TINY
    pd, tied = _load(ckpt, "dequantized")
    pp, _ = _load(ckpt, "packed")
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(3, 24, cfg.main_hidden_dim)), cfg.compute_dtype)
    args = (tied, hidden, jnp.array([24, 9, 17]), jnp.array([3, 4, 500]))
    want = _prefill_propose(pd, cfg, *args)
    got = _prefill_propose(pp, cfg, *args)
    assert np.std(np.asarray(want.logits)) > 0.1  # a real forward, not a degenerate one
    for name in ("tokens", "logits", "conf_logits", "hidden", "markov_emb"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)


def test_jitted_arguments_are_the_packed_bytes(ckpt):
    """The compiled program's arguments are the packed bytes (so the dequantised kernels can only be its
    temporaries): its argument bytes are the packed tree's plus the other inputs', nothing more."""
    pd, tied = _load(ckpt, "dequantized")
    pp, _ = _load(ckpt, "packed")
    hidden = jnp.zeros((3, 24, TINY.main_hidden_dim), jnp.float32)  # the shapes of the test above
    args = (tied, hidden, jnp.array([24, 9, 17]), jnp.array([3, 4, 500]))
    mem = _prefill_propose.lower(pp, TINY, *args).compile().memory_analysis()
    if mem is None:
        pytest.skip("this backend reports no memory analysis")
    assert mem.argument_size_in_bytes == packed.nbytes(pp) + packed.nbytes(args)
    assert packed.nbytes(pp) < 0.6 * packed.nbytes(pd)


def _spec_weights(draft_params):
    bb = MhcBackbone(MhcConfig.from_json(CONFIGS / "tiny_mhc_backbone.json").replace(kv_fp8=False))
    bp = bb.init_params(jax.random.key(0))
    return sr.SpecModel(bb, TINY, impl="xla"), sr.Weights(bp, draft_params, bb.tied(bp), jnp.ones(TINY.block_size))


@pytest.mark.slow  # two spec-round compiles (one per tree)
def test_greedy_spec_rounds_from_packed_weights_emit_the_same_tokens(ckpt):
    n, rounds, maxlen, k = 3, 6, 64, TINY.block_size
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, 512, (n, 7)), jnp.int32)
    plen, active = jnp.array([7, 3, 5]), jnp.ones(n, bool)
    sp, seeds = sampling.SamplingParams.greedy(n), jnp.arange(n, dtype=jnp.uint32)
    rnd = jax.jit(sr.spec_round, static_argnums=0, static_argnames=("width", "mode", "filtering"))
    out = {}
    for weights_mode in ("dequantized", "packed"):
        model, weights = _spec_weights(_load(ckpt, weights_mode)[0])
        state, first = sr.start(model, weights, sr.init_state(model, n, maxlen), prompt, plen, active, sp, seeds)
        rec = {"tokens": [np.asarray(first)[:, None]], "num_accepted": [], "conf_logits": []}
        for _ in range(rounds):
            state, o = rnd(model, weights, state, sp, seeds, active, width=k + 1, mode="fixed",
                           num_verify=jnp.full(n, k))
            for name in rec:
                rec[name].append(np.asarray(o.tokens if name == "tokens" else getattr(o, name)))
        out[weights_mode] = {name: np.concatenate(v, axis=-1) for name, v in rec.items()}
        out[weights_mode]["ring"] = np.asarray(state.draft.ring)  # the draft's context rows, written each round
    # the emitted tokens are the backbone's either way (lossless); the draft's side must match too
    for name in ("tokens", "num_accepted", "conf_logits", "ring"):
        np.testing.assert_array_equal(out["packed"][name], out["dequantized"][name], err_msg=name)


# ---------------------------------------------------------------------------------------------
# (c) bytes
# ---------------------------------------------------------------------------------------------
def _device_bytes(tree) -> int:
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards)


def test_packed_tree_holds_the_checkpoint_bytes_on_device(ckpt):
    r = open_checkpoint(ckpt)
    stored = {n: r.info(n).nbytes for n in r.names if n.startswith("mtp.")}
    ckpt_bytes = sum(stored.values())
    pp, _ = _load(ckpt, "packed")
    pd, _ = _load(ckpt, "dequantized")
    on_device = _device_bytes(jax.device_put(pp))
    assert on_device == packed.nbytes(pp)
    # exactly the checkpoint's bytes, but wo_a: dequantised to bf16 (2 bytes for its 1-byte fp8 + scale)
    wo_a = [n for n in stored if n.endswith("attn.wo_a.weight")]
    extra = sum(r.info(n).nbytes - stored[v41.scale_name(n)] for n in wo_a)
    assert on_device == ckpt_bytes + extra and on_device <= 1.1 * ckpt_bytes
    assert _device_bytes(jax.device_put(pd)) == packed.nbytes(pd) > 1.5 * on_device


def test_flash_size_packed_tree_traces_at_checkpoint_size():
    """At V4.1-Flash size, abstractly: ~7.93 GB stored, ~8.03 GB packed (wo_a bf16), ~28.5 GB dequantised,
    and the draft accepts the packed tree (shapes only, nothing materialised)."""
    cfg = DSparkConfig.from_json(CONFIGS / "deepseek_v41_flash.json")
    ab = v41.abstract_packed_params(cfg)
    w1 = _leaf(ab, "blocks_0/ffn/experts/w1")
    assert (w1.packed.shape, w1.exponents.shape) == ((128, 2560, 2304), (128, 160, 2304))
    assert 7.9e9 < packed.nbytes(ab) < 8.1e9
    assert packed.nbytes(drafts.abstract_params(cfg)) > 3.5 * packed.nbytes(ab)  # the bf16 tree
    b = 1
    tied = {k: jax.ShapeDtypeStruct((cfg.vocab_size, cfg.dim), jnp.bfloat16) for k in ("embed", "head")}
    st = jax.eval_shape(lambda: drafts.init_state(cfg, b))
    out = jax.eval_shape(lambda p, t, s: drafts.propose(p, t, cfg, s, jnp.zeros(b, jnp.int32),
                                                        sampling.SamplingParams.greedy(b), jnp.zeros(b, jnp.uint32),
                                                        impl="xla"), ab, tied, st)
    assert out.logits.shape == (b, cfg.block_size, cfg.vocab_size)


# ---------------------------------------------------------------------------------------------
# Placement
# ---------------------------------------------------------------------------------------------
def test_shardings_of_a_packed_tree(ckpt):
    pp, _ = _load(ckpt, "packed")
    mesh = make_mesh(fsdp=4, expert=2)
    dense = drafts.param_shardings(TINY, mesh)
    sh = drafts.param_shardings(TINY, mesh, pp)
    w1, w1_dense = _leaf(sh, "blocks_0/ffn/experts/w1"), _leaf(dense, "blocks_0/ffn/experts/w1")
    assert tuple(w1_dense.spec) == ("expert", "fsdp", None)
    assert tuple(w1.packed.spec) == ("expert", "fsdp", None)  # [8, 32, 32]: the kernel's spec
    assert tuple(w1.exponents.spec) == ("expert", None, None)  # [8, 2, 32]: 2 rows do not split 4 ways
    wq_a = _leaf(sh, "blocks_0/attn/wq_a/kernel")
    assert tuple(_leaf(dense, "blocks_0/attn/wq_a/kernel").spec) == ("fsdp", None)
    assert tuple(wq_a.values.spec) == ("fsdp", None) and tuple(wq_a.exponents.spec) == (None, None)
    # the serving placement accepts packed weights and puts them where it says
    model, weights = _spec_weights(pp)
    placed = jax.device_put(weights, ds.weight_shardings(model, weights, mesh))
    got = _leaf(placed.draft, "blocks_0/ffn/experts/w1")
    assert got.packed.sharding.spec == w1.packed.spec and got.packed.dtype == np.uint8
    assert _device_bytes(placed.draft) < _device_bytes(jax.device_put(pp)) * 8  # sharded, not 8 copies


# ---------------------------------------------------------------------------------------------
# (d) wrong shapes are named
# ---------------------------------------------------------------------------------------------
def _trace_propose(params, ckpt):
    _, tied = _load(ckpt, "dequantized")
    b = 2
    st = drafts.init_state(TINY, b)
    jax.eval_shape(lambda p: drafts.propose(p, tied, TINY, st, jnp.zeros(b, jnp.int32),
                                            sampling.SamplingParams.greedy(b), jnp.zeros(b, jnp.uint32), impl="xla"),
                   params)


def _replace(tree, path, value):
    *head, last = path.split("/")
    out = jax.tree.map(lambda x: x, tree, is_leaf=packed.is_packed)  # a copy of the dicts
    node = out
    for k in head:
        node = node[k]
    node[last] = value
    return out


def test_packed_kernel_with_a_wrong_logical_shape_names_the_parameter(ckpt):
    pp, _ = _load(ckpt, "packed")
    _trace_propose(pp, ckpt)  # the unchanged tree traces
    k = _leaf(pp, "blocks_1/attn/wq_b/kernel")  # [32, 256]
    bad = packed.Fp8Blocks(k.values[:, :224], k.exponents[:, :7])
    with pytest.raises(ValueError, match=r"packed parameter 'blocks_1/attn/wq_b/kernel' \(Fp8Blocks\): logical "
                                         r"shape \[32, 224\], the module declares \[32, 256\]"):
        _trace_propose(_replace(pp, "blocks_1/attn/wq_b/kernel", bad), ckpt)
    e = _leaf(pp, "blocks_0/ffn/experts/w3")  # [8, 64, 32]
    with pytest.raises(ValueError, match=r"'blocks_0/ffn/experts/w3' \(Fp4Blocks\): logical shape \[7, 64, 32\]"):
        _trace_propose(_replace(pp, "blocks_0/ffn/experts/w3", packed.Fp4Blocks(e.packed[:7], e.exponents[:7])), ckpt)
    with pytest.raises(ValueError, match=r"'blocks_0/ffn/experts/w3' .*exponents has shape \[8, 1, 32\], "
                                         r"expected \[8, 2, 32\]"):
        _trace_propose(_replace(pp, "blocks_0/ffn/experts/w3", packed.Fp4Blocks(e.packed, e.exponents[:, :1])), ckpt)


def test_a_packed_tree_exports_by_value(ckpt, tmp_path):
    pp, tied = _load(ckpt, "packed")
    v41.export_v41_draft(pp, tied, TINY, tmp_path, fmt="fp8")
    back, _ = v41.load_v41_draft(tmp_path, TINY, dtype="float32")
    want, _ = v41.load_v41_draft(ckpt, TINY, dtype="float32")
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(back) == jax.tree.structure(want)
