"""fp8 KV rounding (dspark_jax.nn.quant): values land on the scaled E4M3 grid (helpers.oracles)."""

import math

import jax.numpy as jnp
import numpy as np
from helpers import e4m3_grid, np_round_e4m3

from dspark_jax.nn.quant import fp8_quant_dequant

RNG = np.random.default_rng(0)


def test_fp8_kv_rounding_lands_on_scaled_e4m3_grid():
    grid = e4m3_grid()
    x = np.concatenate([RNG.normal(size=32) * 3.0, RNG.normal(size=32) * 1e-6, RNG.normal(size=32) * 900]).astype(
        np.float32)
    x[5] = 0.0
    got = np.asarray(fp8_quant_dequant(jnp.asarray(x)[None]))[0]
    for blk in range(3):
        xb = x[32 * blk:32 * blk + 32].astype(np.float64)
        amax = max(np.abs(xb).max(), 1e-4)
        scale = 2.0 ** math.ceil(math.log2(amax / 448.0))
        want = np.array([np_round_e4m3(min(max(v / scale, -448), 448), grid) * scale for v in xb])
        np.testing.assert_array_equal(got[32 * blk:32 * blk + 32], want.astype(np.float32))
