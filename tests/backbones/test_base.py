"""The backbone interface (dspark_jax.backbones.base), run on both families (Qwen3 and mHC): row
independence, writes past the cache are dropped, stale cache entries never leak, and interface details."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.backbones import B, FAMILY_TAPS, MAX_LEN, N, QWEN_JSON, jit_forward, random_tokens

from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Config


@pytest.fixture(scope="module")
def qwen3_random():
    bb = Qwen3Backbone(Qwen3Config.from_hf_json(QWEN_JSON, tie_word_embeddings=False))  # = qwen3_hf's
    return bb, bb.init_params(jax.random.key(5)), jit_forward(bb)


@pytest.fixture(params=["qwen3", "mhc"])
def family(request, qwen3_random, mhc):
    return qwen3_random if request.param == "qwen3" else mhc


def _cache_rows(cache):
    return [a for a in cache[1:]]  # the layer-stacked arrays [L, B, S, ...]


def test_rows_are_independent(family):
    """Rows with different committed lengths: changing the other row's tokens, length and cache contents
    leaves a row's logits, taps and cache unchanged."""
    bb, params, fwd = family

    def run(seq, lengths):
        out = fwd(params, bb.init_cache(B, MAX_LEN), jnp.asarray(seq[:, :N]), taps=FAMILY_TAPS)
        cache = bb.commit(out.cache, jnp.asarray(lengths, jnp.int32))
        return fwd(params, cache, jnp.asarray(seq[:, N:]), taps=FAMILY_TAPS)

    seq = random_tokens(3, (B, N + 4))
    for row, other in ((0, 1), (1, 0)):
        changed = seq.copy()
        changed[other] = random_tokens(4 + row, (N + 4,))
        lengths = [5, 12] if row == 0 else [12, 5]
        a = run(seq, lengths)
        c = run(changed, [lengths[row], 9] if row == 0 else [9, lengths[row]])
        np.testing.assert_allclose(np.asarray(a.logits[row]), np.asarray(c.logits[row]), atol=1e-6, rtol=0)
        np.testing.assert_allclose(np.asarray(a.taps[row]), np.asarray(c.taps[row]), atol=1e-6, rtol=0)
        for x, y in zip(_cache_rows(a.cache), _cache_rows(c.cache)):
            np.testing.assert_allclose(np.asarray(x[:, row]), np.asarray(y[:, row]), atol=1e-6, rtol=0)
        assert not np.allclose(np.asarray(a.logits[other]), np.asarray(c.logits[other]), atol=1e-3)


def test_writes_past_max_len_are_dropped_and_stale_entries_never_leak(family):
    bb, params, fwd = family
    seq = random_tokens(5, (B, N))
    out = fwd(params, bb.init_cache(B, MAX_LEN), jnp.asarray(seq), taps=FAMILY_TAPS)
    cache = bb.commit(out.cache, jnp.asarray([N, 3], jnp.int32))
    # Row 0 writes positions 16..31 (only 16..23 fit); row 1 writes 3..18.
    new = random_tokens(6, (B, N))
    out = fwd(params, cache, jnp.asarray(new), taps=FAMILY_TAPS)
    # Same call with other tokens at the positions that do not fit: the slots that do fit must not care
    # (no clipping of out-of-range writes onto the last slot).
    new2 = new.copy()
    new2[0, MAX_LEN - N:] = random_tokens(7, (2 * N - MAX_LEN,))
    out2 = fwd(params, cache, jnp.asarray(new2), taps=FAMILY_TAPS)
    for before, after, after2 in zip(_cache_rows(cache), _cache_rows(out.cache), _cache_rows(out2.cache)):
        assert after.shape == before.shape
        np.testing.assert_array_equal(np.asarray(after[:, 0, :N]), np.asarray(before[:, 0, :N]))
        np.testing.assert_array_equal(np.asarray(after[:, 1, :3]), np.asarray(before[:, 1, :3]))
        assert not np.array_equal(np.asarray(after[:, 0, N:]), np.asarray(before[:, 0, N:]))
        np.testing.assert_array_equal(np.asarray(after2), np.asarray(after))
    assert np.all(np.isfinite(np.asarray(out.logits)))
    # Poison every uncommitted slot with NaN: a later call must not see it (masked AND zeroed).
    def poison(a):
        stale = jnp.arange(MAX_LEN)[None, :] >= cache.length[:, None]  # [B, S]
        return jnp.where(stale.reshape((1, B, MAX_LEN) + (1,) * (a.ndim - 3)), jnp.nan, a)
    poisoned = cache._replace(**{f: poison(getattr(cache, f)) for f in cache._fields[1:]})
    clean = fwd(params, cache, jnp.asarray(seq[:, :1]), taps=FAMILY_TAPS)
    dirty = fwd(params, poisoned, jnp.asarray(seq[:, :1]), taps=FAMILY_TAPS)
    np.testing.assert_array_equal(np.asarray(clean.logits), np.asarray(dirty.logits))
    np.testing.assert_array_equal(np.asarray(clean.taps), np.asarray(dirty.taps))


def test_interface_details(family):
    bb, params, fwd = family
    abstract = bb.abstract_params()
    assert jax.tree.structure(abstract) == jax.tree.structure(params)
    jax.tree.map(lambda a, p: (a.shape, a.dtype) == (p.shape, p.dtype) or pytest.fail(f"{a} vs {p.shape}"),
                 abstract, params)
    axes = bb.logical_axes()
    for spec in jax.tree.leaves(axes["layers"], is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)):
        assert spec[0] == "layers"
    tied = bb.tied(params)
    assert tied["embed"].shape == tied["head"].shape == (bb.vocab_size, bb.dim)
    ids = jnp.asarray([[1, 2, 3]])
    np.testing.assert_array_equal(np.asarray(bb.embed(params, ids)), np.asarray(tied["embed"][ids]))
    cache = bb.init_cache(2, 8)
    assert cache.length.dtype == jnp.int32 and cache.length.shape == (2,)
    with pytest.raises(ValueError, match=r"'taps' \[4\] out of range for tap_mode='entry' with 4 layers"):
        bb.forward(params, cache, jnp.zeros((2, 1), jnp.int32), taps=(4,))
    with pytest.raises(ValueError, match=r"'taps' \[-2\] out of range for tap_mode='output'"):
        bb.forward(params, cache, jnp.zeros((2, 1), jnp.int32), taps=(-2,), tap_mode="output")
    with pytest.raises(ValueError, match=r"'tap_mode' must be one of"):
        bb.forward(params, cache, jnp.zeros((2, 1), jnp.int32), tap_mode="exit")
    with pytest.raises(ValueError, match=r"'tokens' has batch 3 but the cache was built for batch 2"):
        bb.forward(params, cache, jnp.zeros((3, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"'n' must have shape \(2,\)"):
        bb.commit(cache, jnp.zeros((3,), jnp.int32))
    committed = jax.jit(bb.commit)(cache, jnp.asarray([2, 0]))
    assert committed.length.tolist() == [2, 0]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_cache_write_equals_a_scatter_forward_and_backward(dtype):
    """`write_rows` writes a bf16 cache through its uint16 view (issue 38: XLA:CPU scattered bf16 on an f32
    copy of the whole cache) and has its own backward pass, since the bit view has no derivative: both
    must be those of `.at[layer, b, positions].set` (out-of-range positions dropped, no gradient)."""
    from dspark_jax.backbones.base import write_rows

    rng = np.random.default_rng(5)
    store = jnp.asarray(rng.normal(size=(3, 2, 6, 4)), dtype)
    new = jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)
    positions = jnp.asarray([[1, 2, 3], [4, 5, 6]])  # row 1's last position is past the cache: dropped
    b = jnp.arange(2)[:, None]

    def scatter(store, layer, new, positions):
        return store.at[layer, b, positions].set(new.astype(store.dtype), mode="drop")

    probe = jnp.asarray(rng.normal(size=store.shape), jnp.float32)
    for layer in (0, 2):
        want = scatter(store, layer, new, positions)
        np.testing.assert_array_equal(np.asarray(jax.jit(write_rows)(store, layer, new, positions)), np.asarray(want))
        grad = lambda f: jax.grad(lambda s, n: jnp.sum(f(s, layer, n, positions).astype(jnp.float32) * probe),  # noqa: E731
                                  argnums=(0, 1))(store, new)
        for got, exp in zip(jax.jit(lambda: grad(write_rows))(), grad(scatter)):
            assert got.dtype == exp.dtype
            np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(exp.astype(jnp.float32)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_layer_loop_on_the_cache_view_gives_the_scatter_loops_tokens_and_gradient(dtype, monkeypatch):
    """Qwen3's layer loop carries the cache as a bit view (`cache_view`, `write_and_read`: issue 38, one
    conversion per step instead of two per layer). Logits, the written cache and the parameters'
    gradient through the cache equal those of the plain loop (scatter into the cache, read the layer),
    and a gradient with respect to the incoming cache is refused, not silently zero."""
    from dspark_jax.backbones import qwen3

    bb = Qwen3Backbone(Qwen3Config.from_hf_json(QWEN_JSON, tie_word_embeddings=False, compute_dtype=dtype,
                                                param_dtype=dtype))
    params = bb.init_params(jax.random.key(3))
    tokens = jnp.asarray(random_tokens(4, (B, 6)))
    cache = bb.init_cache(B, MAX_LEN)._replace(length=jnp.asarray([0, 5], jnp.int32))
    probe = jnp.asarray(np.random.default_rng(1).normal(size=(B, 6, bb.vocab_size)), jnp.float32)

    def run():
        out = jax.jit(bb.forward)(params, cache, tokens)
        grad = jax.jit(jax.grad(lambda p: jnp.sum(bb.forward(p, cache, tokens).logits * probe)))(params)
        return out, grad

    def plain_write_and_read(store, layer, new, positions):
        store = store.at[layer, jnp.arange(B)[:, None], positions].set(new.astype(store.dtype), mode="drop")
        return store, store[layer]

    viewed = run()
    monkeypatch.setattr(qwen3, "cache_view", lambda store: store)
    monkeypatch.setattr(qwen3, "cache_from_view", lambda view, dtype: view)
    monkeypatch.setattr(qwen3, "write_and_read", plain_write_and_read)
    plain = run()
    for got, want in zip(jax.tree.leaves(viewed), jax.tree.leaves(plain)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    monkeypatch.undo()
    with pytest.raises(NotImplementedError, match="incoming KV cache"):
        jax.grad(lambda k: jnp.sum(bb.forward(params, cache._replace(k=k), tokens).logits))(cache.k)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_write_and_read_equals_a_scatter_at_every_start_including_past_the_cache(dtype):
    """Each row's entries are one dynamic-update-slice, whose start XLA clamps: a row that runs past the
    cache must still write only its in-range entries, to their own slots, and keep the others."""
    from dspark_jax.backbones.base import cache_from_view, cache_view, write_and_read

    rng = np.random.default_rng(9)
    slots, t = 8, 3
    store = jnp.asarray(rng.normal(size=(2, 5, slots, 4)), dtype)
    new = jnp.asarray(rng.normal(size=(5, t, 4)), jnp.float32)
    starts = jnp.asarray([0, slots - t, slots - 2, slots - 1, slots + 1], jnp.int32)  # fits, fits, 2, 1, 0 land
    positions = starts[:, None] + jnp.arange(t, dtype=jnp.int32)
    want = store.at[1, jnp.arange(5)[:, None], positions].set(new.astype(dtype), mode="drop")
    view, rows = jax.jit(write_and_read)(cache_view(store), 1, new, positions)
    np.testing.assert_array_equal(np.asarray(cache_from_view(view, dtype)), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(want[1]))


def test_a_cache_sharded_over_rows_is_written_without_gathering_it():
    """On a mesh the cache's rows are split over `data`. A write at a dynamic row (one dynamic-update-slice
    per row was tried, issue 38) makes the SPMD partitioner all-gather the WHOLE cache; the scatter gathers
    only the new entries. No all-gather in the compiled step may be cache-sized."""
    import re

    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    bb = Qwen3Backbone(Qwen3Config.from_hf_json(QWEN_JSON, compute_dtype="bfloat16", param_dtype="bfloat16"))
    params = bb.init_params(jax.random.key(0))
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    cache = bb.init_cache(8, MAX_LEN)
    kv = NamedSharding(mesh, PartitionSpec(None, "data"))
    cache = cache._replace(length=jax.device_put(cache.length, rows), k=jax.device_put(cache.k, kv),
                           v=jax.device_put(cache.v, kv))
    tokens = jax.device_put(jnp.ones((8, 2), jnp.int32), rows)
    text = jax.jit(lambda p, c, t: bb.forward(p, c, t).cache).lower(params, cache, tokens).compile().as_text()
    gathered = [int(np.prod([int(d) for d in dims.split(",")]))
                for dims in re.findall(r"\w+\[([\d,]+)\]\S* all-gather", text)]
    assert max(gathered, default=0) < cache.k.size // 4, gathered
