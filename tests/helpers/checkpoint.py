"""Checkpoint oracles independent of the package (the checkpoint tests and checkpoint/test_v41_official.py):
e4m3 / e2m1 / e8m0 decoded and encoded from their bit layouts in plain numpy (no ml_dtypes casts), a
10-line safetensors writer, and the V4.1 layout (names, dtypes, shapes) and its mapping onto our tree
spelled out again from SPEC section 3 and docs/params.md."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from dspark_jax.drafts.v41.config import DSparkConfig

from helpers.paths import CONFIGS

TINY = DSparkConfig.from_json(CONFIGS / "tiny_v41.json")


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


E2M1_MAGS = e2m1_decode(np.arange(8))


def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """float64 in [-6, 6] -> E2M1 codes: the nearest of the 8 magnitudes, ties to the even code."""
    x = np.asarray(x, dtype=np.float64)
    d = np.abs(np.abs(x)[..., None] - E2M1_MAGS)  # [..., 8]
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



def tiny_v41_checkpoint(tmp_path_factory):
    """The tiny config's draft in the official layout (sharded, with an index) -> (folder, name -> float64 value)."""
    folder = tmp_path_factory.mktemp("v41_tiny")
    values = build_v41_checkpoint(folder, TINY, seed=5)
    return folder, values
