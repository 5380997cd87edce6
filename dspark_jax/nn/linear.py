"""A bias-free linear layer, kernel [in, out], with the optional official activation fp8 emulation,
and the mixed-precision product every bf16 matmul of the models goes through."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.nn.packed import as_compute
from dspark_jax.nn.params import fan_in_normal, param
from dspark_jax.nn.platform import by_platform
from dspark_jax.nn.quant import fp8_quant_dequant
from dspark_jax.nn.rounding import to_dtype


def mixed_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum with f32 accumulation and an f32 result, operands in their own dtype (bf16 or f32).

    This is the official forward's "bf16 x bf16 accumulated in f32". XLA:CPU has no BF16 x BF16 = F32
    dot, so on CPU the operands are widened to f32 first: a product of two bf16 numbers is exact in f32,
    so the result is the same math. TPU and GPU keep bf16 operands. The choice is made when lowering
    (`nn.platform.by_platform`), so `jax.export(..., platforms=["tpu"])` from a CPU host gets the bf16 dot.
    """
    f32, hi = jnp.float32, jax.lax.Precision.HIGHEST
    if a.dtype == f32 and b.dtype == f32:
        return jnp.einsum(spec, a, b, precision=hi)

    def widened(a, b):
        return jnp.einsum(spec, a.astype(f32), b.astype(f32), precision=hi)

    def native(a, b):
        return jnp.einsum(spec, a, b, preferred_element_type=f32)

    return by_platform(a, b, cpu=widened, default=native)


def linear(x: jax.Array, kernel: jax.Array, compute_dtype, act_fp8: bool = False, fp8_grad: str = "exact"
           ) -> jax.Array:
    """x [.., in] @ kernel [in, out] -> [.., out] in `compute_dtype`: f32 accumulation, one rounding of
    the output (SPEC 2.9: every linear returns bf16 in bf16 compute). `act_fp8` first rounds the input
    to E4M3 per 32 values along `in`, as the official fp8 GEMMs do; the fp8 values and their power-of-two
    scales are exact in bf16, so the widened product equals the blockwise fp8 GEMM up to f32 summation
    order. `kernel` may be a packed fp8 / fp4 kernel (`nn.packed`): it is dequantised here, exactly, as
    a temporary of this product. `fp8_grad` is how gradients cross that rounding (`nn.quant`)."""
    cd = jnp.dtype(compute_dtype)
    x = x.astype(cd)
    if act_fp8:
        x = fp8_quant_dequant(x, grad=fp8_grad)
    return to_dtype(mixed_einsum("...i,io->...o", x, as_compute(kernel, cd)), cd)


class Linear(nn.Module):
    in_dim: int
    out_dim: int
    axes: tuple[str, str]
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    act_fp8: bool = False  # quantize the input to fp8 per 32 values first, as the official fp8 GEMMs do
    fp8_grad: str = "exact"  # gradient through that rounding: "exact" | "straight_through" (nn.quant)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = param(self, "kernel", fan_in_normal(self.in_dim), (self.in_dim, self.out_dim),
                       self.param_dtype, self.axes)
        return linear(x, kernel, self.compute_dtype, self.act_fp8, self.fp8_grad)
