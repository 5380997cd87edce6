"""dspark_jax.sampling: process_logits rules (temperature, top-k, top-p with ties, greedy), the
candidate fast path against the full sort, `sample` against softmax(process_logits) (chi-square), and
keyed randomness."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import reference_probs
from scipy import stats

from dspark_jax import sampling
from dspark_jax.sampling import SamplingParams, Stream, gumbel, probs, process_logits, request_keys, sample, uniform

# jitted once: eager calls would compile every primitive separately, which dominates the runtime here
_sample = jax.jit(sample)
_process = jax.jit(process_logits)
_uniform = jax.jit(uniform)
_gumbel = jax.jit(gumbel, static_argnums=3)


def _kept(rows, **kw):
    """Kept mask of process_logits for a few short rows. Rows are padded with -inf (never kept, no mass)
    to one [16, 8] shape so that all these small examples share a single compiled program."""
    r, v = len(rows), len(rows[0])
    logits = np.full((16, 8), -np.inf, np.float32)
    logits[:r, :v] = rows
    logits[r:, 0] = 0.0
    kw = {name: np.pad(np.broadcast_to(np.asarray(x, np.float64), (r,)), (0, 16 - r), constant_values=default)
          for (name, default), x in zip((("temperature", 1.0), ("top_k", 0), ("top_p", 1.0)),
                                        (kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0)))}
    out = np.asarray(_process(jnp.asarray(logits), SamplingParams.make(16, **kw)))
    return np.isfinite(out[:r, :v])


# ----------------------------------------------------------------------------------------------------
# process_logits


# per-row settings mixing greedy, temperature only, top-k, top-p and both
MIXED = dict(
    temperature=[0.0, 1.0, 0.5, 1.7, 1.0, 0.8, 1.3, 0.0, 2.0, 1.0],
    top_k=[0, 0, 5, 0, 3, 10, 7, 4, 1, 60],
    top_p=[1.0, 1.0, 1.0, 0.9, 1.0, 0.7, 0.95, 0.5, 0.3, 1.0],
)


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _mixed_logits(seed=0, shape=(10, 3, 50), scale=2.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def test_process_logits_matches_the_reference_rules():
    logits = _mixed_logits()
    params = SamplingParams.make(10, **MIXED)
    got = _softmax(np.asarray(_process(jnp.asarray(logits), params)))
    for r in range(10):
        for j in range(3):
            want = reference_probs(logits[r, j], MIXED["temperature"][r], MIXED["top_k"][r], MIXED["top_p"][r])
            np.testing.assert_array_equal(got[r, j] > 0, want > 0, err_msg=f"kept set, row {r}")
            np.testing.assert_allclose(got[r, j], want, rtol=2e-5, atol=1e-7)


def test_top_k_keeps_exactly_k_and_all_ties_at_the_kth_value():
    logits = [[3.0, 1.0, 2.0, 2.0, 0.0, -1.0]] * 4
    kept = _kept(logits, top_k=[1, 2, 3, 4])
    assert kept[0].tolist() == [1, 0, 0, 0, 0, 0]
    assert kept[1].tolist() == [1, 0, 1, 1, 0, 0]  # 2nd largest value is 2.0: both 2.0s stay
    assert kept[2].tolist() == [1, 0, 1, 1, 0, 0]
    assert kept[3].tolist() == [1, 1, 1, 1, 0, 0]
    # k = 0 and k >= V keep everything
    assert _kept(logits[:2], top_k=[0, 8]).all()


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = np.log(np.array([[0.5, 0.3, 0.2]] * 4, np.float32))
    kept = _kept(logits, top_p=[0.45, 0.55, 0.85, 1.0])
    assert kept.sum(-1).tolist() == [1, 2, 3, 3]
    # a tiny p still keeps the top entry
    assert _kept(logits[:1], top_p=1e-6).sum() == 1


def test_top_p_keeps_every_entry_tied_with_the_cut_in_any_order():
    base = np.log(np.array([0.4, 0.2, 0.2, 0.2], np.float32))
    rng = np.random.default_rng(1)
    for _ in range(4):
        perm = rng.permutation(4)
        logits = base[perm][None]
        # the first 0.2 is needed to reach 0.5; its ties come along, whatever their order
        assert _kept(logits, top_p=0.5).all()
        assert _kept(logits, top_p=0.3)[0].tolist() == (perm == 0).tolist()


def test_top_p_mass_is_measured_after_top_k():
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1]], np.float32))
    # after top-k = 2 the masses are 0.4/0.7 = 0.57 and 0.43: p = 0.5 keeps only the top entry (mass
    # before the second is 0.57), p = 0.6 keeps both. Measured before top-k, the mass before the second
    # entry would be 0.4 and p = 0.5 would keep two.
    assert _kept(logits, top_k=2, top_p=0.5).sum() == 1
    assert _kept(logits, top_k=2, top_p=0.6).sum() == 2


def test_greedy_is_a_single_finite_entry_at_the_first_argmax():
    logits = np.zeros((16, 8), np.float32)
    logits[:3, :4] = [[1.0, 5.0, 5.0, 2.0], [0.0, -1.0, 3.0, 3.0], [9.0, 1.0, 1.0, 1.0]]
    params = SamplingParams.make(16, temperature=[0.0, 0.0] + [1.0] * 14, top_k=[2] + [0] * 15,
                                 top_p=[0.1] + [1.0] * 15)
    out = np.asarray(_process(jnp.asarray(logits), params))
    assert out[0].tolist() == [-np.inf, 0.0] + [-np.inf] * 6  # top-k/top-p do not touch greedy rows
    assert out[1].tolist() == [-np.inf, -np.inf, 0.0] + [-np.inf] * 5
    assert np.isfinite(out[2]).all()  # a sampled row in the same batch is untouched


def test_temperature_scales_and_tiny_temperatures_do_not_produce_nan():
    logits = _mixed_logits(2, (16, 8))
    temps = [0.5, 1e-30, 3.0] + [1.0] * 13
    got = _softmax(np.asarray(_process(jnp.asarray(logits), SamplingParams.make(16, temperature=temps))))
    np.testing.assert_allclose(got[0], reference_probs(logits[0], 0.5, 0, 1.0), rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(got[2], reference_probs(logits[2], 3.0, 0, 1.0), rtol=2e-5, atol=1e-7)
    assert np.isfinite(got).all()
    assert got[1].tolist() == np.eye(8)[np.argmax(logits[1])].tolist()


def test_probs_is_the_softmax_of_process_logits():
    logits = jnp.asarray(_mixed_logits(3, (16, 8)))
    params = SamplingParams.make(16, temperature=0.7, top_k=5, top_p=0.9)
    np.testing.assert_allclose(np.asarray(jax.jit(probs)(logits, params)),
                               _softmax(np.asarray(_process(logits, params))), rtol=1e-6, atol=1e-7)


def test_candidate_fast_path_equals_the_full_sort_bit_for_bit():
    """Rows whose kept set does not fit in the candidates go through the full sort; every row must come
    out identical whichever path the batch took, or a request would depend on its batch."""
    logits = _mixed_logits(4, (10, 3, 50))
    logits[3, 1] = 0.0  # a flat row: its nucleus needs 45 of 50 entries
    params = SamplingParams.make(10, **MIXED)
    full = np.asarray(_process(jnp.asarray(logits), params))  # V = 50 candidates: never falls back
    for c in (2, 8):
        process_c = jax.jit(lambda x, p, c=c: sampling._process_logits(x, p, candidates=c))
        np.testing.assert_array_equal(np.asarray(process_c(logits, params)), full, err_msg=f"candidates={c}")
    # row 3's nucleus needs more than 8 candidates, so the batch above took the full sort; the same rows
    # in batches where no row needs it (all copies of one row) must agree bit for bit
    assert np.isfinite(full[3]).sum(-1).max() > 8
    for r in (2, 4, 6):  # top-k 5; top-k 3; top-k 7 + top-p 0.95: all fit in 8 candidates
        fast = process_c(np.broadcast_to(logits[r], logits.shape), jax.tree.map(lambda x: jnp.full_like(x, x[r]), params))
        np.testing.assert_array_equal(np.asarray(fast)[0], full[r], err_msg=f"row {r}")


def test_full_sort_fallback_on_a_large_vocabulary():
    """The public path with V > 1024 candidates: a flat row with a 0.999 nucleus forces the fallback."""
    v = 3000
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((3, v)) * 3).astype(np.float32)
    logits[1] = rng.standard_normal(v).astype(np.float32) * 0.01
    cfg = dict(temperature=[1.0, 1.0, 0.7], top_k=[0, 0, 2000], top_p=[0.9, 0.999, 1.0])
    got = np.asarray(probs(jnp.asarray(logits), SamplingParams.make(3, **cfg)))
    assert (got[1] > 0).sum() > 1024 and (got[2] > 0).sum() == 2000
    for r in range(3):
        want = reference_probs(logits[r], cfg["temperature"][r], cfg["top_k"][r], cfg["top_p"][r])
        np.testing.assert_array_equal(got[r] > 0, want > 0)
        np.testing.assert_allclose(got[r], want, rtol=1e-4, atol=1e-9)


# ----------------------------------------------------------------------------------------------------
# sample


SAMPLE_CONFIGS = [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.5, 4, 1.0), (1.0, 0, 0.8), (1.2, 6, 0.9), (0.0, 0, 1.0)]
SAMPLE_N = 20_000
SAMPLE_ROW = np.random.default_rng(6).standard_normal(10).astype(np.float32) * 1.5


@pytest.fixture(scope="module")
def drawn():
    """SAMPLE_N draws per configuration with distinct seeds and positions, in one batched call."""
    total = SAMPLE_N * len(SAMPLE_CONFIGS)
    params = SamplingParams.make(total, *(np.repeat([c[i] for c in SAMPLE_CONFIGS], SAMPLE_N) for i in range(3)))
    positions = jnp.asarray(np.random.default_rng(7).integers(0, 10**6, total), jnp.int32)
    logits = jnp.broadcast_to(jnp.asarray(SAMPLE_ROW), (total, SAMPLE_ROW.size))
    tokens = _sample(logits, params, jnp.arange(total, dtype=jnp.uint32), positions, Stream.DRAFT)
    return np.asarray(tokens).reshape(len(SAMPLE_CONFIGS), SAMPLE_N)


def test_sample_draws_from_softmax_of_process_logits(drawn):
    """Chi-square per configuration at alpha = 1e-3. Power: the two likeliest tokens have probabilities
    of at most 0.44 and 0.22 here, so moving 0.02 of mass between two tokens gives noncentrality
    lambda >= 20000 * 0.02^2 * (1/0.44 + 1/0.22) = 55 and power >= 0.99 (scipy.stats.ncx2, df <= 9)."""
    v = SAMPLE_ROW.size
    for c, config in enumerate(SAMPLE_CONFIGS):
        want = reference_probs(SAMPLE_ROW, *config)
        counts = np.bincount(drawn[c], minlength=v)
        assert counts[want == 0].sum() == 0, config
        if config[0] == 0:
            assert counts[np.argmax(SAMPLE_ROW)] == SAMPLE_N
            continue
        pv = stats.chisquare(counts[want > 0], want[want > 0] * SAMPLE_N).pvalue
        assert pv > 1e-3, (config, pv)


def test_sample_chi_square_detects_a_wrong_distribution(drawn):
    """The same check has power: the T = 1 draws tested against T = 1.1 fail."""
    counts = np.bincount(drawn[0], minlength=SAMPLE_ROW.size)
    assert stats.chisquare(counts, reference_probs(SAMPLE_ROW, 1.1, 0, 1.0) * SAMPLE_N).pvalue < 1e-3


# ----------------------------------------------------------------------------------------------------
# keyed randomness


def test_keys_depend_on_seed_position_and_stream_only():
    seeds = jnp.asarray([1, 2, 3, 1], jnp.uint32)
    pos = jnp.asarray([10, 10, 11, 10], jnp.int32)
    u = np.asarray(_uniform(seeds, pos, Stream.ACCEPT))
    assert u[0] == u[3] and len({u[0], u[1], u[2]}) == 3  # same (seed, pos) -> same number
    # a request's numbers do not depend on the other requests in the batch
    np.testing.assert_array_equal(np.asarray(_uniform(seeds[2:3], pos[2:3], Stream.ACCEPT)), u[2:3])
    streams = [np.asarray(_uniform(seeds, pos, s)) for s in Stream]
    assert len({float(s[0]) for s in streams}) == 3
    g = np.asarray(_gumbel(seeds, pos, Stream.RESAMPLE, 7))
    np.testing.assert_array_equal(g[0], g[3])
    keys = jax.random.key_data(request_keys(seeds, pos, Stream.DRAFT))
    traced = jax.jit(lambda s: jax.random.key_data(request_keys(seeds, pos, s)))(jnp.int32(Stream.DRAFT))
    np.testing.assert_array_equal(keys, traced)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def test_gumbel_is_jax_random_gumbel_bit_for_bit(monkeypatch):
    """gumbel() is jax.random.gumbel(request_keys(seeds, positions, stream)[r], (V,)) bit for bit: the
    fused threefry path (any leading shape, negative positions, a traced stream, odd vocabularies) and
    the jax.random fallback used in any other jax configuration."""
    assert sampling._fused_threefry_matches_jax()  # the default configuration takes the fused path
    rng = np.random.default_rng(5)
    seeds = jnp.asarray(rng.integers(0, 2**32, (3, 4), dtype=np.uint64).astype(np.uint32))
    pos = jnp.asarray(rng.integers(-2**31, 2**31 - 1, (3, 4)), jnp.int32)

    def want(v, stream, s=seeds, p=pos):
        keys = request_keys(s.reshape(-1), p.reshape(-1), stream)
        return jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(keys).reshape(s.shape + (v,))

    for v in (1, 7, 300):
        for stream in Stream:
            np.testing.assert_array_equal(_bits(_gumbel(seeds, pos, stream, v)), _bits(want(v, stream)))
    traced = jax.jit(lambda st: gumbel(seeds, pos, st, 7))(jnp.int32(Stream.ACCEPT))
    np.testing.assert_array_equal(_bits(traced), _bits(want(7, Stream.ACCEPT)))
    # many draws (the extremes of the uniform included by chance): 2 x 129280 values
    np.testing.assert_array_equal(_bits(_gumbel(seeds[0, :2], pos[0, :2], Stream.DRAFT, 129280)),
                                  _bits(want(129280, Stream.DRAFT, seeds[0, :2], pos[0, :2])))
    monkeypatch.setattr(sampling, "_fused_threefry_matches_jax", lambda: False)
    fallback = jax.jit(lambda s_, p_: gumbel(s_, p_, Stream.RESAMPLE, 7))(seeds, pos)
    np.testing.assert_array_equal(_bits(fallback), _bits(want(7, Stream.RESAMPLE)))


def test_first_argmax_is_jnp_argmax():
    """first_argmax picks jnp.argmax's index: the first maximum (ties, -0.0 == 0.0, infinities), the first
    NaN of a row with NaNs, any leading shape; also when the row is fused elementwise work (logits + noise)."""
    rng = np.random.default_rng(2)
    values = np.array([0.0, -0.0, 1.0, -1.0, 2.0, np.inf, -np.inf, np.nan], np.float32)
    x = rng.choice(values, size=(64, 3, 11), p=[0.2, 0.2, 0.2, 0.15, 0.1, 0.05, 0.05, 0.05]).astype(np.float32)
    x[0, 0] = -np.inf  # all -inf: index 0
    x[1, 0] = np.nan
    got = jax.jit(sampling.first_argmax)(jnp.asarray(x))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    logits = jnp.asarray(rng.normal(size=(8, 4096)), jnp.float32)
    seeds, pos = jnp.arange(8, dtype=jnp.uint32), jnp.arange(8, dtype=jnp.int32)
    fused = jax.jit(lambda l_: sampling.first_argmax(l_ + gumbel(seeds, pos, Stream.DRAFT, 4096)))(logits)
    want = jax.jit(lambda l_: jnp.argmax(l_ + gumbel(seeds, pos, Stream.DRAFT, 4096), axis=-1))(logits)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(want))


def test_greedy_rows_sample_the_first_argmax_alone_and_in_any_batch():
    """A greedy row draws argmax(logits) (first maximum): in an all-greedy batch (which skips the
    processing and the noise) and next to sampled and filtered rows (argmax(processed + noise)), the
    same token, including ties, -inf and +inf entries."""
    logits = _mixed_logits(seed=4, shape=(10, 50))
    logits[0, [3, 9]] = 10.0  # a tie: the first wins
    logits[7, :] = -np.inf
    logits[7, [20, 30]] = -1.0
    logits[2, [5, 6]] = np.inf
    rng = np.random.default_rng(1)
    seeds = jnp.asarray(rng.integers(0, 2**31, 10), jnp.uint32)
    pos = jnp.asarray(rng.integers(0, 1000, 10), jnp.int32)
    x = jnp.asarray(logits)
    want = np.argmax(logits, axis=-1)
    assert want[0] == 3 and want[7] == 20 and want[2] == 5
    alone = np.asarray(_sample(x, SamplingParams.greedy(10), seeds, pos, Stream.DRAFT))
    np.testing.assert_array_equal(alone, want)
    mixed = SamplingParams.make(10, **MIXED)  # rows 0 and 7 greedy, the others sampled with filters
    np.testing.assert_array_equal(np.asarray(_sample(x, mixed, seeds, pos, Stream.DRAFT))[[0, 7]], want[[0, 7]])
    # the general formula (what a mixed batch computes) for every row made greedy
    greedy = SamplingParams.greedy(10)
    general = jnp.argmax(_process(x, greedy) + _gumbel(seeds, pos, Stream.DRAFT, 50), axis=-1)
    np.testing.assert_array_equal(np.asarray(general), want)


def test_streams_are_uniform_and_uncorrelated():
    n = 50_000
    seeds = jnp.arange(n, dtype=jnp.uint32)
    pos = jnp.full((n,), 123, jnp.int32)
    draws = {s: np.asarray(_uniform(seeds, pos, s)) for s in Stream}
    for s, u in draws.items():
        assert 0.0 <= u.min() and u.max() < 1.0
        assert stats.chisquare(np.histogram(u, bins=20, range=(0, 1))[0]).pvalue > 1e-3, s
    # independent streams: correlation ~ N(0, 1/sqrt(n)) = 0.0045; 0.02 is 4.5 sigma
    for a, b in ((Stream.DRAFT, Stream.ACCEPT), (Stream.DRAFT, Stream.RESAMPLE), (Stream.ACCEPT, Stream.RESAMPLE)):
        assert abs(np.corrcoef(draws[a], draws[b])[0, 1]) < 0.02
    # consecutive positions of one stream too
    nxt = np.asarray(_uniform(seeds, pos + 1, Stream.DRAFT))
    assert abs(np.corrcoef(draws[Stream.DRAFT], nxt)[0, 1]) < 0.02


# ----------------------------------------------------------------------------------------------------
# SamplingParams


@pytest.mark.parametrize("field,kw", [("temperature", dict(temperature=-1.0)), ("temperature", dict(temperature=np.nan)),
                                      ("top_k", dict(top_k=-2)), ("top_p", dict(top_p=0.0)),
                                      ("top_p", dict(top_p=1.5))])
def test_bad_params_name_the_field(field, kw):
    with pytest.raises(ValueError, match=f"'{field}'"):
        SamplingParams.make(3, **kw)


def test_params_constructors():
    p = SamplingParams.make(4, temperature=[0.0, 1.0, 0.5, 2.0], top_k=3)
    assert p.top_k.tolist() == [3, 3, 3, 3] and p.top_p.tolist() == [1.0] * 4
    assert SamplingParams.greedy(2).temperature.tolist() == [0.0, 0.0]
