"""Weights held at checkpoint precision: fp8 / fp4 block-scaled kernels as pytree nodes, dequantised
inside the jitted computation where they are consumed.

The V4.1 checkpoint stores dense linears as E4M3 with one E8M0 scale per 32x32 block and routed experts
as E2M1 packed two per byte with one E8M0 scale per 32 inputs (SPEC 3, `checkpoint.formats`).
Dequantising at load time would hold ~3.6x the checkpoint's bytes on device; these nodes keep the
stored bytes instead, so a jitted function's ARGUMENTS are the packed bytes and the bf16 / f32 kernel
exists only as a temporary of its consumer (`as_compute` in `nn.linear.linear` and `nn.moe.MoE`). On
TPU the dequantisation is an XLA elementwise fusion; whether it is fused into the dot is the compiler's
choice.

Layout is OURS, the transpose of the checkpoint's `[out, in]`: kernels `[..., in, out]` (routed experts
`[E, in, out]`), so loading is a transpose of the stored byte matrices:

* `Fp8Blocks(values float8_e4m3fn [..., in, out], exponents uint8 [..., ceil(in/32), ceil(out/32)])`,
  W[k, o] = values[k, o] * 2^(exponents[k//32, o//32] - 127).
* `Fp4Blocks(packed uint8 [..., in/2, out], exponents uint8 [..., ceil(in/32), out])`: the packing
  stays along `in` as in the checkpoint; byte j of a column holds element 2j in its LOW nibble and
  2j+1 in its HIGH nibble, each an E2M1 code (bit 3 sign, then two exponent bits and one mantissa bit:
  0, .5, 1, 1.5, 2, 3, 4, 6), W[k, o] = E2M1[code(k, o)] * 2^(exponents[k//32, o] - 127).

Exactness: an E4M3 or E2M1 value times a power of two is computed in f32 and is exact there for every
exponent byte 0..254 (f32 holds 2^-127 .. 2^127 and E4M3 has 3 mantissa bits); the cast to bf16 is
exact too unless the product leaves bf16's normal range (below 2^-126, i.e. an exponent byte near 0,
which no trained weight has: backends that flush subnormals may then give 0). Byte 255 (E8M0 NaN)
decodes as NaN. So `dequantize(w, d)` equals `checkpoint.formats.dequantize_fp8_block` /
`dequantize_fp4` (transposed) bit for bit, and a model run on packed weights computes on the very
numbers a load-time dequantisation would have given it.

The nodes are frozen dataclasses registered as pytrees: they pass through `jax.jit`, `jax.device_put`,
`jax.tree.map` (e.g. into a tree of shardings, `shardings_like`) and Flax parameter trees
(`nn.params.param` returns an existing packed value as it is).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # both formats: one scale per 32 values (fp8: 32 x 32 blocks; fp4: 32 along `in`)
E8M0_BIAS = 127
E8M0_NAN = 255


def _ceil_div(n: int, d: int) -> int:
    return -(-n // d)


def fp8_exponent_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Exponent grid of an fp8 kernel of logical shape `[..., in, out]`: `[..., ceil(in/32), ceil(out/32)]`."""
    *lead, n_in, n_out = shape
    return (*lead, _ceil_div(n_in, BLOCK), _ceil_div(n_out, BLOCK))


def fp4_packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Byte matrix of an fp4 kernel of logical shape `[..., in, out]` (`in` even): `[..., in/2, out]`."""
    *lead, n_in, n_out = shape
    if n_in % 2:
        raise ValueError(f"fp4 packs two values per byte along `in`: logical shape {list(shape)} has odd in={n_in}")
    return (*lead, n_in // 2, n_out)


def fp4_exponent_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Exponents of an fp4 kernel of logical shape `[..., in, out]`: `[..., ceil(in/32), out]`."""
    *lead, n_in, n_out = shape
    return (*lead, _ceil_div(n_in, BLOCK), n_out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Blocks:
    """An fp8 E4M3 kernel `[..., in, out]` with one E8M0 exponent byte per 32 x 32 block."""

    values: Any  # float8_e4m3fn [..., in, out]
    exponents: Any  # uint8 [..., ceil(in/32), ceil(out/32)]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantised) shape `[..., in, out]`."""
        return tuple(self.values.shape)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"values": self.shape, "exponents": fp8_exponent_shape(self.shape)}

    @classmethod
    def abstract(cls, shape: tuple[int, ...]) -> "Fp8Blocks":
        """ShapeDtypeStructs of an fp8 kernel of logical shape `shape` (export / sharding without data)."""
        shape = tuple(shape)
        return cls(jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn),
                   jax.ShapeDtypeStruct(fp8_exponent_shape(shape), jnp.uint8))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp4Blocks:
    """An fp4 E2M1 kernel `[..., in, out]`, packed two per byte along `in`, one E8M0 byte per 32 inputs."""

    packed: Any  # uint8 [..., in/2, out]
    exponents: Any  # uint8 [..., ceil(in/32), out]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantised) shape `[..., in, out]`."""
        *lead, half, n_out = self.packed.shape
        return (*lead, 2 * half, n_out)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"packed": fp4_packed_shape(self.shape), "exponents": fp4_exponent_shape(self.shape)}

    @classmethod
    def abstract(cls, shape: tuple[int, ...]) -> "Fp4Blocks":
        """ShapeDtypeStructs of an fp4 kernel of logical shape `shape` (`in` even)."""
        shape = tuple(shape)
        return cls(jax.ShapeDtypeStruct(fp4_packed_shape(shape), jnp.uint8),
                   jax.ShapeDtypeStruct(fp4_exponent_shape(shape), jnp.uint8))


PACKED_TYPES = (Fp8Blocks, Fp4Blocks)


def is_packed(x) -> bool:
    """Whether `x` is a packed kernel node (use as `is_leaf` to treat the node as one leaf)."""
    return isinstance(x, PACKED_TYPES)


def check(w, name: str = "weight") -> None:
    """Raise ValueError, naming `name`, when a packed node's fields do not agree with each other."""
    for field, want in w.expected_shapes().items():
        got = tuple(getattr(w, field).shape)
        if got != want:
            raise ValueError(f"packed parameter '{name}' ({type(w).__name__}, logical shape {list(w.shape)}): "
                             f"{field} has shape {list(got)}, expected {list(want)}")


# ---------------------------------------------------------------------------------------------
# Dequantisation (jnp, inside the consumer's computation)
# ---------------------------------------------------------------------------------------------
def _pow2(exponents: jax.Array) -> jax.Array:
    """E8M0 bytes -> f32 2^(byte - 127), exactly, by assembling the f32 bits (no exp2 approximation, no
    gather): byte b in 1..254 is the f32 exponent field itself; byte 0 is the subnormal 2^-127; 255 NaN."""
    b = exponents.astype(jnp.int32)
    normal = jax.lax.bitcast_convert_type(b << 23, jnp.float32)
    out = jnp.where(b == 0, jnp.float32(2.0 ** -127), normal)
    return jnp.where(b == E8M0_NAN, jnp.float32(jnp.nan), out)


def _expand(factor: jax.Array, axis: int, n: int) -> jax.Array:
    """Repeat a per-block array 32 times along `axis` and cut it to `n` (the last block may be partial)."""
    return jax.lax.slice_in_dim(jnp.repeat(factor, BLOCK, axis=axis), 0, n, axis=axis)


def _e2m1_to_f32(codes: jax.Array) -> jax.Array:
    """E2M1 codes (0..15, uint32) -> f32 by bit assembly: sign bit 3; exponent bits 2..1 (bias 1); mantissa
    bit 0. Exponent field 0 is the subnormal 0 / 0.5 (f32 exponent 126 for 0.5)."""
    sign, e2, m1 = codes >> 3, (codes >> 1) & 3, codes & 1
    zero = jnp.zeros_like(codes)
    exp_field = jnp.where(e2 > 0, e2 + 126, jnp.where(m1 > 0, zero + 126, zero))
    mant = jnp.where(e2 > 0, m1 << 22, zero)
    return jax.lax.bitcast_convert_type((sign << 31) | (exp_field << 23) | mant, jnp.float32)


def _unpack_fp4(packed: jax.Array) -> jax.Array:
    """uint8 `[..., in/2, out]` -> uint32 codes `[..., in, out]`: element 2j from the low nibble of row j."""
    p = packed.astype(jnp.uint32)
    codes = jnp.stack([p & 0x0F, p >> 4], axis=-2)  # [..., in/2, 2, out]
    *lead, half, _, n_out = codes.shape
    return codes.reshape(*lead, 2 * half, n_out)


def dequantize(w, dtype) -> jax.Array:
    """A packed kernel -> `dtype` `[..., in, out]` (exact; see the module docstring)."""
    if isinstance(w, Fp8Blocks):
        *_, n_in, n_out = w.shape
        f = _expand(_expand(_pow2(w.exponents), -2, n_in), -1, n_out)
        return (w.values.astype(jnp.float32) * f).astype(dtype)
    if isinstance(w, Fp4Blocks):
        n_in = w.shape[-2]
        f = _expand(_pow2(w.exponents), -2, n_in)
        return (_e2m1_to_f32(_unpack_fp4(w.packed)) * f).astype(dtype)
    raise TypeError(f"dequantize: not a packed kernel: {type(w).__name__}")


def as_compute(w, dtype) -> jax.Array:
    """The kernel in the compute dtype: dequantised if packed, else `w.astype(dtype)` (unchanged path)."""
    return dequantize(w, dtype) if is_packed(w) else w.astype(dtype)


# ---------------------------------------------------------------------------------------------
# Bytes and placement
# ---------------------------------------------------------------------------------------------
def nbytes(tree) -> int:
    """Bytes of every array of a param tree, packed or not (arrays, numpy arrays or ShapeDtypeStructs):
    the logical size, i.e. the device bytes of one unsharded copy."""
    return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def shardings_like(sharding, w):
    """The sharding of a dequantised kernel leaf -> shardings for packed node `w`: every field gets the
    kernel's PartitionSpec (the fields keep the kernel's axis order: `in` blocks, `out` (blocks)), then
    `parallel.fit_shardings` replicates any dim its mesh axes no longer divide (`in/2`, `in/32`, ...).
    An exponent grid sharded like its values is not always split at the same rows; XLA then moves the
    few exponent bytes it needs, the result is the same."""
    from dspark_jax.parallel import fit_shardings  # noqa: PLC0415  (parallel imports flax)

    node = jax.tree.map(lambda _: sharding, w)
    return fit_shardings(node, w)


def tree_shardings(shardings, params):
    """A tree of shardings of the dequantised parameters -> the same for `params`, where packed nodes get
    `shardings_like`. `shardings` must have `params`' structure down to the packed nodes."""
    return jax.tree.map(lambda sh, p: shardings_like(sh, p) if is_packed(p) else sh, shardings, params)
