"""fp8 (E4M3 with E8M0 block scales) and fp4 (E2M1) encoding and decoding (dspark_jax.checkpoint.formats),
bit for bit against numpy encoders written from the bit layouts (helpers.checkpoint)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers.checkpoint import (E2M1_MAGS, TINY, e2m1_decode, e4m3_decode, np_fp4_decode, np_fp4_encode,
                                np_fp8_decode, np_fp8_encode, st_write)

from dspark_jax.checkpoint import formats, v41
from dspark_jax.checkpoint.safetensors_io import CheckpointError, open_checkpoint
from dspark_jax.checkpoint.trees import unflatten_paths

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
    grid = E2M1_MAGS
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
