"""Weight storage formats of the V4.1 checkpoint: decoders and encoders (numpy, host side).

* fp8: E4M3 (`float8_e4m3fn`, max 448) weight `[out, in]` plus an E8M0 scale per 32x32 block,
  `scale [ceil(out/32), ceil(in/32)]`:  W[o, k] = e4m3(w[o, k]) * 2^(scale[o//32, k//32] - 127).
* fp4: E2M1 codes packed two per byte (element 2j in the LOW nibble of byte j, 2j+1 in the HIGH
  nibble; bit 3 of a code is the sign), stored `[out, in/2]`, plus an E8M0 scale per 32 values along
  the inner dimension, `scale [out, ceil(in/32)]`:  W[o, k] = E2M1[code] * 2^(scale[o, k//32] - 127).

The scale of weight `<linear>.weight` is the tensor `<linear>.scale` (`scale_name`), as in the official
checkpoint (`mtp.0.main_proj.weight` + `mtp.0.main_proj.scale`), not `<linear>.weight.scale`.

Scales are powers of two, so dequantisation (a multiplication by 2^e, the same as ldexp) is exact in
float32 and bfloat16 (same exponent range, more mantissa than either format) unless a product falls
below the normal range. Encoders round as the official quantizer does: the smallest power-of-two
scale whose block maximum fits the format maximum (448 / 6), `2^ceil(log2(amax / max))`, then round to
nearest, ties to even, so `decode(encode(w))` is the nearest grid point of every value. When the rounded
block maximum falls to exactly half the format maximum (224 / 3; e.g. amax / 2^e = 225 rounds to 224) the
same values are also exact at half that scale, which is what the rule picks for the decoded block; the
encoders then store that representation (codes one binade up, scale one down: the same values), so
`encode(decode(encode(w))) == encode(w)` byte for byte and export -> load -> export is stable.

Work is done in row chunks so a multi-GB tensor never needs a float32 copy of itself.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from dspark_jax.checkpoint.safetensors_io import CheckpointError

FP8_BLOCK = 32
FP4_BLOCK = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E8M0_BIAS = 127
E8M0_NAN = 255

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
# Decode tables indexed by the raw byte.
_E4M3_LUT = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
_E4M3_LUT.setflags(write=False)

# Elements per chunk of the chunked loops (float32 temporaries stay around 4 x this many bytes).
_CHUNK_ELEMS = 1 << 22


def scale_name(name: str) -> str:
    """The scale tensor of weight `name`: `<linear>.weight` -> `<linear>.scale` (official layout)."""
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"


def _rows_per_chunk(n_cols: int, multiple: int) -> int:
    rows = max(1, _CHUNK_ELEMS // max(1, n_cols))
    return max(multiple, rows // multiple * multiple)


def _as_u8(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.uint8 else a.view(np.uint8)


def e8m0_exponents(scale: np.ndarray, what: str = "scale") -> np.ndarray:
    """E8M0 bytes -> int32 exponents (byte - 127); byte 255 is NaN in E8M0 and is rejected."""
    s = _as_u8(np.asarray(scale))
    if s.size and np.any(s == E8M0_NAN):
        raise CheckpointError(f"{what}: E8M0 scale byte 255 (NaN) found")
    return s.astype(np.int32) - E8M0_BIAS


def _pow2_exponent(amax: np.ndarray, fmt_max: float) -> np.ndarray:
    """Smallest integer e with amax / 2^e <= fmt_max, clamped to the E8M0 range [-127, 127]."""
    ratio = amax.astype(np.float64) / fmt_max
    mant, exp = np.frexp(ratio)  # ratio = mant * 2^exp, mant in [0.5, 1)
    e = np.where(mant == 0.5, exp - 1, exp)  # an exact power of two needs no extra step
    e = np.where(amax > 0, e, 0)  # all-zero block: any scale works; use 2^0
    return np.clip(e, -E8M0_BIAS, E8M0_BIAS).astype(np.int32)


def _canonical_exponent(e: np.ndarray, rounded_amax: np.ndarray, fmt_max: float) -> np.ndarray:
    """The exponent the scale rule gives for the DECODED block (rounded maximum `rounded_amax` at scale
    2^e): e, or e - 1 when the rounded maximum is exactly fmt_max / 2 (0 for a block rounded to zero)."""
    return _pow2_exponent(np.ldexp(rounded_amax.astype(np.float64), e), fmt_max)


# ---------------------------------------------------------------------------------------------
# fp8 E4M3 with 32x32 E8M0 block scales
# ---------------------------------------------------------------------------------------------
def fp8_scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    out, inn = shape
    return (-(-out // FP8_BLOCK), -(-inn // FP8_BLOCK))


def check_finite(x: np.ndarray, what: str) -> None:
    """CheckpointError naming `what` when a float tensor holds NaN or inf: a weight that would load as
    silently wrong outputs. Counted in row chunks, so a large embedding needs no full-size mask."""
    x = np.asarray(x)
    rows = x.reshape(x.shape[0], -1) if x.ndim > 1 else x.reshape(1, -1)
    step = _rows_per_chunk(rows.shape[1], 1)
    bad = sum(int(np.size(rows[r0:r0 + step]) - np.count_nonzero(np.isfinite(rows[r0:r0 + step])))
              for r0 in range(0, rows.shape[0], step))
    if bad:
        raise CheckpointError(f"{what}: {bad} non-finite value(s) (NaN or inf)")


def check_e4m3(weight: np.ndarray, name: str = "weight", row0: int = 0) -> None:
    """Reject E4M3 NaN bytes (S.1111.111) in a 2-D fp8 weight (rows from `row0`), naming the first."""
    w = _as_u8(np.asarray(weight))
    step = _rows_per_chunk(w.shape[-1], 1)
    for r0 in range(0, w.shape[0], step):
        nan = (w[r0:r0 + step] & 0x7F) == 0x7F
        if np.any(nan):
            bad = np.argwhere(nan)[0]
            raise CheckpointError(f"{name}: E4M3 NaN byte at [{row0 + r0 + bad[0]}, {bad[1]}]")


def dequantize_fp8_block(weight: np.ndarray, scale: np.ndarray, dtype=np.float32, *, name: str = "weight",
                         out: np.ndarray | None = None) -> np.ndarray:
    """fp8 E4M3 `[out, in]` (as float8_e4m3fn or raw uint8) + E8M0 block scale -> `dtype` `[out, in]`."""
    w = _as_u8(np.asarray(weight))
    if w.ndim != 2:
        raise CheckpointError(f"{name}: fp8 block-scaled weight must be 2-D, got shape {list(w.shape)}")
    want = fp8_scale_shape(w.shape)
    if tuple(scale.shape) != want:
        raise CheckpointError(f"{scale_name(name)}: shape {list(scale.shape)}, expected {list(want)} "
                              f"(ceil of {list(w.shape)} / {FP8_BLOCK})")
    exps = e8m0_exponents(scale, scale_name(name))
    n_out, n_in = w.shape
    if out is None:
        out = np.empty((n_out, n_in), dtype=dtype)
    factors = np.ldexp(np.float32(1), exps)  # exact powers of two (2^-127 is an f32 subnormal)
    aligned = n_in % FP8_BLOCK == 0
    step = _rows_per_chunk(n_in, FP8_BLOCK)
    for r0 in range(0, n_out, step):
        r1 = min(n_out, r0 + step)
        chunk = w[r0:r1]
        check_e4m3(chunk, name, r0)
        vals = _E4M3_LUT[chunk]
        f = factors[r0 // FP8_BLOCK:-(-r1 // FP8_BLOCK)]
        if aligned and (r1 - r0) % FP8_BLOCK == 0:  # broadcast the block factors, no repeat
            rows = r1 - r0
            vals = vals.reshape(rows // FP8_BLOCK, FP8_BLOCK, n_in // FP8_BLOCK, FP8_BLOCK)
            vals *= f[:, None, :, None]
            out[r0:r1] = vals.reshape(rows, n_in)
        else:
            vals *= np.repeat(np.repeat(f, FP8_BLOCK, axis=0)[: r1 - r0], FP8_BLOCK, axis=1)[:, :n_in]
            out[r0:r1] = vals
    return out


def quantize_fp8_block(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float `[out, in]` -> (float8_e4m3fn `[out, in]`, float8_e8m0fnu `[ceil(out/32), ceil(in/32)]`)."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise CheckpointError(f"fp8 block quantisation needs a 2-D weight, got shape {list(w.shape)}")
    n_out, n_in = w.shape
    sb_out, sb_in = fp8_scale_shape(w.shape)
    q = np.empty((n_out, n_in), dtype=ml_dtypes.float8_e4m3fn)
    sbytes = np.empty((sb_out, sb_in), dtype=np.uint8)
    pad_in = sb_in * FP8_BLOCK - n_in
    step = _rows_per_chunk(n_in, FP8_BLOCK)
    for r0 in range(0, n_out, step):
        r1 = min(n_out, r0 + step)
        x = np.asarray(w[r0:r1], dtype=np.float32)
        if not np.all(np.isfinite(x)):
            raise CheckpointError("fp8 quantisation: weight has non-finite values")
        pad_out = (-(r1 - r0)) % FP8_BLOCK

        def block_max(v):  # [rows, n_in] -> [row blocks, sb_in]
            v = np.pad(np.abs(v), ((0, pad_out), (0, pad_in)))
            return v.reshape(v.shape[0] // FP8_BLOCK, FP8_BLOCK, sb_in, FP8_BLOCK).max(axis=(1, 3))

        def per_value(b):  # [row blocks, sb_in] -> [rows, n_in]
            return np.repeat(np.repeat(b, FP8_BLOCK, axis=0)[: r1 - r0], FP8_BLOCK, axis=1)[:, :n_in]

        e = _pow2_exponent(block_max(x), E4M3_MAX)
        # Values below the smallest e4m3 subnormal times 2^-127 underflow in float32 first; they
        # would round to zero in e4m3 anyway. ml_dtypes casts float32 -> e4m3fn with ties-to-even.
        scaled = np.clip(np.ldexp(x, -per_value(e)), -E4M3_MAX, E4M3_MAX)
        r = scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        e2 = _canonical_exponent(e, block_max(r), E4M3_MAX)
        sbytes[r0 // FP8_BLOCK: r0 // FP8_BLOCK + e.shape[0]] = (e2 + E8M0_BIAS).astype(np.uint8)
        q[r0:r1] = np.ldexp(r, per_value(e - e2)).astype(ml_dtypes.float8_e4m3fn)  # exact: same values
    return q, sbytes.view(ml_dtypes.float8_e8m0fnu)


# ---------------------------------------------------------------------------------------------
# fp4 E2M1 packed two per byte, E8M0 scale per 32 values along the inner dimension
# ---------------------------------------------------------------------------------------------
def fp4_scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    out, inn = shape
    return (out, -(-inn // FP4_BLOCK))


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """`[..., n/2]` bytes -> `[..., n]` E2M1 codes (uint8 0..15), low nibble first."""
    p = _as_u8(np.asarray(packed))
    codes = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), dtype=np.uint8)
    codes[..., 0::2] = p & 0x0F
    codes[..., 1::2] = p >> 4
    return codes


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """`[..., n]` E2M1 codes -> `[..., n/2]` bytes (element 2j low nibble, 2j+1 high nibble)."""
    c = np.asarray(codes, dtype=np.uint8)
    if c.shape[-1] % 2:
        raise CheckpointError(f"fp4 packing needs an even inner dimension, got shape {list(c.shape)}")
    return (c[..., 0::2] & 0x0F) | ((c[..., 1::2] & 0x0F) << 4)


def dequantize_fp4(packed: np.ndarray, scale: np.ndarray, dtype=np.float32, *, name: str = "weight",
                   out: np.ndarray | None = None) -> np.ndarray:
    """Packed E2M1 `[out, in/2]` (int8 / uint8 bytes) + E8M0 scale `[out, ceil(in/32)]` -> `[out, in]`."""
    p = _as_u8(np.asarray(packed))
    if p.ndim != 2:
        raise CheckpointError(f"{name}: packed fp4 weight must be 2-D, got shape {list(p.shape)}")
    n_out, n_in = p.shape[0], p.shape[1] * 2
    want = fp4_scale_shape((n_out, n_in))
    if tuple(scale.shape) != want:
        raise CheckpointError(f"{scale_name(name)}: shape {list(scale.shape)}, expected {list(want)} "
                              f"for fp4 weight [{n_out}, {n_in}] (packed [{n_out}, {n_in // 2}])")
    exps = e8m0_exponents(scale, scale_name(name))
    if out is None:
        out = np.empty((n_out, n_in), dtype=dtype)
    factors = np.ldexp(np.float32(1), exps)
    step = _rows_per_chunk(n_in, 1)
    for r0 in range(0, n_out, step):
        r1 = min(n_out, r0 + step)
        vals = E2M1_VALUES[unpack_fp4(p[r0:r1])]
        if n_in % FP4_BLOCK == 0:
            vals = vals.reshape(r1 - r0, n_in // FP4_BLOCK, FP4_BLOCK)
            vals *= factors[r0:r1, :, None]
            out[r0:r1] = vals.reshape(r1 - r0, n_in)
        else:
            vals *= np.repeat(factors[r0:r1], FP4_BLOCK, axis=1)[:, :n_in]
            out[r0:r1] = vals
    return out


def _e2m1_codes(x: np.ndarray) -> np.ndarray:
    """float32 values already scaled into [-6, 6] -> E2M1 codes, round to nearest, ties to even."""
    a = np.abs(x)
    # Grid 0, .5, 1, 1.5, 2, 3, 4, 6 (codes 0..7). At a midpoint the even code wins, so the
    # comparison is strict where the lower neighbour is even and inclusive where the upper one is.
    mag = ((a > 0.25).astype(np.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
           + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    return mag.astype(np.uint8) | (np.signbit(x).astype(np.uint8) << 3)


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float `[out, in]` -> (packed uint8 `[out, in/2]`, float8_e8m0fnu `[out, ceil(in/32)]`)."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise CheckpointError(f"fp4 quantisation needs a 2-D weight, got shape {list(w.shape)}")
    n_out, n_in = w.shape
    if n_in % 2:
        raise CheckpointError(f"fp4 quantisation: odd inner dimension {n_in} (shape {list(w.shape)}); "
                              "two values are packed per byte")
    nb = -(-n_in // FP4_BLOCK)
    packed = np.empty((n_out, n_in // 2), dtype=np.uint8)
    sbytes = np.empty((n_out, nb), dtype=np.uint8)
    pad_in = nb * FP4_BLOCK - n_in
    step = _rows_per_chunk(n_in, 1)
    for r0 in range(0, n_out, step):
        r1 = min(n_out, r0 + step)
        x = np.asarray(w[r0:r1], dtype=np.float32)
        if not np.all(np.isfinite(x)):
            raise CheckpointError("fp4 quantisation: weight has non-finite values")

        def block_max(v):  # [rows, n_in] -> [rows, nb]
            return np.pad(np.abs(v), ((0, 0), (0, pad_in))).reshape(v.shape[0], nb, FP4_BLOCK).max(axis=2)

        def per_value(b):  # [rows, nb] -> [rows, n_in]
            return np.repeat(b, FP4_BLOCK, axis=1)[:, :n_in]

        e = _pow2_exponent(block_max(x), E2M1_MAX)
        r = E2M1_VALUES[_e2m1_codes(np.ldexp(x, -per_value(e)))]
        e2 = _canonical_exponent(e, block_max(r), E2M1_MAX)
        sbytes[r0:r1] = (e2 + E8M0_BIAS).astype(np.uint8)
        packed[r0:r1] = pack_fp4(_e2m1_codes(np.ldexp(r, per_value(e - e2))))  # exact: same values
    return packed, sbytes.view(ml_dtypes.float8_e8m0fnu)
