"""Checkpoint porting: safetensors I/O, fp8 / fp4 formats, the V4.1 `mtp.*` mapping, Orbax, `dspark convert`.

The oracles here are independent of the package: e4m3 / e2m1 / e8m0 are decoded and encoded from
their bit layouts in plain numpy (no ml_dtypes casts), checkpoints are written by a 10-line
safetensors writer of this file, and the V4.1 layout (names, dtypes, shapes) and its mapping onto our
tree are spelled out again from SPEC section 3 and docs/params.md.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dspark_jax.checkpoint import formats, orbax_io, v41
from dspark_jax.checkpoint.safetensors_io import (
    CheckpointError, SafetensorsWriter, TensorSpec, open_checkpoint, save_file,
)
from dspark_jax.checkpoint.trees import unflatten_paths
from dspark_jax.config import DSparkConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = DSparkConfig.from_json(ROOT / "configs" / "tiny_v41.json")


# ---------------------------------------------------------------------------------------------
# Independent numpy oracles (bit layouts)
# ---------------------------------------------------------------------------------------------
def e4m3_decode(b: np.ndarray) -> np.ndarray:
    """E4M3 (fn): sign | 4 exponent bits (bias 7) | 3 mantissa bits; exp 0 = subnormal; 0x7F/0xFF NaN."""
    b = np.asarray(b, dtype=np.uint8).astype(np.int64)
    sign = np.where(b >> 7, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 0x7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return sign * mag


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float64 already scaled into [-448, 448] -> E4M3 bytes, round to nearest, ties to even."""
    x = np.asarray(x, dtype=np.float64)
    sign = np.signbit(x).astype(np.int64) << 7
    a = np.abs(x)
    # Subnormal range (< 2^-6): the code is the multiple of 2^-9, which also covers rounding up to
    # the first normal (code 8 == exponent 1, mantissa 0).
    sub = np.rint(a * 2.0 ** 9).astype(np.int64)
    mant, exp = np.frexp(np.where(a > 0, a, 1.0))  # a = mant * 2^exp, mant in [0.5, 1)
    e = exp - 1  # a = (2 * mant) * 2^e, 2 * mant in [1, 2)
    m = np.rint((2.0 * mant - 1.0) * 8.0).astype(np.int64)
    e = np.where(m == 8, e + 1, e)
    m = np.where(m == 8, 0, m)
    normal = ((e + 7) << 3) | m
    code = np.where(a < 2.0 ** -6, sub, normal)
    return (sign | code).astype(np.uint8)


def e2m1_decode(c: np.ndarray) -> np.ndarray:
    """E2M1: sign | 2 exponent bits (bias 1) | 1 mantissa bit; exp 0 = subnormal (0 or 0.5)."""
    c = np.asarray(c).astype(np.int64)
    sign = np.where((c >> 3) & 1, -1.0, 1.0)
    e, m = (c >> 1) & 3, c & 1
    mag = np.where(e == 0, m * 0.5, (1.0 + m / 2.0) * np.exp2(e - 1.0))
    return sign * mag


_E2M1_MAGS = e2m1_decode(np.arange(8))


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """float64 in [-6, 6] -> E2M1 codes: the nearest of the 8 magnitudes, ties to the even code."""
    x = np.asarray(x, dtype=np.float64)
    d = np.abs(np.abs(x)[..., None] - _E2M1_MAGS)  # [..., 8]
    best = d.min(axis=-1, keepdims=True)
    cands = np.where(d == best, np.arange(8), 99)
    even = np.where(cands % 2 == 0, cands, 99).min(axis=-1)
    code = np.where(even < 99, even, cands.min(axis=-1))
    return (code | (np.signbit(x).astype(np.int64) << 3)).astype(np.uint8)


def pow2_scale_exponent(amax: float, fmt_max: float) -> int:
    """Smallest e with amax <= fmt_max * 2^e (searched, not computed with a log)."""
    if amax == 0:
        return 0
    e = 0
    while amax > fmt_max * 2.0 ** e:
        e += 1
    while amax <= fmt_max * 2.0 ** (e - 1):
        e -= 1
    return e


def np_fp8_encode(w: np.ndarray):
    """Reference fp8 export: per 32x32 block, e = pow2 exponent of max|w|/448, byte = e4m3(w / 2^e); then the
    scale the same rule gives for the decoded block (e - 1 when the rounded max is exactly 224), same values."""
    w = np.asarray(w, dtype=np.float64)
    out, inn = w.shape
    so, si = -(-out // 32), -(-inn // 32)
    q = np.zeros(w.shape, np.uint8)
    s = np.zeros((so, si), np.uint8)
    for bo in range(so):
        for bi in range(si):
            blk = w[bo * 32:(bo + 1) * 32, bi * 32:(bi + 1) * 32]
            e = pow2_scale_exponent(float(np.abs(blk).max()), 448.0)
            vals = e4m3_decode(e4m3_encode(blk * 2.0 ** -e)) * 2.0 ** e
            e = pow2_scale_exponent(float(np.abs(vals).max()), 448.0)
            s[bo, bi] = e + 127
            q[bo * 32:(bo + 1) * 32, bi * 32:(bi + 1) * 32] = e4m3_encode(vals * 2.0 ** -e)
    return q, s


def np_fp4_encode(w: np.ndarray):
    """Reference fp4 export: per row and 32 columns, e = pow2 exponent of max|w|/6, then (as for fp8) the
    exponent of the decoded block; packed low nibble first."""
    w = np.asarray(w, dtype=np.float64)
    out, inn = w.shape
    codes = np.zeros(w.shape, np.uint8)
    s = np.zeros((out, -(-inn // 32)), np.uint8)
    for o in range(out):
        for bi in range(s.shape[1]):
            blk = w[o, bi * 32:(bi + 1) * 32]
            e = pow2_scale_exponent(float(np.abs(blk).max()), 6.0)
            vals = e2m1_decode(e2m1_encode(blk * 2.0 ** -e)) * 2.0 ** e
            e = pow2_scale_exponent(float(np.abs(vals).max()), 6.0)
            s[o, bi] = e + 127
            codes[o, bi * 32:(bi + 1) * 32] = e2m1_encode(vals * 2.0 ** -e)
    packed = (codes[:, 0::2] & 0xF) | (codes[:, 1::2] << 4)
    return packed.astype(np.uint8), s


def np_fp8_decode(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    lut = e4m3_decode(np.arange(256))
    out, inn = q.shape
    factor = np.repeat(np.repeat(np.exp2(s.astype(np.float64) - 127), 32, 0), 32, 1)[:out, :inn]
    return lut[q] * factor


def np_fp4_decode(packed: np.ndarray, s: np.ndarray) -> np.ndarray:
    p = np.asarray(packed).view(np.uint8)
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(p.shape[0], -1)
    factor = np.repeat(np.exp2(s.astype(np.float64) - 127), 32, 1)[:, :codes.shape[1]]
    return e2m1_decode(np.arange(16))[codes] * factor


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns by truncation (no ml_dtypes)."""
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ---------------------------------------------------------------------------------------------
# Independent safetensors writer and the V4.1 layout from SPEC section 3
# ---------------------------------------------------------------------------------------------
def st_write(path: Path, entries, header_patch=None) -> None:
    """entries: (name, dtype, shape, raw bytes). header_patch(header) may corrupt the header."""
    header, off = {}, 0
    for name, dt, shape, raw in entries:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
    if header_patch:
        header_patch(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for *_, raw in entries:
            f.write(raw)


def scale_of(name: str) -> str:
    """SPEC 3: the scale of `<linear>.weight` is `<linear>.scale` (not `<linear>.weight.scale`)."""
    assert name.endswith(".weight"), name
    return name[: -len(".weight")] + ".scale"


def v41_layout(cfg: DSparkConfig):
    """(name, kind, logical shape) of every draft tensor plus the tied ones, per SPEC section 3."""
    D, V, r, E, I = cfg.dim, cfg.vocab_size, cfg.markov_rank, cfg.n_routed_experts, cfg.moe_inter_dim
    H, hd, Ql, G, Ol = cfg.n_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    M = (2 + cfg.hc_mult) * cfg.hc_mult
    last = cfg.n_layers - 1
    out = []
    for s in range(cfg.n_layers):
        p = f"mtp.{s}."
        if s == 0:
            out += [(p + "main_proj.weight", "fp8", (D, 3 * D)), (p + "main_norm.weight", "bf16", (D,))]
        out += [
            (p + "attn.wq_a.weight", "fp8", (Ql, D)), (p + "attn.q_norm.weight", "bf16", (Ql,)),
            (p + "attn.wq_b.weight", "fp8", (H * hd, Ql)), (p + "attn.wkv.weight", "fp8", (hd, D)),
            (p + "attn.kv_norm.weight", "bf16", (hd,)), (p + "attn.wo_a.weight", "fp8", (G * Ol, H * hd // G)),
            (p + "attn.wo_b.weight", "fp8", (D, G * Ol)), (p + "attn.attn_sink", "f32", (H,)),
            (p + "attn_norm.weight", "bf16", (D,)), (p + "ffn_norm.weight", "bf16", (D,)),
            (p + "hc_attn_fn", "f32", (M, cfg.hc_mult * D)), (p + "hc_ffn_fn", "f32", (M, cfg.hc_mult * D)),
            (p + "hc_attn_base", "f32", (M,)), (p + "hc_ffn_base", "f32", (M,)),
            (p + "hc_attn_scale", "f32", (3,)), (p + "hc_ffn_scale", "f32", (3,)),
            (p + "ffn.gate.weight", "bf16", (E, D)), (p + "ffn.gate.bias", "f32", (E,)),
            *([(p + "ffn.gate.bias_vl", "f32", (E,))] if cfg.vision else []),  # models with a vision tower
            (p + "ffn.shared_experts.w1.weight", "fp8", (I, D)), (p + "ffn.shared_experts.w3.weight", "fp8", (I, D)),
            (p + "ffn.shared_experts.w2.weight", "fp8", (D, I)),
        ]
        for e in range(E):
            out += [(p + f"ffn.experts.{e}.w1.weight", "fp4", (I, D)),
                    (p + f"ffn.experts.{e}.w3.weight", "fp4", (I, D)),
                    (p + f"ffn.experts.{e}.w2.weight", "fp4", (D, I))]
        if s == last:
            out += [(p + "norm.weight", "bf16", (D,)), (p + "markov_head.embed.weight", "bf16", (V, r)),
                    (p + "markov_head.head.weight", "bf16", (V, r)),
                    (p + "confidence_head.proj.weight", "bf16", (1, D + r))]
    out += [("embed.weight", "bf16", (V, D)), ("head.weight", "bf16", (V, D))]
    return out


def make_tensor(rng, kind, shape, fp4_dtype="I8"):
    """Random official-format tensor -> (safetensors entries, exact float64 value)."""
    if kind == "fp8":
        q = rng.integers(0, 256, size=shape, dtype=np.uint8)
        q[(q & 0x7F) == 0x7F] = 0x7E  # no NaN codes
        s = rng.integers(118, 127, size=(-(-shape[0] // 32), -(-shape[1] // 32)), dtype=np.uint8)
        return [("F8_E4M3", shape, q.tobytes()), ("F8_E8M0", s.shape, s.tobytes())], np_fp8_decode(q, s)
    if kind == "fp4":
        p = rng.integers(0, 256, size=(shape[0], shape[1] // 2), dtype=np.uint8)
        s = rng.integers(118, 127, size=(shape[0], -(-shape[1] // 32)), dtype=np.uint8)
        st_shape = shape if fp4_dtype == "F4" else p.shape
        return [(fp4_dtype, st_shape, p.tobytes()), ("F8_E8M0", s.shape, s.tobytes())], np_fp4_decode(p, s)
    if kind == "bf16":
        bits = bf16_bits(rng.standard_normal(shape).astype(np.float32))
        return [("BF16", shape, bits.tobytes())], bf16_value(bits)
    x = rng.standard_normal(shape).astype(np.float32)
    return [("F32", shape, x.tobytes())], x.astype(np.float64)


def build_v41_checkpoint(folder: Path, cfg: DSparkConfig, seed=0, *, n_files=3, fp4_dtype="I8", drop=(),
                         extra=(), replace=None, index=True):
    """A synthetic checkpoint in the official layout, sharded with an index; returns name -> float64 value.

    `drop`: names to leave out; `extra`: (name, dtype, shape, raw) to add; `replace`: name -> entries.
    Backbone tensors ("layers.*") are mixed in and must be ignored by the loader.
    """
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    values, groups = {}, []
    for name, kind, shape in v41_layout(cfg):
        ents, val = make_tensor(rng, kind, shape, fp4_dtype)
        values[name] = val
        if replace and name in replace:
            ents = replace[name]
        names = [name, scale_of(name)] if len(ents) == 2 else [name]
        groups.append([(n, *e) for n, e in zip(names, ents) if n not in drop])
    groups.append([("layers.0.attn.wq_a.weight", "BF16", (4, 4), bytes(32)),
                   ("layers.0.ffn.experts.0.w1.weight", "I8", (4, 2), bytes(8))])
    if extra:
        groups.append(list(extra))
    files = [[] for _ in range(n_files)]
    for i, g in enumerate(groups):
        files[i % n_files].extend(g)
    weight_map = {}
    for i, ents in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        st_write(folder / fname, ents)
        weight_map.update({n: fname for n, *_ in ents})
    if index:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return values


# docs/params.md, spelled out: our path -> (checkpoint name after mtp.{s}., transform)
def expected_tree(values: dict, cfg: DSparkConfig) -> dict:
    G, Ol = cfg.o_groups, cfg.o_lora_rank
    t = {}
    last = cfg.n_layers - 1
    t[("main_proj", "kernel")] = values["mtp.0.main_proj.weight"].T
    t[("main_norm", "scale")] = values["mtp.0.main_norm.weight"]
    for s in range(cfg.n_layers):
        p, b = f"mtp.{s}.", f"blocks_{s}"
        t[(b, "attn_norm", "scale")] = values[p + "attn_norm.weight"]
        t[(b, "ffn_norm", "scale")] = values[p + "ffn_norm.weight"]
        for sub in ("attn", "ffn"):
            for leaf in ("fn", "base", "scale"):
                t[(b, f"hc_{sub}", leaf)] = values[p + f"hc_{sub}_{leaf}"]
        for w in ("wq_a", "wq_b", "wkv", "wo_b"):
            t[(b, "attn", w, "kernel")] = values[p + f"attn.{w}.weight"].T
        wo_a = values[p + "attn.wo_a.weight"]
        t[(b, "attn", "wo_a", "kernel")] = np.stack([wo_a[g * Ol:(g + 1) * Ol].T for g in range(G)])
        t[(b, "attn", "q_norm", "scale")] = values[p + "attn.q_norm.weight"]
        t[(b, "attn", "kv_norm", "scale")] = values[p + "attn.kv_norm.weight"]
        t[(b, "attn", "sink")] = values[p + "attn.attn_sink"]
        t[(b, "ffn", "gate", "kernel")] = values[p + "ffn.gate.weight"].T
        t[(b, "ffn", "gate", "bias")] = values[p + "ffn.gate.bias"]
        if cfg.vision:
            t[(b, "ffn", "gate", "bias_vl")] = values[p + "ffn.gate.bias_vl"]
        for w in ("w1", "w2", "w3"):
            t[(b, "ffn", "experts", w)] = np.stack([values[p + f"ffn.experts.{e}.{w}.weight"].T
                                                    for e in range(cfg.n_routed_experts)])
            t[(b, "ffn", "shared", w)] = values[p + f"ffn.shared_experts.{w}.weight"].T
    p = f"mtp.{last}."
    t[("norm", "scale")] = values[p + "norm.weight"]
    t[("markov", "embed")] = values[p + "markov_head.embed.weight"]
    t[("markov", "head")] = values[p + "markov_head.head.weight"]
    t[("confidence", "kernel")] = values[p + "confidence_head.proj.weight"][0]
    return t


F32_LEAVES = ("hc_attn", "hc_ffn", "sink", "bias", "bias_vl")


def flat(tree, prefix=()):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def as_f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


# ---------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------
def test_decode_tables_match_bit_layouts():
    ours = formats._E4M3_LUT.astype(np.float64)
    ref = e4m3_decode(np.arange(256))
    assert np.array_equal(np.isnan(ours), np.isnan(ref))
    ok = ~np.isnan(ref)
    assert np.array_equal(ours[ok], ref[ok])
    assert np.array_equal(formats.E2M1_VALUES.astype(np.float64), e2m1_decode(np.arange(16)))
    assert list(e2m1_decode(np.arange(16))) == [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]


def _edge_block_values(rng, shape, fmt_max, grid):
    """Random values plus exact ties between grid points, zeros, -0, tiny values and exact maxima."""
    w = rng.standard_normal(shape) * np.exp2(rng.integers(-12, 4, size=(shape[0], 1)))
    mids = (grid[1:] + grid[:-1]) / 2
    flat_w = w.reshape(-1)
    k = min(len(mids), flat_w.size // 4)
    flat_w[:k] = mids[:k] * (2.0 ** -3) * np.where(rng.random(k) < 0.5, -1, 1)
    flat_w[k] = fmt_max * 2.0 ** -3  # block max exactly at the format max -> scale 2^-3
    flat_w[k + 1] = 0.0
    flat_w[k + 2] = -0.0
    flat_w[k + 3] = 1e-30
    w[:, :] = flat_w.reshape(shape)
    w[-7:, -5:] = 0.0  # a partly zero corner
    return w.astype(np.float32).astype(np.float64)  # exactly representable in f32


@pytest.mark.parametrize("shape", [(64, 96), (70, 100)])
def test_fp8_encoder_matches_numpy_bitwise(shape):
    rng = np.random.default_rng(1)
    grid = np.unique(np.abs(e4m3_decode(np.arange(0, 127))))
    w = _edge_block_values(rng, shape, 448.0, grid)
    w[:32, :32] = np.pad(((grid[1:] + grid[:-1]) / 2)[:-1], (0, 32 * 32 - 125)).reshape(32, 32)
    w[0, 0] = 448.0  # this block: every e4m3 midpoint at scale 2^0
    q, s = formats.quantize_fp8_block(w.astype(np.float32))
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == ml_dtypes.float8_e8m0fnu
    rq, rs = np_fp8_encode(w)
    assert np.array_equal(s.view(np.uint8), rs)
    assert np.array_equal(q.view(np.uint8), rq)
    deq = formats.dequantize_fp8_block(q, s, np.float32)
    assert np.array_equal(deq.astype(np.float64), np_fp8_decode(rq, rs))
    # Within format precision: e4m3 keeps 3 mantissa bits (relative half-step 2^-4) above its
    # subnormal range, whose absolute step is 2^-9 * the rounding scale (the stored scale, or twice it
    # where the decoded block's scale is one lower).
    scale = np.exp2(np.repeat(np.repeat(rs.astype(np.float64) - 127, 32, 0), 32, 1)[:shape[0], :shape[1]])
    tol = np.maximum(np.abs(w) * 2.0 ** -4, 2.0 ** -9 * scale)
    assert np.all(np.abs(deq - w) <= tol)


@pytest.mark.parametrize("shape", [(6, 64), (5, 80)])
def test_fp4_encoder_matches_numpy_bitwise(shape):
    rng = np.random.default_rng(2)
    grid = _E2M1_MAGS
    w = _edge_block_values(rng, shape, 6.0, grid)
    packed, s = formats.quantize_fp4(w.astype(np.float32))
    rp, rs = np_fp4_encode(w)
    assert packed.shape == (shape[0], shape[1] // 2) and s.shape == (shape[0], -(-shape[1] // 32))
    assert np.array_equal(s.view(np.uint8), rs)
    assert np.array_equal(packed.view(np.uint8), rp)
    deq = formats.dequantize_fp4(packed, s, np.float32)
    assert np.array_equal(deq.astype(np.float64), np_fp4_decode(rp, rs))
    # Within format precision: grid spacing is at most 2 (between 4 and 6) at scale 1, 0.5 near 0 (the
    # rounding scale is the stored one or twice it, see np_fp4_encode).
    scale = np.exp2(np.repeat(rs.astype(np.float64) - 127, 32, 1)[:, :shape[1]])
    assert np.all(np.abs(deq - w) <= np.maximum(np.abs(w) / 4, 0.5 * scale) + 1e-300)


def test_fp4_nibble_order_and_tie_rounding():
    # element 2j in the low nibble, 2j+1 in the high one
    codes = np.array([[1, 2, 3, 4, 15, 8]], dtype=np.uint8)
    assert formats.pack_fp4(codes).tolist() == [[0x21, 0x43, 0x8F]]
    assert np.array_equal(formats.unpack_fp4(formats.pack_fp4(codes)), codes)
    # ties go to the even code: .25->0, .75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    x = np.array([[6.0, .25, .75, 1.25, 1.75, 2.5, 3.5, 5.0] + [0.0] * 24], np.float32)
    packed, s = formats.quantize_fp4(x)
    assert s.view(np.uint8).tolist() == [[127]]
    deq = formats.dequantize_fp4(packed, s)[0, :8]
    assert deq.tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_fp4_odd_inner_dimension_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="odd inner dimension 33"):
        formats.quantize_fp4(np.ones((4, 33), np.float32))
    # a safetensors F4 tensor must have an even logical inner dimension
    st_write(tmp_path / "odd.safetensors", [("mtp.0.ffn.experts.0.w2.weight", "F4", (4, 33), bytes(66))])
    with pytest.raises(CheckpointError, match=r"odd\.safetensors: tensor 'mtp\.0\.ffn\.experts\.0\.w2\.weight'.*odd"):
        open_checkpoint(tmp_path / "odd.safetensors")
    # a config whose expert inner dimension is odd can neither load nor export fp4 experts
    cfg = TINY.replace(moe_inter_dim=33, n_layers=1)
    st_write(tmp_path / "x.safetensors", [("mtp.0.ffn.experts.0.w2.weight", "I8", (64, 16), bytes(64 * 16))])
    reader = open_checkpoint(tmp_path / "x.safetensors")
    with pytest.raises(CheckpointError, match=r"experts\.0\.w2\.weight.*odd inner dimension 33"):
        v41.detect(reader, "mtp.0.ffn.experts.0.w2.weight", (64, 33))
    params = {"/".join(p): np.zeros(s, np.float32) for p, s in v41.expected_shapes(cfg).items()}
    params = unflatten_paths({tuple(k.split("/")): v for k, v in params.items()})
    with pytest.raises(CheckpointError, match=r"experts\.0\.w2\.weight.*even inner dimension"):
        v41.export_v41_draft(params, None, cfg, tmp_path / "out", fmt="fp8")
    assert not list((tmp_path / "out").glob("*.safetensors"))  # nothing half-written


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
# safetensors reader / writer
# ---------------------------------------------------------------------------------------------
def test_writer_reader_all_dtypes_and_safetensors_package(tmp_path):
    rng = np.random.default_rng(4)
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32), "f16": rng.standard_normal((4,)).astype(np.float16),
        "f64": rng.standard_normal((2, 2)), "i8": rng.integers(-128, 127, (7,), dtype=np.int8),
        "u8": rng.integers(0, 255, (2, 3), dtype=np.uint8), "i32": rng.integers(-9, 9, (5,), dtype=np.int32),
        "i64": rng.integers(-9, 9, (1, 3), dtype=np.int64), "bool": rng.random((4,)) < 0.5,
        "bf16": rng.standard_normal((6, 2)).astype(ml_dtypes.bfloat16),
        "e4m3": rng.standard_normal((32, 32)).astype(ml_dtypes.float8_e4m3fn),
        "e8m0": np.arange(120, 130, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu),
        "empty": np.zeros((0, 4), np.float32),
    }
    packed = rng.integers(0, 256, (3, 4), dtype=np.uint8)
    save_file(tmp_path / "t.safetensors", {**tensors, "fp4": ("F4", packed)}, metadata={"k": "v"})
    r = open_checkpoint(tmp_path / "t.safetensors")
    assert r.files[0].metadata == {"k": "v"}
    for k, v in tensors.items():
        got = r.read(k)
        assert got.dtype == v.dtype and got.shape == v.shape
        assert np.array_equal(got.view(np.uint8), np.ascontiguousarray(v).view(np.uint8))
    assert r.info("fp4").shape == (3, 8) and np.array_equal(r.read("fp4"), packed)

    from safetensors import safe_open  # independent check of the file format

    with safe_open(tmp_path / "t.safetensors", framework="numpy") as f:
        assert f.metadata() == {"k": "v"}
        for k in ("f32", "f16", "f64", "i8", "u8", "i32", "i64", "bool"):
            assert np.array_equal(f.get_tensor(k), tensors[k])
        expect = {"bf16": ("BF16", [6, 2]), "e4m3": ("F8_E4M3", [32, 32]), "e8m0": ("F8_E8M0", [10]),
                  "fp4": ("F4", [3, 8])}
        for k, (dt, shape) in expect.items():
            sl = f.get_slice(k)
            assert (sl.get_dtype(), sl.get_shape()) == (dt, shape)
    # and our reader agrees with a file written by the safetensors package
    from safetensors.numpy import save_file as st_save

    st_save({"a": tensors["f32"], "b": tensors["i64"]}, str(tmp_path / "ref.safetensors"))
    r2 = open_checkpoint(tmp_path / "ref.safetensors")
    assert np.array_equal(r2.read("a"), tensors["f32"]) and np.array_equal(r2.read("b"), tensors["i64"])


def test_writer_rejects_wrong_writes(tmp_path):
    specs = [TensorSpec("a", "F32", (2, 3)), TensorSpec("b", "F8_E4M3", (4,))]
    w = SafetensorsWriter(tmp_path / "w.safetensors", specs)
    with pytest.raises(CheckpointError, match="tensor 'a': got float64"):
        w.write("a", np.zeros((2, 3)))
    with pytest.raises(CheckpointError, match="'c' was not declared"):
        w.write("c", np.zeros(1, np.float32))
    w.write("a", np.zeros((2, 3), np.float32))
    with pytest.raises(CheckpointError, match="never written, e.g. 'b'"):
        w.close()
    assert not list(tmp_path.iterdir())  # no partial file left behind
    with pytest.raises(CheckpointError, match="unknown dtype 'F7'"):
        TensorSpec("x", "F7", (1,))


def _good_file(path: Path):
    st_write(path, [("w", "F32", (4, 4), np.arange(16, dtype=np.float32).tobytes()),
                    ("v", "BF16", (3,), bytes(6))])


@pytest.mark.parametrize("corrupt,pattern", [
    ("short", r"short\.safetensors: truncated file \(5 bytes\)"),
    ("truncated", r"truncated\.safetensors: tensor '(w|v)': truncated file or offsets out of range"),
    ("header_len", r"header_len\.safetensors: truncated file: header says"),
    ("json", r"json\.safetensors: bad header: not valid JSON"),
    ("huge", r"huge\.safetensors: bad header: header length"),
    ("dtype", r"dtype\.safetensors: tensor 'w': unknown dtype 'F7'"),
    ("span", r"span\.safetensors: tensor 'w': byte span 64 != 32 for dtype F16 shape \[4, 4\]"),
    ("overlap", r"overlap\.safetensors: bad header: tensors '(w|v)' and '(w|v)' overlap"),
    ("range", r"range\.safetensors: tensor 'v': truncated file or offsets out of range"),
    ("negative", r"negative\.safetensors: tensor 'w': bad data_offsets \[8, 4\]"),
    ("dup", r"dup\.safetensors: bad header: not valid JSON \(duplicate key 'w'\)"),
    ("shape", r"shape\.safetensors: tensor 'w': bad shape \[4, -4\]"),
])
def test_corrupt_files_give_clear_errors(tmp_path, corrupt, pattern):
    path = tmp_path / f"{corrupt}.safetensors"
    _good_file(path)
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hlen])
    data = raw[8 + hlen:]

    def rewrite(h, d=data):
        blob = json.dumps(h).encode()
        path.write_bytes(struct.pack("<Q", len(blob)) + blob + d)

    if corrupt == "short":
        path.write_bytes(raw[:5])
    elif corrupt == "truncated":
        path.write_bytes(raw[:-10])
    elif corrupt == "header_len":
        path.write_bytes(raw[:8 + hlen // 2])
    elif corrupt == "json":
        path.write_bytes(raw[:8] + b"{not json" + raw[17:])
    elif corrupt == "huge":
        path.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    elif corrupt == "dtype":
        header["w"]["dtype"] = "F7"
        rewrite(header)
    elif corrupt == "span":
        header["w"]["dtype"] = "F16"
        rewrite(header)
    elif corrupt == "overlap":
        header["v"]["data_offsets"] = [60, 66]
        rewrite(header)
    elif corrupt == "range":
        header["v"]["data_offsets"] = [64, 70]
        rewrite(header, data[:-6])
    elif corrupt == "negative":
        header["w"]["data_offsets"] = [8, 4]
        rewrite(header)
    elif corrupt == "dup":
        blob = json.dumps(header).encode()[:-1] + b', "w": ' + json.dumps(header["w"]).encode() + b"}"
        path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    elif corrupt == "shape":
        header["w"]["shape"] = [4, -4]
        rewrite(header)
    with pytest.raises(CheckpointError, match=pattern):
        open_checkpoint(path)


def test_index_errors(tmp_path):
    _good_file(tmp_path / "a.safetensors")
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"w": "a.safetensors", "x": "missing.safetensors"}}))
    with pytest.raises(CheckpointError, match="tensor 'x' is mapped to missing.safetensors, which does not exist"):
        open_checkpoint(tmp_path)
    idx.write_text(json.dumps({"weight_map": {"w": "a.safetensors", "x": "a.safetensors"}}))
    with pytest.raises(CheckpointError, match="tensor 'x' is mapped to a.safetensors, which does not contain it"):
        open_checkpoint(tmp_path)
    idx.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="weight_map"):
        open_checkpoint(idx)
    idx.unlink()
    _good_file(tmp_path / "b.safetensors")  # same names in two un-indexed shards
    with pytest.raises(CheckpointError, match="tensor '(w|v)' appears in both"):
        open_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------------
# The V4.1 loader
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v41_tiny")
    values = build_v41_checkpoint(folder, TINY, seed=5)
    return folder, values


@pytest.mark.parametrize("vision", [False, True])
def test_table_agrees_with_draft_and_docs(vision):
    cfg = TINY.replace(vision=vision)
    v41.check_table_against_draft(cfg)  # raises on any disagreement with dspark_jax.draft
    from dspark_jax import draft

    shapes = {tuple(str(k.key) for k in kp): tuple(x.shape) for kp, x in
              jax.tree_util.tree_flatten_with_path(draft.abstract_params(cfg))[0]}
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
    from dspark_jax import draft, sampling

    cfg = TINY
    rng = np.random.default_rng(10)

    def init(path, a):  # draft.init_params compiles for ~20 s on CPU; same tree, random values
        keys = [k.key for k in path]
        if keys[-1] == "scale" and keys[-2].endswith("norm"):
            return (1.0 + 0.1 * rng.standard_normal(a.shape)).astype(a.dtype)
        return (rng.standard_normal(a.shape) * 0.1).astype(a.dtype)

    params = jax.tree_util.tree_map_with_path(init, draft.abstract_params(cfg))
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
        state = draft.prefill(p, cfg, draft.init_state(cfg, batch), main_hidden, jnp.array([7, 5], jnp.int32))
        return draft.propose(p, t, cfg, state, anchor, sp, seeds)

    out = run(jax.tree.map(jnp.asarray, loaded), jax.tree.map(jnp.asarray, loaded_tied))
    ref = run(jax.tree.map(jnp.asarray, expect), jax.tree.map(jnp.asarray, expect_tied))
    assert out.tokens.shape == (batch, cfg.block_size) and out.logits.shape == (batch, cfg.block_size, cfg.vocab_size)
    assert bool(jnp.all(jnp.isfinite(out.logits))) and bool(jnp.all(jnp.isfinite(out.conf_logits)))
    assert np.array_equal(out.tokens, ref.tokens)
    assert np.array_equal(out.logits, ref.logits)


# ---------------------------------------------------------------------------------------------
# Orbax
# ---------------------------------------------------------------------------------------------
def test_orbax_restore_straight_into_expert_sharding(tiny_ckpt, tmp_path):
    from dspark_jax import draft
    from dspark_jax.parallel import make_mesh

    assert jax.device_count() == 8
    folder, _ = tiny_ckpt
    params, _ = v41.load_v41_draft(folder, TINY, dtype="float32")
    orbax_io.save_params(tmp_path / "ck", params, config=TINY)
    with pytest.raises(CheckpointError, match="already exists"):
        orbax_io.save_params(tmp_path / "ck", params)
    assert orbax_io.saved_config(tmp_path / "ck") == TINY

    mesh = make_mesh(expert=8)
    shardings = draft.param_shardings(TINY, mesh)
    w1_sharding = shardings["blocks_0"]["ffn"]["experts"]["w1"]
    assert w1_sharding.spec[0] == "expert"
    abstract = jax.tree.map(lambda s, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shardings, draft.abstract_params(TINY))
    for target in (abstract, shardings):
        restored = orbax_io.restore_params(tmp_path / "ck", target)
        w1 = restored["blocks_0"]["ffn"]["experts"]["w1"]
        assert w1.sharding == w1_sharding
        assert {s.data.shape for s in w1.addressable_shards} == {(1, TINY.dim, TINY.moe_inter_dim)}
        assert len({s.device for s in w1.addressable_shards}) == 8
        for p, x in flat(params).items():
            got = restored
            for k in p:
                got = got[k]
            assert np.array_equal(np.asarray(got), x), p
    host = orbax_io.restore_params(tmp_path / "ck")
    assert isinstance(host["main_proj"]["kernel"], np.ndarray)

    bad = dict(abstract)
    bad.pop("norm")
    with pytest.raises(CheckpointError, match=r"leaves not in the target \['norm/scale'\]"):
        orbax_io.restore_params(tmp_path / "ck", bad)
    wrong = jax.tree.map(lambda x: x, abstract)
    wrong["norm"]["scale"] = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=shardings["norm"]["scale"])
    with pytest.raises(CheckpointError, match=r"leaf 'norm/scale' has shape \[64\] in the checkpoint"):
        orbax_io.restore_params(tmp_path / "ck", wrong)


# ---------------------------------------------------------------------------------------------
# dspark convert
# ---------------------------------------------------------------------------------------------
def test_convert_cli_roundtrip_and_errors(tiny_ckpt, tmp_path, capsys, monkeypatch):
    from dspark_jax.cli import main

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # cli.main rewrites it

    folder, _ = tiny_ckpt
    cfg_path = tmp_path / "cfg.json"
    TINY.to_json(cfg_path)
    assert main(["convert", str(folder), str(tmp_path / "ob"), "--to", "orbax", "--config", str(cfg_path),
                 "--dtype", "float32", "--quiet"]) == 0
    # config travels in the Orbax metadata; orbax -> official fp8 layout, F4-typed experts
    assert main(["convert", str(tmp_path / "ob"), str(tmp_path / "fp8"), "--to", "fp8", "--fp4-dtype", "F4",
                 "--quiet"]) == 0
    assert open_checkpoint(tmp_path / "fp8").info("mtp.0.ffn.experts.0.w1.weight").dtype == "F4"
    # the config written beside the safetensors output is found again
    assert main(["convert", str(tmp_path / "fp8"), str(tmp_path / "bf16"), "--to", "bf16", "--quiet"]) == 0
    ref, ref_tied = v41.load_v41_draft(folder, TINY, dtype="float32")
    for d in ("fp8", "bf16"):
        got, tied = v41.load_v41_draft(tmp_path / d, TINY, dtype="float32")
        for p, x in flat(ref).items():
            assert np.array_equal(x, flat(got)[p]), (d, p)
        assert np.array_equal(tied["head"], ref_tied["head"])
    capsys.readouterr()

    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "x"), "--to", "bf16",
                 "--config", str(cfg_path)]) == 2
    assert "nope: no such file or directory" in capsys.readouterr().err
    assert main(["convert", str(folder), str(tmp_path / "bf16"), "--to", "bf16", "--config", str(cfg_path)]) == 2
    assert "exists and is not empty (pass --overwrite" in capsys.readouterr().err
    assert main(["convert", str(folder), str(tmp_path / "y"), "--to", "bf16"]) == 2
    assert "no config: pass --config" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "fp8"), str(tmp_path / "fp8"), "--to", "bf16", "--overwrite"]) == 2
    assert "must not contain the input" in capsys.readouterr().err
    assert open_checkpoint(tmp_path / "fp8").info("mtp.0.ffn.experts.0.w1.weight").dtype == "F4"  # untouched
    wrong = tmp_path / "wrong.json"
    TINY.replace(n_routed_experts=4, n_activated_experts=2).to_json(wrong)
    assert main(["convert", str(folder), str(tmp_path / "z"), "--to", "fp8", "--config", str(wrong)]) == 2
    assert "tensor 'mtp.0.ffn.gate.weight': shape [8, 64], expected [4, 64]" in capsys.readouterr().err
