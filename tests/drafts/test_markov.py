"""The Markov heads (dspark_jax.drafts.markov) against a float64 numpy reference written from SPEC 4.1
(`helpers.np_markov_step`), which works slot by slot on torch-layout weights ([out, in], the checkpoint's
layout) split into their input-column blocks, so it shares no code (and no concatenation) with the module."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import np_markov_step

from dspark_jax import sampling
from dspark_jax.drafts import markov

V, R, H, K, B = 48, 8, 12, 4, 4
HEADS = ("vanilla", "gated", "rnn")


# ---------------------------------------------------------------------------------------------------
# float64 numpy reference (SPEC 4.1)
# ---------------------------------------------------------------------------------------------------


def _np(params):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), params)


def ref_step(head, p, prev, h, s):
    """One slot for one request: (z [r], bias [V], next state [r]) by `helpers.np_markov_step` on the
    checkpoint's torch layouts (our kernels are [in, out]). p: numpy f64 params."""
    gate = (p["gate"]["kernel"].T, p["gate"]["bias"]) if head == "gated" else None
    joint = (p["joint"]["kernel"].T, p["joint"]["bias"]) if head == "rnn" else None
    return np_markov_step(head, p["embed"], p["head"], prev, h, s, gate, joint)


def ref_teacher_forced(head, p, prev, hidden):
    """prev int[N, K], hidden [N, K, H] -> (z [N, K, r], bias [N, K, V]); the state is zero at each block."""
    n, k = prev.shape
    z = np.zeros((n, k, R))
    bias = np.zeros((n, k, V))
    for i in range(n):
        s = np.zeros(R)
        for j in range(k):
            z[i, j], bias[i, j], s = ref_step(head, p, prev[i, j], hidden[i, j], s)
    return z, bias


def ref_greedy_chain(head, p, base, anchor, hidden):
    """Greedy drafting of one block per row: tokens [B, K], biased logits [B, K, V]."""
    b, k, _ = base.shape
    tokens = np.zeros((b, k), np.int64)
    logits = np.zeros((b, k, V))
    for i in range(b):
        prev, s = anchor[i], np.zeros(R)
        for j in range(k):
            _, bias, s = ref_step(head, p, prev, hidden[i, j], s)
            logits[i, j] = base[i, j] + bias
            prev = tokens[i, j] = int(np.argmax(logits[i, j]))
    return tokens, logits


# ---------------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------------


def make_params(head, seed=0, dtype=jnp.float32):
    """Random parameters at scales where every nonlinearity and the biases matter."""
    rng = np.random.default_rng(seed)
    p = {"embed": rng.normal(0, 1.0, (V, R)), "head": rng.normal(0, 0.7, (V, R))}
    if head == "gated":
        p["gate"] = {"kernel": rng.normal(0, 0.5, (H + R, R)), "bias": rng.normal(0, 0.3, (R,))}
    if head == "rnn":
        p["joint"] = {"kernel": rng.normal(0, 0.5, (2 * R + H, 3 * R)), "bias": rng.normal(0, 0.3, (3 * R,))}
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), p)


def make_inputs(seed=1, n=B, k=K):
    rng = np.random.default_rng(seed)
    prev = rng.integers(0, V, (n, k)).astype(np.int32)
    hidden = rng.normal(0, 1.0, (n, k, H)).astype(np.float32)
    base = rng.normal(0, 2.0, (n, k, V)).astype(np.float32)
    return prev, hidden, base


# ---------------------------------------------------------------------------------------------------
# head types and parameters
# ---------------------------------------------------------------------------------------------------


def test_parse_head_type():
    assert markov.parse_head_type("vanilla") == "vanilla"
    assert markov.parse_head_type("Gated") == "gated"
    assert markov.parse_head_type(" RNN ") == "rnn"
    for bad in ("lstm", "", None, 3):
        with pytest.raises(ValueError, match=r"markov_head_type: expected one of 'vanilla', 'gated', 'rnn'"):
            markov.parse_head_type(bad)
    assert markov.is_stateful("RNN") and not markov.is_stateful("gated") and not markov.is_stateful("vanilla")


@pytest.mark.parametrize("head", HEADS)
def test_param_layout_and_init(head):
    """MarkovHead declares W1, W2 and the head's own linear with logical axes; init as DeepSpec's."""
    module = markov.MarkovHead(V, R, H, head.upper(), "bfloat16")  # the head type is read case-insensitively
    boxed = module.init(jax.random.key(0))["params"]
    params = nn.unbox(boxed)
    want = {("embed",): (V, R), ("head",): (V, R)}
    if head == "gated":
        want.update({("gate", "kernel"): (H + R, R), ("gate", "bias"): (R,)})
    if head == "rnn":
        want.update({("joint", "kernel"): (2 * R + H, 3 * R), ("joint", "bias"): (3 * R,)})
    flat = {tuple(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert {p: tuple(x.shape) for p, x in flat.items()} == want
    assert all(x.dtype == jnp.bfloat16 for x in flat.values())
    axes = nn.get_partition_spec(boxed)
    assert tuple(axes["embed"]) == ("vocab", "markov") and tuple(axes["head"]) == ("vocab", "markov")
    for path, x in flat.items():
        x = np.asarray(x, np.float32)
        if path[-1] == "bias":
            assert np.all(x == 0)
        else:  # N(0, 0.02) everywhere (DeepSpec's initializer_range)
            assert 0.012 < x.std() < 0.028 and abs(x.mean()) < 0.01
    assert module.apply({"params": params}).keys() == {p[0] for p in want}
    with pytest.raises(ValueError, match="markov_head_type"):
        markov.MarkovHead(V, R, H, "lstm").init(jax.random.key(0))


# ---------------------------------------------------------------------------------------------------
# one slot, teacher forcing, the recurrent state
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", HEADS)
def test_slot_bias_matches_reference(head):
    params = make_params(head)
    p = _np(params)
    prev, hidden, _ = make_inputs()
    rng = np.random.default_rng(7)
    state = rng.normal(0, 0.5, (B, R)).astype(np.float32)
    emb = jnp.take(params["embed"], prev[:, 0], axis=0)
    bias, new_state = markov.slot_bias(head, params, emb, jnp.asarray(hidden[:, 0]), jnp.asarray(state))
    assert bias.dtype == jnp.float32 and bias.shape == (B, V)
    for i in range(B):
        _, want, s_next = ref_step(head, p, prev[i, 0], hidden[i, 0].astype(np.float64), state[i].astype(np.float64))
        np.testing.assert_allclose(np.asarray(bias[i]), want, rtol=1e-5, atol=1e-5)
        if head == "rnn":
            np.testing.assert_allclose(np.asarray(new_state[i]), s_next, rtol=1e-5, atol=1e-6)
    if head != "rnn":
        assert new_state is None
    # state None = the zero state of a block start
    a, _ = markov.slot_bias(head, params, emb, jnp.asarray(hidden[:, 0]), None)
    b, _ = markov.slot_bias(head, params, emb, jnp.asarray(hidden[:, 0]), jnp.zeros((B, R)))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("head", HEADS)
def test_teacher_forced_matches_reference_and_per_slot(head):
    params = make_params(head)
    prev, hidden, _ = make_inputs()
    emb, z = markov.teacher_forced_latents(head, params, jnp.asarray(prev), jnp.asarray(hidden))
    bias = markov.teacher_forced_bias(head, params, jnp.asarray(prev), jnp.asarray(hidden))
    np.testing.assert_array_equal(np.asarray(emb), np.asarray(params["embed"])[prev])
    want_z, want_bias = ref_teacher_forced(head, _np(params), prev, hidden.astype(np.float64))
    np.testing.assert_allclose(np.asarray(z), want_z, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(bias), want_bias, rtol=1e-5, atol=1e-5)
    # bias = W2 z for every head type (what the fused loss relies on)
    np.testing.assert_allclose(np.asarray(markov.project(params, z)), np.asarray(bias), rtol=1e-6, atol=1e-6)

    # equal to running the per-slot function with the ground-truth prevs, the state chained by hand
    state = markov.initial_state(head, params, (B,))
    for k in range(K):
        slot, state = markov.slot_bias(head, params, jnp.take(params["embed"], prev[:, k], axis=0),
                                       jnp.asarray(hidden[:, k]), state)
        np.testing.assert_allclose(np.asarray(bias[:, k]), np.asarray(slot), rtol=1e-6, atol=1e-6)

    # any leading shape; under jit
    f = jax.jit(markov.teacher_forced_bias, static_argnums=0)
    got = f(head, params, jnp.asarray(prev).reshape(2, 2, K), jnp.asarray(hidden).reshape(2, 2, K, H))
    np.testing.assert_allclose(np.asarray(got).reshape(B, K, V), np.asarray(bias), rtol=1e-6, atol=1e-6)


def test_rnn_state_carried_within_block_and_reset_between_blocks():
    """Two consecutive blocks of one sequence (2K slots): the state runs through slots 0..K-1, then
    starts from zero again at slot K; slot k depends on every earlier prev / hidden of its block only."""
    params = make_params("rnn")
    p = _np(params)
    rng = np.random.default_rng(3)
    seq = rng.integers(0, V, 2 * K).astype(np.int32)
    hid = rng.normal(0, 1.0, (2 * K, H)).astype(np.float32)
    prev, hidden = seq.reshape(2, K), hid.reshape(2, K, H)
    got = np.asarray(markov.teacher_forced_bias("rnn", params, jnp.asarray(prev), jnp.asarray(hidden)))

    s = np.zeros(R)
    carried = np.zeros((2 * K, V))
    reset = np.zeros((2 * K, V))
    for t in range(2 * K):  # one pass over the sequence; `reset` zeroes the state at each block start
        if t % K == 0:
            s_reset = np.zeros(R)
        _, reset[t], s_reset = ref_step("rnn", p, seq[t], hid[t].astype(np.float64), s_reset)
        _, carried[t], s = ref_step("rnn", p, seq[t], hid[t].astype(np.float64), s)
    np.testing.assert_allclose(got.reshape(2 * K, V), reset, rtol=1e-5, atol=1e-5)
    assert np.abs(carried[K:] - reset[K:]).max() > 1e-2  # the test would see a state leaking across blocks
    # the recurrence matters inside the block: slot 1 changes when only slot 0's inputs change
    prev2 = prev.copy()
    prev2[:, 0] = (prev2[:, 0] + 1) % V
    got2 = np.asarray(markov.teacher_forced_bias("rnn", params, jnp.asarray(prev2), jnp.asarray(hidden)))
    assert np.abs(got2[:, 1:] - got[:, 1:]).min(axis=-1).max() > 0
    for head in ("vanilla", "gated"):  # memoryless: only slot 0 changes
        g1 = markov.teacher_forced_bias(head, make_params(head), jnp.asarray(prev), jnp.asarray(hidden))
        g2 = markov.teacher_forced_bias(head, make_params(head), jnp.asarray(prev2), jnp.asarray(hidden))
        np.testing.assert_array_equal(np.asarray(g1[:, 1:]), np.asarray(g2[:, 1:]))


# ---------------------------------------------------------------------------------------------------
# the sampling loop
# ---------------------------------------------------------------------------------------------------


_sample_block = jax.jit(markov.sample_block, static_argnums=0, static_argnames=("filtering", "impl", "compute_dtype"))


@pytest.mark.parametrize("head", HEADS)
def test_sample_block_greedy_matches_reference_chain_two_blocks(head):
    params = make_params(head)
    p = _np(params)
    rng = np.random.default_rng(11)
    anchor = rng.integers(0, V, B).astype(np.int32)
    sp = sampling.SamplingParams.greedy(B)
    seeds = jnp.arange(B, dtype=jnp.uint32)
    pos = jnp.full((B,), 17, jnp.int32)
    for _ in range(2):  # two consecutive proposals: the second starts from the first's last token
        _, hidden, base = make_inputs(int(rng.integers(1 << 30)))
        tokens, logits, emb = _sample_block(head, params, jnp.asarray(base), jnp.asarray(anchor),
                                            jnp.asarray(hidden), sp, seeds, pos)
        want_tokens, want_logits = ref_greedy_chain(head, p, base.astype(np.float64), anchor,
                                                    hidden.astype(np.float64))
        np.testing.assert_array_equal(np.asarray(tokens), want_tokens)
        np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=1e-5, atol=1e-5)
        prevs = np.concatenate([anchor[:, None], want_tokens[:, :-1]], axis=1)
        np.testing.assert_array_equal(np.asarray(emb), np.asarray(params["embed"])[prevs])
        assert tokens.dtype == jnp.int32 and logits.dtype == jnp.float32
        anchor = want_tokens[:, -1].astype(np.int32)
        pos = pos + K


_sample = jax.jit(sampling.sample, static_argnums=4)


# filtering=False changes the path only for vanilla (the fused sampler); the other heads always scan
@pytest.mark.parametrize("head, filtering", [(h, True) for h in HEADS] + [("vanilla", False)])
def test_sample_block_sampled_rows(head, filtering):
    """Mixed greedy / sampled rows, mixed couplings: each token is the keyed draw sampling.sample(logits_k,
    ..., first + k, stream) of the logits returned for it (stream DRAFT, or the target's RESAMPLE for the
    invariant rows 1 and 2), and those logits are the base plus the head's bias of the chain actually drawn
    (the teacher-forced reference on [anchor, tokens[:-1]])."""
    params = make_params(head)
    prev, hidden, base = make_inputs(5)
    anchor = prev[:, 0]
    sp = sampling.SamplingParams.make(B, temperature=[0.0, 0.8, 1.5, 1.0],
                                      top_k=[0, 0, 0, 0] if not filtering else [0, 5, 0, 0],
                                      top_p=[1.0, 1.0, 1.0, 1.0] if not filtering else [1.0, 1.0, 0.9, 1.0],
                                      invariant=[False, True, True, False])
    seeds = jnp.asarray([3, 1, 4, 1], jnp.uint32)
    first = jnp.asarray([5, 9, 2, 6], jnp.int32)
    tokens, logits, emb = _sample_block(head, params, jnp.asarray(base), jnp.asarray(anchor), jnp.asarray(hidden),
                                        sp, seeds, first, filtering=filtering)
    for k in range(K):
        own = _sample(logits[:, k], sp, seeds, first + k, sampling.Stream.DRAFT)
        target = _sample(logits[:, k], sp, seeds, first + k, sampling.Stream.RESAMPLE)
        np.testing.assert_array_equal(np.where(sp.invariant, target, own), np.asarray(tokens[:, k]))
    prevs = np.concatenate([anchor[:, None], np.asarray(tokens)[:, :-1]], axis=1)
    _, want_bias = ref_teacher_forced(head, _np(params), prevs, hidden.astype(np.float64))
    np.testing.assert_allclose(np.asarray(logits), base + want_bias, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(emb), np.asarray(params["embed"])[prevs])


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_temperature_only_dispatch_equals_the_reference_scan(head, impl):
    """filtering=False sends the vanilla head to the fused sampler (Pallas, interpreted on CPU) and the gated /
    recurrent heads to the reference scan (they are not fused); either way the tokens, logits and
    embeddings equal those of the reference scan (filtering=True with no filter set)."""
    params = make_params(head)
    prev, hidden, base = make_inputs(21)
    sp = sampling.SamplingParams.make(B, temperature=[0.0, 0.7, 1.3, 0.0], invariant=[False, True, False, True])
    seeds = jnp.asarray([7, 8, 9, 10], jnp.uint32)
    first = jnp.asarray([4, 40, 400, 4000], jnp.int32)
    args = (jnp.asarray(base), jnp.asarray(prev[:, 0]), jnp.asarray(hidden), sp, seeds, first)
    ref = _sample_block(head, params, *args, filtering=True, impl="xla")
    got = _sample_block(head, params, *args, filtering=False, impl=impl)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref[1]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(ref[2]))


def test_draft_noise_is_the_keyed_gumbel_of_each_draft_position():
    """Draft token k's noise is gumbel(seed, first_position + k - 1, DRAFT), whatever the batch."""
    seeds = jnp.array([7, 8, 9], jnp.uint32)
    first = jnp.array([5, 31, -2], jnp.int32)
    noise = np.asarray(jax.jit(lambda s, f: markov.draft_noise(s, f, 4, 33))(seeds, first))
    assert noise.shape == (3, 4, 33)
    for k in range(4):
        keys = sampling.request_keys(seeds, first + k, sampling.Stream.DRAFT)
        want = jax.vmap(lambda key: jax.random.gumbel(key, (33,), jnp.float32))(keys)
        np.testing.assert_array_equal(noise[:, k].view(np.uint32), np.asarray(want).view(np.uint32))
    # one stream per row (sampling.draft_stream): each row's noise is its own stream's
    streams = jnp.array([0, 2, 0], jnp.uint32)
    mixed = np.asarray(jax.jit(lambda s, f, st: markov.draft_noise(s, f, 4, 33, st))(seeds, first, streams))
    target = np.asarray(jax.jit(lambda s, f: markov.draft_noise(s, f, 4, 33, sampling.Stream.RESAMPLE))(seeds, first))
    np.testing.assert_array_equal(mixed, np.where(np.asarray(streams == 2)[:, None, None], target, noise))
    assert not np.array_equal(target, noise)


def test_hidden_required_for_gated_and_rnn():
    for head in ("gated", "rnn"):
        params = make_params(head)
        prev, _, base = make_inputs()
        with pytest.raises(ValueError, match="hidden"):
            markov.teacher_forced_bias(head, params, jnp.asarray(prev), None)
        with pytest.raises(ValueError, match="hidden"):
            markov.sample_block(head, params, jnp.asarray(base), jnp.asarray(prev[:, 0]), None,
                                sampling.SamplingParams.greedy(B), jnp.zeros(B, jnp.uint32), jnp.zeros(B, jnp.int32))


# ---------------------------------------------------------------------------------------------------
# precision and gradients
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", HEADS)
def test_bf16_compute_close_to_f32(head):
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_params(head))
    prev, hidden, _ = make_inputs()
    f32 = markov.teacher_forced_bias(head, params, jnp.asarray(prev), jnp.asarray(hidden))
    _, z16 = markov.teacher_forced_latents(head, params, jnp.asarray(prev), jnp.asarray(hidden),
                                           compute_dtype=jnp.bfloat16)
    b16 = markov.teacher_forced_bias(head, params, jnp.asarray(prev), jnp.asarray(hidden), compute_dtype=jnp.bfloat16)
    assert z16.dtype == jnp.bfloat16 and b16.dtype == jnp.float32
    assert np.all(np.asarray(b16) == np.asarray(b16.astype(jnp.bfloat16).astype(jnp.float32)))  # bf16 values
    scale = float(jnp.abs(f32).max())
    assert float(jnp.abs(b16 - f32).max()) < 0.03 * scale
    if head == "vanilla":  # z = e exactly; only the final rounding differs
        np.testing.assert_array_equal(np.asarray(b16), np.asarray(f32.astype(jnp.bfloat16).astype(jnp.float32)))


@pytest.mark.parametrize("head", ["gated", "rnn", "vanilla"])
def test_gradients_match_finite_differences_x64(head):
    with jax.enable_x64(True):
        params = make_params(head, dtype=jnp.float64)
        prev, hidden, base = make_inputs(9, n=3)
        hidden = jnp.asarray(hidden, jnp.float64)
        base = jnp.asarray(base, jnp.float64)
        labels = jnp.asarray(np.random.default_rng(2).integers(0, V, prev.shape))
        weights = jnp.exp(-jnp.arange(K, dtype=jnp.float64) / 4.0)

        def loss(params, hidden):  # weighted CE of the teacher-forced draft logits, as the training loss
            logits = base + markov.teacher_forced_bias(head, params, jnp.asarray(prev), hidden,
                                                       compute_dtype=jnp.float64)
            assert logits.dtype == jnp.float64
            lp = jax.nn.log_softmax(logits, axis=-1)
            return -jnp.sum(jnp.take_along_axis(lp, labels[..., None], axis=-1)[..., 0] * weights)

        f = jax.jit(loss)
        g_params, g_hidden = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, hidden)
        rng = np.random.default_rng(4)
        eps = 1e-6

        def check(get, put, grad, what):
            x = np.asarray(get())
            for idx in (tuple(int(rng.integers(d)) for d in x.shape) for _ in range(6)):
                plus, minus = x.copy(), x.copy()
                plus[idx] += eps
                minus[idx] -= eps
                fd = (float(f(*put(plus))) - float(f(*put(minus)))) / (2 * eps)
                np.testing.assert_allclose(float(np.asarray(grad)[idx]), fd, rtol=1e-6, atol=1e-8,
                                           err_msg=f"{head}: d loss / d {what}{list(idx)}")

        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        for path, _ in leaves:
            keys = [k.key for k in path]

            def get(keys=keys):
                node = params
                for k in keys:
                    node = node[k]
                return node

            def put(value, keys=keys):
                new = jax.tree.map(lambda x: x, params)
                node = new
                for k in keys[:-1]:
                    node = node[k]
                node[keys[-1]] = jnp.asarray(value)
                return new, hidden

            grad = g_params
            for k in keys:
                grad = grad[k]
            check(get, put, grad, ".".join(keys))
        if head == "vanilla":
            assert float(jnp.abs(g_hidden).max()) == 0.0
        else:
            check(lambda: hidden, lambda value: (params, jnp.asarray(value)), g_hidden, "hidden")
