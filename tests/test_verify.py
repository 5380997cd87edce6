"""verify_and_accept: losslessness (chi-square against the backbone's exact distribution), the power
of that test against two known bugs, greedy exactness, batch invariance, and the mechanics.

The statistical tests run a small Markov-chain "backbone" and a different Markov-chain "draft" over a
vocabulary of 8 tokens, through complete speculative rounds: the draft samples its tokens one after
the other with `sample(..., Stream.DRAFT)` (token k from the draft chain's row of token k-1), the
backbone's logits for row j are its chain's row of the j-th context token, `verify_and_accept` keeps a
prefix, and the last emitted token is the next round's anchor. Two rounds always emit at least two
tokens; the first token, and the first two tokens jointly (which crosses a round boundary whenever the
first round emits one token), must follow the backbone chain with the request's temperature / top-k /
top-p applied. All requests (every configuration and verify length,
plus greedy rows) run as one batch in one jitted call with distinct seeds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import reference_probs
from scipy import stats

from dspark_jax.sampling import SamplingParams, Stream, draft_stream, sample
from dspark_jax.verify import _verify_and_accept, verify_and_accept



# ----------------------------------------------------------------------------------------------------
# the chains and the configurations

VOCAB = 8
K = 3  # block size; every verify length 0..K is tested
ROUNDS = 2  # each round emits >= 1 token, so two rounds give the two tokens the joint test needs
N_JOINT = 2
CONFIGS = [  # (temperature, top_k, top_p); each filter removes tokens somewhere in each chain
    (0.5, 4, 0.85),
    (1.0, 6, 0.8),
    (1.7, 6, 0.85),
]
ANCHORS = [0, 3, 5]  # one anchor per configuration

# Samples per (configuration, verify length) group. Power calculation: a "1% bias" moves 0.01 of
# probability from one outcome to another. For a chi-square test with expected cell probabilities e,
# moving delta from cell a to cell b gives noncentrality lambda = N * delta^2 * (1/e_a + 1/e_b), smallest
# when a, b are the two likeliest cells. There are 2 tests per group (first token, joint of two) and
# 12 groups; at a family-wise level of 1% each test uses alpha = 0.01 / 24 = 4.2e-4. The binding cases
# are the T = 0.5 configuration's: first token e = (0.57, 0.28, 0.15), lambda = 52000 * 1e-4 *
# (1/0.57 + 1/0.28) = 27.8 where power 0.9 at df 2 needs 26.2 (power 0.92); its joint of two has
# e_a, e_b = 0.41, 0.25 at df 6, lambda = 33.5 vs 33.2 needed (power 0.90). The other configurations
# have power >= 0.97. `_power_of_1pct_shift` recomputes this for every test that runs and the test
# asserts power >= 0.9, so lowering N_PER_GROUP or changing the chains cannot silently weaken it.
N_PER_GROUP = 52_000
TESTS_PER_RUN = 2 * len(CONFIGS) * (K + 1)
ALPHA = 0.01 / TESTS_PER_RUN
N_GREEDY = 64  # greedy rows mixed into the same batch


def _chains():
    rng = np.random.default_rng(0)
    backbone = rng.standard_normal((VOCAB, VOCAB)).astype(np.float32)
    draft = (backbone + rng.standard_normal((VOCAB, VOCAB))).astype(np.float32)
    return backbone, draft


def _transition(chain, config):
    return np.stack([reference_probs(chain[i], *config) for i in range(VOCAB)])


def test_chains_exercise_both_filters_and_have_no_boundary_ties():
    """The statistical tests are only meaningful if top-k and top-p both remove tokens somewhere and if
    no top-p cut lies within float32 rounding of p (where float32 and float64 could disagree)."""
    backbone, draft = _chains()
    for t, k, p in CONFIGS:
        for chain in (backbone, draft):
            both = _transition(chain, (t, k, p))
            only_k = _transition(chain, (t, k, 1.0))
            only_p = _transition(chain, (t, 0, p))
            assert np.any((only_p > 0) & (both == 0)), "top-k never binds"
            assert np.any((only_k > 0) & (both == 0)), "top-p never binds"
            for row in chain:
                z = np.sort(row.astype(np.float64) / t)[::-1]
                assert np.all(np.diff(z) < -1e-4)  # no ties at a top-k boundary
                pr = np.exp(z[:k] - z[0])
                pr /= pr.sum()
                assert np.min(np.abs(np.cumsum(pr) - p)) > 1e-3


# ----------------------------------------------------------------------------------------------------
# speculative generation with the chains


@functools.partial(jax.jit, static_argnames=("rounds",))
def _generate(backbone, draft_chain, anchors, seeds, start, num_verify, params, draft_params,
              resample_stream, *, rounds):
    """Run `rounds` speculative rounds per request. Returns every emitted token i32[N, rounds*(K+1)]
    (-1 padded), how many were emitted, and the first round's VerifyResult."""
    n = anchors.shape[0]
    width = rounds * (K + 1)
    cols = jnp.arange(width)
    out = jnp.full((n, width), -1, jnp.int32)
    count = jnp.zeros((n,), jnp.int32)
    anchor, pos = anchors, start
    first = None
    for _ in range(rounds):
        prev, tokens, logits = anchor, [], []
        for k in range(1, K + 1):
            lg = draft_chain[prev]  # Markov: draft k conditions on draft k-1 (the anchor for k = 1)
            prev = sample(lg, draft_params, seeds, pos + k - 1, draft_stream(draft_params))
            tokens.append(prev)
            logits.append(lg)
        draft_tokens = jnp.stack(tokens, axis=1)
        context = jnp.concatenate([anchor[:, None], draft_tokens], axis=1)  # [N, K+1]
        res = _verify_and_accept(backbone[context], draft_tokens, jnp.stack(logits, axis=1), num_verify,
                                 params, seeds, pos, resample_stream=resample_stream)
        first = res if first is None else first
        for j in range(K + 1):
            hit = (cols == (count + j)[:, None]) & (j < res.num_emitted)[:, None]
            out = jnp.where(hit, res.tokens[:, j:j + 1], out)
        anchor = res.tokens[jnp.arange(n), res.num_emitted - 1]
        count = count + res.num_emitted
        pos = pos + res.num_emitted
    return out, count, first


def _batch():
    """All groups and the greedy rows in one batch. Returns the inputs and row bookkeeping."""
    groups = [(c, l) for c in range(len(CONFIGS)) for l in range(K + 1)]
    cfg = np.repeat([c for c, _ in groups], N_PER_GROUP)
    length = np.repeat([l for _, l in groups], N_PER_GROUP)
    # greedy rows: every verify length, anchors cycling through the vocabulary
    g_len = np.arange(N_GREEDY) % (K + 1)
    g_anchor = np.arange(N_GREEDY) % VOCAB
    temps = np.concatenate([np.array([CONFIGS[c][0] for c in cfg]), np.zeros(N_GREEDY)])
    top_k = np.concatenate([np.array([CONFIGS[c][1] for c in cfg]), np.zeros(N_GREEDY)])
    top_p = np.concatenate([np.array([CONFIGS[c][2] for c in cfg]), np.ones(N_GREEDY)])
    total = len(cfg) + N_GREEDY
    anchors = np.concatenate([np.array(ANCHORS)[cfg], g_anchor]).astype(np.int32)
    num_verify = np.concatenate([length, g_len]).astype(np.int32)
    rng = np.random.default_rng(1)
    seeds = (np.arange(total, dtype=np.uint32) * np.uint32(2654435761) + np.uint32(12345))  # distinct
    start = rng.integers(0, 10_000, total).astype(np.int32)
    params = SamplingParams.make(total, temps, top_k, top_p)
    return groups, cfg, length, total, anchors, num_verify, seeds, start, params


def _run(variant: str):
    backbone, draft = _chains()
    groups, cfg, length, total, anchors, num_verify, seeds, start, params = _batch()
    draft_params = params
    stream = Stream.RESAMPLE
    if variant == "correction_uses_draft_noise":
        stream = Stream.DRAFT  # the public-engine bug: the correction reuses the draft's Gumbel noise
    elif variant == "draft_without_top_p":
        # the draft samples without the nucleus filter the verifier assumes it applied
        draft_params = params._replace(top_p=jnp.ones_like(params.top_p))
    elif variant == "invariant":  # every row, greedy ones included, under the drafter-invariant coupling
        params = draft_params = params._replace(invariant=jnp.ones_like(params.invariant))
    else:
        assert variant == "correct"
    out, count, first = _generate(jnp.asarray(backbone), jnp.asarray(draft), jnp.asarray(anchors),
                                  jnp.asarray(seeds), jnp.asarray(start), jnp.asarray(num_verify), params,
                                  draft_params, jnp.asarray(int(stream), jnp.int32), rounds=ROUNDS)
    bookkeeping = (backbone, draft, groups, cfg, length, anchors)
    if variant == "invariant":
        bookkeeping += (plain_decoding(jnp.asarray(backbone), jnp.asarray(anchors), jnp.asarray(seeds),
                                       jnp.asarray(start), params, ROUNDS * (K + 1)),)
    return np.asarray(out), np.asarray(count), jax.tree.map(np.asarray, first), bookkeeping


@functools.partial(jax.jit, static_argnames=("n",))
def plain_decoding(backbone, anchors, seeds, start, params, n):
    """n tokens per request by plain sampling: the token at position start + i is drawn from the chain's
    row of the previous token with the key (seed, start + i, RESAMPLE), as the engine's plain step does."""
    out, prev = [], anchors
    for i in range(n):
        prev = sample(backbone[prev], params, seeds, start + i, Stream.RESAMPLE)
        out.append(prev)
    return jnp.stack(out, axis=1)


def _chi2(counts, probs):
    """p-value of observed counts against expected probabilities; outcomes of probability 0 must never
    occur. Cells with expected count < 5 are pooled (the chi-square approximation needs it).
    Returns (p_value, pooled_probs) with the pooled cells' probabilities for the power calculation."""
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    n = counts.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0, probs[probs > 0]
    counts, probs = counts[probs > 0], probs[probs > 0]
    small = probs * n < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        probs = np.append(probs[~small], probs[small].sum())
        if probs[-1] * n < 5 and len(probs) > 1:  # the pool itself too small: merge it into the smallest
            i = np.argmin(probs[:-1])
            counts[i] += counts[-1]
            probs[i] += probs[-1]
            counts, probs = counts[:-1], probs[:-1]
    if len(probs) == 1:
        return 1.0, probs
    return float(stats.chisquare(counts, probs / probs.sum() * n).pvalue), probs


def _power_of_1pct_shift(n, probs, alpha):
    """Power of the chi-square test at level alpha against moving 0.01 of probability between the two
    likeliest cells (the hardest such shift to detect)."""
    if len(probs) < 2:
        return 1.0
    a, b = np.sort(probs)[::-1][:2]
    lam = n * 0.01**2 * (1 / a + 1 / b)
    df = len(probs) - 1
    return float(stats.ncx2.sf(stats.chi2.isf(alpha, df), df, lam))


def _expected(backbone, config, anchor):
    trans = _transition(backbone, config)
    first = trans[anchor]
    joint = first
    for _ in range(N_JOINT - 1):  # P(y1..yn) = P(y1..y(n-1)) P(yn | y(n-1))
        joint = joint[..., None] * trans.reshape((1,) * (joint.ndim - 1) + trans.shape)
    return first, joint


def _lossless_pvalues(out, bookkeeping, *, check_power=False):
    backbone, _, groups, cfg, length, _ = bookkeeping
    sampled = out[: len(cfg), :N_JOINT]  # two rounds emit at least N_JOINT tokens
    pvalues = {}
    for c, l in groups:
        rows = sampled[(cfg == c) & (length == l)]
        first_p, joint_p = _expected(backbone, CONFIGS[c], ANCHORS[c])
        assert np.all(rows >= 0)
        first_counts = np.bincount(rows[:, 0], minlength=VOCAB)
        joint_counts = np.bincount(np.ravel_multi_index(rows.T, (VOCAB,) * N_JOINT), minlength=VOCAB**N_JOINT)
        for name, counts, probs in (("first", first_counts, first_p), ("joint", joint_counts, joint_p)):
            pv, pooled = _chi2(counts, probs)
            if check_power:
                power = _power_of_1pct_shift(len(rows), pooled, ALPHA)
                assert power >= 0.9, f"power {power:.3f} for {name} of config {CONFIGS[c]}, l={l}"
            pvalues[(CONFIGS[c], l, name)] = pv
    return pvalues


@pytest.fixture(scope="module")
def correct_run():
    return _run("correct")


def test_emitted_tokens_follow_the_backbone_distribution(correct_run):
    out, _, _, bookkeeping = correct_run
    pvalues = _lossless_pvalues(out, bookkeeping, check_power=True)
    failed = {key: pv for key, pv in pvalues.items() if pv < ALPHA}
    assert not failed, f"chi-square rejects (alpha={ALPHA:.1e}): {failed}"


@pytest.fixture(scope="module")
def invariant_run():
    return _run("invariant")


def test_invariant_rows_follow_the_backbone_distribution(invariant_run):
    out, _, _, bookkeeping = invariant_run
    pvalues = _lossless_pvalues(out, bookkeeping[:6], check_power=True)
    failed = {key: pv for key, pv in pvalues.items() if pv < ALPHA}
    assert not failed, f"chi-square rejects (alpha={ALPHA:.1e}): {failed}"


def test_invariant_rows_emit_exactly_the_plain_decoding_tokens(invariant_run):
    """Every token of every row (each verify length, each filter setting, greedy rows) over both rounds is
    the token plain sampling with the same seed draws at that position: what was drafted and how much of
    it was verified changed nothing."""
    out, count, _, bookkeeping = invariant_run
    plain = np.asarray(bookkeeping[6])
    cols = np.arange(out.shape[1])
    emitted = cols[None, :] < count[:, None]
    np.testing.assert_array_equal(np.where(emitted, out, -1), np.where(emitted, plain, -1))


def test_invariant_acceptance_is_below_the_optimal_but_not_far(correct_run, invariant_run):
    """The invariant rule accepts no more than the optimal one (1 - TV is the most any coupling gets)
    and, with the draft sharing the target's noise, most of it: (1 - TV) / (1 + TV) is its floor."""
    cfg, length = correct_run[3][3], correct_run[3][4]
    full = length == K
    opt = correct_run[2].num_accepted[: len(cfg)][full].mean()
    inv = invariant_run[2].num_accepted[: len(cfg)][full].mean()
    assert 0.5 * opt < inv <= opt * 1.02, (inv, opt)


@pytest.mark.parametrize("run", ["correct_run", "invariant_run"])
def test_rounds_really_reject_and_correct(run, request):
    """Guard against a vacuous pass: the batch must contain rejections with corrections, full
    acceptances with bonus tokens, at every positive verify length."""
    _, _, first, (_, _, _, cfg, length, *_) = request.getfixturevalue(run)
    acc = first.num_accepted[: len(cfg)]
    for l in range(1, K + 1):
        at_l = acc[length == l]
        assert 0.1 < np.mean(at_l == l) < 0.9  # both full acceptance and rejection are common
        assert np.all(at_l <= l)
    assert np.all(acc[length == 0] == 0)
    np.testing.assert_array_equal(first.num_emitted, first.num_accepted + 1)


@pytest.mark.parametrize("variant", ["correction_uses_draft_noise", "draft_without_top_p"])
def test_the_chi_square_test_catches_known_bugs(variant):
    out, _, _, bookkeeping = _run(variant)
    pvalues = _lossless_pvalues(out, bookkeeping)
    failed = [key for key, pv in pvalues.items() if pv < ALPHA]
    assert failed, f"the {variant} bug went undetected"
    # With nothing verified (l = 0) neither bug can act: those groups must still pass, which shows the
    # test points at the cause rather than rejecting everything.
    assert all(l > 0 for _, l, _ in failed), failed


def test_greedy_rows_emit_the_backbone_argmax_chain(correct_run):
    """The greedy rows of the same batch: every token they emitted over both rounds (2 to 8 of them)."""
    out, count, _, (backbone, _, _, cfg, _, anchors) = correct_run
    greedy = slice(len(cfg), None)
    assert count[greedy].max() > ROUNDS  # some greedy rows accepted drafts
    for row, n, anchor in zip(out[greedy], count[greedy], anchors[greedy]):
        chain, tok = [], anchor
        for _ in range(n):
            tok = int(np.argmax(backbone[tok]))
            chain.append(tok)
        assert row[:n].tolist() == chain
        assert np.all(row[n:] == -1)


# ----------------------------------------------------------------------------------------------------
# greedy and mechanics with hand-made inputs


# Most mechanics tests share one shape so verify_and_accept compiles once for all of them.
R_A, K_A, V_A = 16, 4, 32
_sample = jax.jit(sample)


def _random_inputs(rng, r=R_A, k=K_A, v=V_A, scale=2.0):
    target = (rng.standard_normal((r, k + 1, v)) * scale).astype(np.float32)
    draft = (target[:, :k] + rng.standard_normal((r, k, v)) * 0.7).astype(np.float32)
    return target, draft


def _verify(target, drafts, draft_logits, num_verify, params, seeds=None, positions=None):
    r = target.shape[0]
    seeds = jnp.arange(r, dtype=jnp.uint32) if seeds is None else seeds
    positions = jnp.zeros((r,), jnp.int32) if positions is None else positions
    return verify_and_accept(jnp.asarray(target), jnp.asarray(drafts, jnp.int32), jnp.asarray(draft_logits),
                             jnp.asarray(num_verify, jnp.int32), params, seeds, positions)


def test_greedy_accepts_while_draft_equals_backbone_argmax():
    rng = np.random.default_rng(2)
    target, draft_logits = _random_inputs(rng)
    argmax = target.argmax(-1)  # [R, K+1]
    # drafts that follow the backbone argmax for a random number of steps, then deviate
    match = rng.integers(0, K_A + 1, R_A)
    drafts = argmax[:, :K_A].copy()
    for i in range(R_A):
        if match[i] < K_A:
            drafts[i, match[i]] = (argmax[i, match[i]] + 1 + rng.integers(0, V_A - 1)) % V_A
    num_verify = rng.integers(0, K_A + 1, R_A)
    res = _verify(target, drafts, draft_logits, num_verify, SamplingParams.greedy(R_A),
                  positions=jnp.full((R_A,), 7, jnp.int32))
    expected_acc = np.minimum(match, num_verify)
    np.testing.assert_array_equal(res.num_accepted, expected_acc)
    for i in range(R_A):
        n = expected_acc[i]
        want = drafts[i, :n].tolist() + [int(argmax[i, n])] + [-1] * (K_A - n)
        assert np.asarray(res.tokens[i]).tolist() == want


def test_greedy_correction_when_the_draft_argmax_was_right():
    """Draft token != draft argmax == backbone argmax: p - q has no mass, so the correction must fall
    back to p (the backbone argmax), not to whatever argmax an empty residual gives (index 0)."""
    rng = np.random.default_rng(8)
    target, draft_logits = _random_inputs(rng)
    best = 1 + np.arange(R_A) % (V_A - 1)  # never token 0
    reject_at = np.arange(R_A) % K_A
    drafts = np.zeros((R_A, K_A), np.int64)
    for i in range(R_A):
        target[i, :, best[i]] = draft_logits[i, :, best[i]] = 50.0  # both argmaxes are best[i]
        drafts[i] = best[i]
        drafts[i, reject_at[i]] = (best[i] + 1) % V_A  # the draft proposes something else there
    res = _verify(target, drafts, draft_logits, np.full(R_A, K_A), SamplingParams.greedy(R_A))
    np.testing.assert_array_equal(res.num_accepted, reject_at)
    np.testing.assert_array_equal(np.asarray(res.tokens)[np.arange(R_A), reject_at], best)


def test_equal_distributions_accept_everything():
    rng = np.random.default_rng(3)
    target, _ = _random_inputs(rng)
    params = SamplingParams.make(R_A, temperature=np.linspace(0.3, 2.0, R_A), top_k=np.arange(R_A) % 3 * 5,
                                 top_p=np.where(np.arange(R_A) % 2, 0.8, 1.0))
    draft_logits = target[:, :K_A]
    seeds = jnp.arange(R_A, dtype=jnp.uint32)
    drafts = jnp.stack([_sample(jnp.asarray(draft_logits[:, i]), params, seeds, jnp.full((R_A,), i, jnp.int32),
                                Stream.DRAFT) for i in range(K_A)], 1)
    num_verify = np.arange(R_A) % (K_A + 1)
    res = _verify(target, drafts, draft_logits, num_verify, params, seeds)
    np.testing.assert_array_equal(res.num_accepted, num_verify)  # p/q == 1 exactly and u < 1


def test_drafts_beyond_num_verify_are_ignored_and_output_layout():
    rng = np.random.default_rng(4)
    target, draft_logits = _random_inputs(rng)
    drafts = rng.integers(0, V_A, (R_A, K_A))
    num_verify = np.arange(R_A) % (K_A + 1)
    params = SamplingParams.make(R_A, temperature=1.0, top_p=0.95)
    seeds, pos = jnp.arange(R_A, dtype=jnp.uint32) + 100, jnp.arange(R_A, dtype=jnp.int32) * 3
    res = _verify(target, drafts, draft_logits, num_verify, params, seeds, pos)
    garbage_tokens, garbage_logits = drafts.copy(), draft_logits.copy()
    for i in range(R_A):
        garbage_tokens[i, num_verify[i]:] = -1
        garbage_logits[i, num_verify[i]:] = np.nan
    res2 = _verify(target, garbage_tokens, garbage_logits, num_verify, params, seeds, pos)
    for a, b in zip(res, res2):
        np.testing.assert_array_equal(a, b)
    tokens = np.asarray(res.tokens)
    assert 0 < np.sum(res.num_accepted) and np.any(np.asarray(res.num_accepted) < num_verify)
    for i in range(R_A):
        n = int(res.num_accepted[i])
        assert 0 <= n <= num_verify[i]
        assert tokens[i, :n].tolist() == drafts[i, :n].tolist()
        assert 0 <= tokens[i, n] < V_A
        assert np.all(tokens[i, n + 1:] == -1)
    np.testing.assert_array_equal(res.num_emitted, np.asarray(res.num_accepted) + 1)
    # the public function is the private one with the RESAMPLE stream (which the statistical tests run)
    private = jax.jit(_verify_and_accept, static_argnames="resample_stream")(
        jnp.asarray(target), jnp.asarray(drafts, jnp.int32), jnp.asarray(draft_logits), jnp.asarray(num_verify, jnp.int32),
        params, seeds, pos, resample_stream=Stream.RESAMPLE)
    for a, b in zip(res, private):
        np.testing.assert_array_equal(a, b)


def test_tiny_residual_falls_back_to_p():
    """q equals p except for ~1e-7 of mass on a token p all but excludes; drafting that token forces a
    rejection whose residual max(0, p - q) is ~1e-7 of mass, mostly float32 rounding noise. The
    correction must then follow p (chi-square), not the noise."""
    v, n = 6, 20_000
    base = np.array([1.0, 0.5, 0.0, -0.5, -1.0, -30.0], np.float32)
    draft_row = base.copy()
    draft_row[5] = np.log(1e-7 * np.exp(base[:5]).sum())  # q(5) ~ 1e-7, p(5) ~ 1e-13
    res = _verify(np.broadcast_to(base, (n, 2, v)), np.full((n, 1), 5), np.broadcast_to(draft_row, (n, 1, v)),
                  np.ones(n), SamplingParams.make(n, temperature=1.0))
    assert np.all(np.asarray(res.num_accepted) == 0)
    expected = reference_probs(base, 1.0, 0, 1.0)
    expected[5] = 0.0  # ~1e-13: never drawn in 20000 samples
    pv, _ = _chi2(np.bincount(np.asarray(res.tokens[:, 0]), minlength=v), expected)
    assert pv > 1e-3


def test_block_size_zero_is_plain_sampling():
    target = np.random.default_rng(5).standard_normal((3, 1, 12)).astype(np.float32)
    res = _verify(target, np.zeros((3, 0)), np.zeros((3, 0, 12), np.float32), np.zeros(3), SamplingParams.greedy(3))
    np.testing.assert_array_equal(res.tokens[:, 0], np.argmax(target[:, 0], -1))
    np.testing.assert_array_equal(res.num_emitted, [1, 1, 1])


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="draft_logits"):
        _verify(np.zeros((2, 3, 5), np.float32), np.zeros((2, 2)), np.zeros((2, 3, 5), np.float32), np.zeros(2),
                SamplingParams.greedy(2))


# ----------------------------------------------------------------------------------------------------
# batch invariance


def test_output_depends_only_on_the_request_itself():
    """The same request alone, in a permuted batch, and beside padding rows that force the full-sort
    fallback of process_logits (V = 1500 > 1024 candidates, a 0.999 nucleus of a flat row)."""
    rng = np.random.default_rng(6)
    r, k, v = 8, 4, 1500
    target, draft_logits = _random_inputs(rng, r, k, v, scale=3.0)
    params = SamplingParams.make(r, temperature=[0.0, 1.0, 0.7, 1.3, 1.0, 0.0, 2.0, 1.0],
                                 top_k=[0, 0, 20, 0, 50, 3, 0, 1], top_p=[1.0, 0.9, 1.0, 0.8, 0.95, 1.0, 1.0, 0.5])
    seeds = rng.integers(0, 2**32, r, dtype=np.uint64).astype(np.uint32)
    pos = rng.integers(0, 5000, r).astype(np.int32)
    drafts = np.stack([_sample(draft_logits[:, i], params, seeds, pos + i, Stream.DRAFT) for i in range(k)], 1)
    num_verify = (np.arange(r) % (k + 1)).astype(np.int32)
    # numpy inputs: slicing and concatenating them eagerly in jax would compile every op
    inputs = (target, drafts, draft_logits, num_verify, jax.tree.map(np.asarray, params), seeds, pos)
    ref = jax.tree.map(np.asarray, verify_and_accept(*inputs))
    assert ref.num_accepted.sum() > 0 and np.any(ref.num_accepted < num_verify)

    def take(idx):
        return jax.tree.map(lambda x: x[np.asarray(idx)], inputs)

    for i in range(r):  # alone
        for a, b in zip(verify_and_accept(*take([i])), ref):
            np.testing.assert_array_equal(a[0], b[i])
    perm = rng.permutation(r)
    for a, b in zip(verify_and_accept(*take(perm)), ref):
        np.testing.assert_array_equal(a, b[perm])
    # rows 0..3 beside 4 padding rows (flat logits, 0.999 nucleus, garbage drafts), same batch size
    keep, pad = 4, r - 4
    flat = np.zeros((pad, k + 1, v), np.float32)
    pad_rows = (flat, np.full((pad, k), -1, np.int32), flat[:, :k], np.full((pad,), k, np.int32),
                jax.tree.map(np.asarray, SamplingParams.make(pad, top_p=0.999)), np.zeros((pad,), np.uint32),
                np.zeros((pad,), np.int32))
    padded = jax.tree.map(lambda x, y: np.concatenate([x, y]), take(range(keep)), pad_rows)
    for a, b in zip(verify_and_accept(*padded), ref):
        np.testing.assert_array_equal(np.asarray(a)[:keep], b[:keep])
