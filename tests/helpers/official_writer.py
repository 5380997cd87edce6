"""An independent writer of V4.1 checkpoints in the OFFICIAL layout (SPEC section 3), for tests.

Nothing here imports `dspark_jax`: the safetensors container is written with struct + json, the
fp8 / fp4 encodings are written from SPEC 3's formulas with numpy (ml_dtypes only supplies the dtypes).
A loader bug that the exporter shares (a name, a nibble order, a scale layout) therefore cannot
cancel out in a test that reads what this module wrote.

API
---
write_safetensors(path, tensors, metadata=None, order="insertion")
    One `.safetensors` file: 8-byte little-endian header length, a JSON header
    `{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}` padded with spaces to 8 bytes,
    then the raw bytes in `order` ("insertion" or "sorted"). `tensors` maps a name to a numpy array
    (ml_dtypes.bfloat16 -> BF16, float32 -> F32, float8_e4m3fn -> F8_E4M3, float8_e8m0fnu -> F8_E8M0,
    int8 -> I8, uint8 -> U8) or to a `Raw(dtype, shape, data)` for anything else (e.g. `F4`).
write_sharded(out_dir, tensors, n_shards, metadata=None)
    `model-0000i-of-0000n.safetensors` round-robin over the tensors (a weight and its scale usually
    land in different shards, as nothing in the format forbids) plus `model.safetensors.index.json`.
quantize_fp8_block32(w) -> (q float8_e4m3fn [out, in], scale float8_e8m0fnu [ceil(out/32), ceil(in/32)])
    W[o, k] = e4m3(q[o, k]) * 2^(scale_byte[o//32, k//32] - 127), scale = 2^ceil(log2(amax / 448)).
quantize_fp4_block32(w) -> (packed int8 [out, in/2], scale float8_e8m0fnu [out, ceil(in/32)])
    E2M1 codes, element 2j in the LOW nibble of byte j; W[o, k] = E2M1[code] * 2^(scale[o, k//32] - 127),
    scale = 2^ceil(log2(amax / 6)); the nearest magnitude, a tie to the smaller one.
    Both use the official quantizer's scale rule as is (a block whose maximum rounds to half the format
    maximum keeps its scale; dspark_jax's exporter stores such a block one binade up, same values).
dequantize_fp8_block32(q, scale), dequantize_fp4_block32(packed, scale) -> float32 [out, in]
    The values those codes mean (float64 internally; exact).
fp4_as_f4(packed) -> Raw("F4", [out, in], bytes): the same bytes under safetensors dtype F4.
official_v41_tensors(cfg_like, rng, fmt="bf16", vision=False, fp4_dtype="I8") -> {name: array}
    Every `mtp.{s}.*` tensor of a V4.1 draft (SPEC 3 names, shapes and dtypes, in SPEC order) plus
    `embed.weight` and `head.weight`. fmt="fp8": dense linears F8_E4M3 + `<linear>.scale`, routed experts
    packed fp4 (`fp4_dtype` "I8" [out, in/2] or "F4" [out, in]) + `<linear>.scale`; fmt="bf16": every
    linear BF16 [out, in]. `ffn.gate.bias_vl` only when `vision`. Values are random but scaled so that a
    forward pass stays O(1). `cfg_like`: an object or dict with dim, vocab_size, n_layers (stages),
    n_routed_experts, moe_inter_dim, n_heads, head_dim, q_lora_rank, o_groups, o_lora_rank, hc_mult,
    markov_rank, n_shared_experts and n_taps (or target_layer_ids).
dequantize_official(tensors) -> {name: float32 array}
    The float value of every weight of such a dict (scales applied, `.scale` entries dropped), in
    checkpoint layout: what a strict loader must produce.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float32): "F32",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
}
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class Raw:
    """A tensor given as its safetensors dtype, logical shape and raw bytes."""
    dtype: str
    shape: tuple[int, ...]
    data: bytes


def _entry(a) -> tuple[str, list[int], bytes]:
    if isinstance(a, Raw):
        return a.dtype, list(a.shape), bytes(a.data)
    a = np.ascontiguousarray(a)
    if a.dtype not in _DTYPES:
        raise TypeError(f"official_writer: no safetensors dtype for numpy {a.dtype}")
    return _DTYPES[a.dtype], list(a.shape), a.tobytes()  # numpy is little-endian on every test host


def write_safetensors(path, tensors: dict, metadata: dict | None = None, order: str = "insertion") -> Path:
    names = sorted(tensors) if order == "sorted" else list(tensors)
    header, blobs, off = {}, [], 0
    for n in names:
        dt, shape, data = _entry(tensors[n])
        header[n] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    if metadata is not None:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    return path


def write_sharded(out_dir, tensors: dict, n_shards: int, metadata: dict | None = None) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map, total = {}, 0
    for i in range(n_shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::n_shards]}
        write_safetensors(out_dir / fname, part, metadata)
        for n in part:
            weight_map[n] = fname
            total += len(_entry(part[n])[2])
    index = out_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return index


# ---------------------------------------------------------------------------------------------
# Encodings, from SPEC 3
# ---------------------------------------------------------------------------------------------
def _pow2_scale(amax: np.ndarray, fmt_max: float) -> np.ndarray:
    """Exponent e = ceil(log2(amax / fmt_max)) so amax / 2^e <= fmt_max; 0 for an all-zero block."""
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(np.asarray(amax, np.float64) / fmt_max))
    return np.clip(np.where(amax > 0, e, 0), -127, 127).astype(np.int64)


def _e8m0(e: np.ndarray) -> np.ndarray:
    return (e + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def quantize_fp8_block32(w) -> tuple[np.ndarray, np.ndarray]:
    w = np.asarray(w, np.float64)
    n_out, n_in = w.shape
    bo, bi = -(-n_out // 32), -(-n_in // 32)
    a = np.zeros((bo * 32, bi * 32))
    a[:n_out, :n_in] = np.abs(w)
    e = _pow2_scale(a.reshape(bo, 32, bi, 32).max(axis=(1, 3)), 448.0)
    e_full = np.repeat(np.repeat(e, 32, 0), 32, 1)[:n_out, :n_in]
    q = np.clip(w / np.exp2(e_full), -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return q, _e8m0(e)


def dequantize_fp8_block32(q, scale) -> np.ndarray:
    n_out, n_in = q.shape
    e = np.asarray(scale).view(np.uint8).astype(np.int64) - 127
    e_full = np.repeat(np.repeat(e, 32, 0), 32, 1)[:n_out, :n_in]
    return (np.asarray(q).astype(np.float64) * np.exp2(e_full)).astype(np.float32)


def quantize_fp4_block32(w) -> tuple[np.ndarray, np.ndarray]:
    w = np.asarray(w, np.float64)
    n_out, n_in = w.shape
    assert n_in % 2 == 0, "fp4 packs two values per byte"
    nb = -(-n_in // 32)
    a = np.zeros((n_out, nb * 32))
    a[:, :n_in] = np.abs(w)
    e = _pow2_scale(a.reshape(n_out, nb, 32).max(axis=2), 6.0)
    x = w / np.exp2(np.repeat(e, 32, 1)[:, :n_in])
    mag = np.abs(E2M1[:8])
    codes = np.abs(np.abs(x)[..., None] - mag).argmin(axis=-1).astype(np.uint8)  # nearest magnitude
    codes |= (x < 0).astype(np.uint8) << 3
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # even element in the low nibble
    return packed.view(np.int8), _e8m0(e)


def dequantize_fp4_block32(packed, scale) -> np.ndarray:
    p = np.asarray(packed).view(np.uint8)
    codes = np.empty((p.shape[0], p.shape[1] * 2), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = p & 15, p >> 4
    e = np.asarray(scale).view(np.uint8).astype(np.int64) - 127
    return (E2M1[codes] * np.exp2(np.repeat(e, 32, 1)[:, :codes.shape[1]])).astype(np.float32)


def fp4_as_f4(packed) -> Raw:
    p = np.ascontiguousarray(np.asarray(packed).view(np.uint8))
    return Raw("F4", (p.shape[0], p.shape[1] * 2), p.tobytes())


# ---------------------------------------------------------------------------------------------
# A tiny official V4.1 draft
# ---------------------------------------------------------------------------------------------
def _get(c, k):
    if isinstance(c, dict):
        if k == "n_taps" and k not in c:
            return len(c["target_layer_ids"])
        return c[k]
    return getattr(c, k)


def official_v41_tensors(cfg_like, rng: np.random.Generator, fmt: str = "bf16", vision: bool = False,
                         fp4_dtype: str = "I8") -> dict:
    assert fmt in ("bf16", "fp8") and fp4_dtype in ("I8", "F4")
    g = lambda k: _get(cfg_like, k)  # noqa: E731
    D, V, E, I = g("dim"), g("vocab_size"), g("n_routed_experts"), g("moe_inter_dim")
    H, hd, Ql, G, Ol, hc, r = g("n_heads"), g("head_dim"), g("q_lora_rank"), g("o_groups"), g("o_lora_rank"), \
        g("hc_mult"), g("markov_rank")
    S, taps, stages = g("n_shared_experts"), g("n_taps"), g("n_layers")
    M = (2 + hc) * hc
    bf16 = lambda x: np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    out: dict = {}

    def linear(name, n_out, n_in, kind="fp8"):  # kind: official storage when fmt == "fp8"
        w = rng.standard_normal((n_out, n_in)) * n_in ** -0.5
        if fmt == "bf16" or kind == "bf16":
            out[name + ".weight"] = bf16(w)
        elif kind == "fp8":
            out[name + ".weight"], out[name + ".scale"] = quantize_fp8_block32(w)
        else:
            p, s = quantize_fp4_block32(w)
            out[name + ".weight"], out[name + ".scale"] = (fp4_as_f4(p) if fp4_dtype == "F4" else p), s

    def norm(name, n):
        out[name] = bf16(1 + 0.1 * rng.standard_normal(n))

    for s in range(stages):
        p = f"mtp.{s}."
        if s == 0:
            linear(p + "main_proj", D, taps * D)
            norm(p + "main_norm.weight", D)
        linear(p + "attn.wq_a", Ql, D)
        norm(p + "attn.q_norm.weight", Ql)
        linear(p + "attn.wq_b", H * hd, Ql)
        linear(p + "attn.wkv", hd, D)
        norm(p + "attn.kv_norm.weight", hd)
        linear(p + "attn.wo_a", G * Ol, H * hd // G)
        linear(p + "attn.wo_b", D, G * Ol)
        out[p + "attn.attn_sink"] = f32(rng.standard_normal(H))
        norm(p + "attn_norm.weight", D)
        norm(p + "ffn_norm.weight", D)
        for sub in ("attn", "ffn"):
            out[p + f"hc_{sub}_fn"] = f32(0.1 * rng.standard_normal((M, hc * D)) * (hc * D) ** -0.5)
            out[p + f"hc_{sub}_base"] = f32(0.1 * rng.standard_normal(M))
            out[p + f"hc_{sub}_scale"] = f32(1 + 0.1 * rng.standard_normal(3))
        linear(p + "ffn.gate", E, D, kind="bf16")
        out[p + "ffn.gate.bias"] = f32(0.01 * rng.standard_normal(E))
        if vision:
            out[p + "ffn.gate.bias_vl"] = f32(0.01 * rng.standard_normal(E))
        if S:
            linear(p + "ffn.shared_experts.w1", S * I, D)
            linear(p + "ffn.shared_experts.w3", S * I, D)
            linear(p + "ffn.shared_experts.w2", D, S * I)
        for e in range(E):
            linear(p + f"ffn.experts.{e}.w1", I, D, kind="fp4")
            linear(p + f"ffn.experts.{e}.w3", I, D, kind="fp4")
            linear(p + f"ffn.experts.{e}.w2", D, I, kind="fp4")
        if s == stages - 1:
            norm(p + "norm.weight", D)
            if r:
                out[p + "markov_head.embed.weight"] = bf16(rng.standard_normal((V, r)) * r ** -0.5)
                out[p + "markov_head.head.weight"] = bf16(0.5 * rng.standard_normal((V, r)))
            out[p + "confidence_head.proj.weight"] = bf16(rng.standard_normal((1, D + r)) * (D + r) ** -0.5)
    out["embed.weight"] = bf16(rng.standard_normal((V, D)))
    out["head.weight"] = bf16(rng.standard_normal((V, D)) * D ** -0.5)
    return out


def dequantize_official(tensors: dict) -> dict:
    res = {}
    for n, a in tensors.items():
        if n.endswith(".scale"):
            continue
        sc = n[: -len(".weight")] + ".scale" if n.endswith(".weight") else None
        if sc in tensors:
            if isinstance(a, Raw):  # F4: the packed bytes
                a = np.frombuffer(a.data, np.uint8).reshape(a.shape[0], a.shape[1] // 2)
            if a.dtype == ml_dtypes.float8_e4m3fn:
                res[n] = dequantize_fp8_block32(a, tensors[sc])
            else:
                res[n] = dequantize_fp4_block32(a, tensors[sc])
        else:
            res[n] = np.asarray(a).astype(np.float32)
    return res
