"""A bias-free linear layer, kernel [in, out], with the optional official activation fp8 emulation."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.nn.params import fan_in_normal, param
from dspark_jax.nn.quant import fp8_quant_dequant


class Linear(nn.Module):
    in_dim: int
    out_dim: int
    axes: tuple[str, str]
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    act_fp8: bool = False  # quantize the input to fp8 per 32 values first, as the official fp8 GEMMs do

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = param(self, "kernel", fan_in_normal(self.in_dim), (self.in_dim, self.out_dim),
                       self.param_dtype, self.axes)
        if self.act_fp8:
            x = fp8_quant_dequant(x)
        cd = jnp.dtype(self.compute_dtype)
        y = jnp.einsum("...i,io->...o", x.astype(cd), kernel.astype(cd), preferred_element_type=jnp.float32)
        return y.astype(cd)
