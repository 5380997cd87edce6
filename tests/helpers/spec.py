"""Helpers shared by the end-to-end exactness tests of both draft families (test_spec_round.py,
serve/test_engine.py, drafts/deepspec/test_model.py, ...): an oracle draft, random prompts, plain greedy
decoding through the shared round's `plain_step`, the tiny V4.1 draft beside a backbone of each family
(`family`, `plain_greedy`), and a comparison of fp8-rounded arrays computed by two execution paths
(`assert_within_one_fp8_step`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import drafts, sampling
from dspark_jax import spec_round as sr
from dspark_jax.backbones.mhc import MhcBackbone, MhcConfig
from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Config
from dspark_jax.drafts.v41.config import DSparkConfig
from dspark_jax.nn.quant import AMAX_FLOOR, E4M3_MAX

from helpers.paths import CONFIGS


def backbone_greedy_drafts(model, weights, state):
    """The backbone's own greedy continuation of each row's anchor, K tokens: i32[B, K] (on a scratch
    copy of the cache; the round's state is untouched)."""
    bb = model.backbone
    cache, tok, toks = state.cache, state.anchor, []
    for _ in range(model.block_size):
        out = bb.forward(weights.backbone, cache, tok[:, None])
        cache = bb.commit(out.cache, jnp.ones_like(tok))
        tok = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
        toks.append(tok)
    return jnp.stack(toks, axis=1)


def oracle_propose(model, weights, state, params, seeds, filtering):
    """A test draft that proposes the backbone's own greedy continuation with some positions corrupted (a
    deterministic pattern of seed, position and k), so rounds accept every count 0..K."""
    v, k = model.backbone.vocab_size, model.block_size
    tokens = backbone_greedy_drafts(model, weights, state)
    bad = (seeds[:, None].astype(jnp.int32) * 7 + state.draft.length[:, None] * 3 + jnp.arange(k)) % 7 == 0
    tokens = jnp.where(bad, (tokens + 1) % v, tokens)
    b = tokens.shape[0]
    return drafts.DraftOutput(tokens, jax.nn.one_hot(tokens, v) * 30.0, jnp.zeros((b, k)), jnp.zeros((b, k, 0)),
                              jnp.zeros((b, k, model.cfg.dim)))


def oracle_propose_varied(model, weights, state, params, seeds, filtering):
    """`oracle_propose` (the same tokens) whose confidence logits differ per row and per position: a fixed
    table of the row's seed, its draft length (which moves every round) and the position, in -6..6. A
    scheduler (modes "sync" / "async") then admits different verify lengths to different rows and rounds;
    `oracle_propose`'s zero logits give every row and position the same confidence."""
    out = oracle_propose(model, weights, state, params, seeds, filtering)
    k = model.block_size
    cell = (seeds[:, None].astype(jnp.int32) * 5 + state.draft.length[:, None] * 3 + jnp.arange(k) * 4) % 13
    return out._replace(conf_logits=(cell - 6).astype(jnp.float32))


def sampled_oracle_propose(model, weights, state, params, seeds, filtering):
    """Draft token k = the backbone's keyed draw at its position with the row's draft stream (on a scratch copy
    of the cache), draft logits = the backbone's; a deterministic pattern of (seed, position, k) corrupts some
    tokens. Confidence logits vary per row and position (in -6..6) so the schedulers admit varied lengths."""
    bb, k, v = model.backbone, model.block_size, model.backbone.vocab_size
    length = state.draft.length
    stream = sampling.draft_stream(params)
    cache, tok, toks, logits = state.cache, state.anchor, [], []
    for i in range(k):
        out = bb.forward(weights.backbone, cache, tok[:, None])
        cache = bb.commit(out.cache, jnp.ones_like(tok))
        row = out.logits[:, 0].astype(jnp.float32)
        tok = sampling.sample(row, params, seeds, length + 1 + i, stream)
        toks.append(tok)
        logits.append(row)
    tokens = jnp.stack(toks, axis=1)
    bad = (seeds[:, None].astype(jnp.int32) * 7 + length[:, None] * 3 + jnp.arange(k)) % 7 == 0
    tokens = jnp.where(bad, (tokens + 1) % v, tokens)
    cell = (seeds[:, None].astype(jnp.int32) * 5 + length[:, None] * 3 + jnp.arange(k) * 4) % 13
    b = tokens.shape[0]
    return drafts.DraftOutput(tokens, jnp.stack(logits, axis=1), (cell - 6).astype(jnp.float32),
                              jnp.zeros((b, k, 0)), jnp.zeros((b, k, model.cfg.dim)))


def random_prompts(n, seed, vocab=512):
    """n prompts of 1..11 random token ids."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 12))).tolist() for _ in range(n)]


def padded(ps):
    """Prompts -> (right-padded i32[n, max_len], lengths i32[n])."""
    t = max(len(p) for p in ps)
    return jnp.asarray([p + [0] * (t - len(p)) for p in ps], jnp.int32), jnp.asarray([len(p) for p in ps])


def plain_greedy_tokens(model, weights, prompts, steps, maxlen) -> np.ndarray:
    """Plain autoregressive greedy decoding of the backbone, batched: i32[n, steps + 1]."""
    prompt, plen = padded(prompts)
    b = prompt.shape[0]
    return plain_tokens(model, weights, prompt, plen, sampling.SamplingParams.greedy(b),
                        jnp.arange(b, dtype=jnp.uint32), steps, maxlen)


def plain_tokens(model, weights, prompt, plen, sp, seeds, steps, maxlen) -> np.ndarray:
    """Plain autoregressive decoding of the backbone with sampling params `sp` and `seeds` (the shared round's
    `start` and `plain_step`), batched: i32[n, steps + 1]."""
    b = prompt.shape[0]
    active = jnp.ones(b, bool)

    @jax.jit
    def run(weights):
        st, first = sr.start(model, weights, sr.init_state(model, b, maxlen), prompt, plen, active, sp, seeds)
        _, toks = jax.lax.scan(lambda st, _: sr.plain_step(model, weights, st, sp, seeds, active), st, None,
                               length=steps)
        return jnp.concatenate([first[:, None], toks.T], axis=1)

    return np.asarray(run(weights))


def fp8_step(a, b, block: int = 32) -> np.ndarray:
    """An upper bound on one E4M3 step of `fp8_quant_dequant` at each element of a and b, two fp8-rounded
    arrays (blocks of `block` contiguous values of the last axis, each with a power-of-two scale s).

    The values are q * s with q an E4M3 code. For normal codes (|q| >= 2^-6) the grid spacing at |x| is
    2^(floor(log2 |x|) - 3) whatever s is (s is a power of two), and two neighbouring grid points are the
    spacing at the smaller of them apart (so two values on either side of a binade edge, two codes apart,
    fail). Subnormal codes are 2^-9 * s apart. s itself is not stored, but the rounded block maximum amax
    is in [224 s, 448 s] (s is the smallest power of two with amax / s <= 448, and E4M3 rounding keeps 224
    on the grid), so s <= max(the largest power of two <= amax / 224, the floor scale of tiny blocks).
    amax is taken over both arrays, which also covers the two paths picking scales a binade apart."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape and a.shape[-1] % block == 0, (a.shape, b.shape)
    blocks = np.maximum(np.abs(a), np.abs(b)).reshape(*a.shape[:-1], -1, block)
    amax = blocks.max(axis=-1, keepdims=True)
    _, e = np.frexp(amax / (E4M3_MAX / 2))  # the largest power of two <= amax / 224 is 2^(e - 1)
    s = np.maximum(np.where(amax > 0, np.ldexp(1.0, e - 1), 0.0), 2.0 ** np.ceil(np.log2(AMAX_FLOOR / E4M3_MAX)))
    subnormal = np.broadcast_to(s * 2.0 ** -9, blocks.shape).reshape(a.shape)
    m = np.minimum(np.abs(a), np.abs(b))
    _, e = np.frexp(m)  # m = f * 2^e, f in [0.5, 1): floor(log2 m) = e - 1
    normal = np.where(m > 0, np.ldexp(1.0, e - 4), 0.0)
    return np.maximum(normal, subnormal)


def assert_within_one_fp8_step(got, want, *, max_fraction: float = 0.01, block: int = 32, what: str = "values"):
    """got and want went through the same fp8 rounding but were computed by different execution shapes or
    paths (a [B, 5] and a [B, 20] matmul, a sharded and a one-device program): XLA does not promise equal
    last bits across those, and a last-bit difference before the rounding moves a value that sits near a
    rounding midpoint by one fp8 step. So: every element is within one fp8 step (`fp8_step`) of the other,
    and at most `max_fraction` of the elements differ at all. A real bug (a wrong ring slot, position,
    row or missing rounding) moves most values of a row by far more than one step."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    step = fp8_step(got, want, block)
    diff = np.abs(got - want)
    bad = np.argwhere(diff > step)
    assert len(bad) == 0, (f"{len(bad)} of {diff.size} {what} more than one fp8 step apart, e.g. at "
                           + ", ".join(f"{tuple(int(i) for i in ix)}: {got[tuple(ix)]:.6g} vs {want[tuple(ix)]:.6g}"
                                       f" (step {step[tuple(ix)]:.3g})" for ix in bad[:5]))
    n = int((diff > 0).sum())
    assert n <= max_fraction * diff.size, f"{n} of {diff.size} {what} differ (each by at most one fp8 step)"


# ---------------------------------------------------------------------------------------------------
# The tiny V4.1 draft with a backbone of each family (test_spec_round.py, serve/test_engine.py)
# ---------------------------------------------------------------------------------------------------

CFG = DSparkConfig.from_json(CONFIGS / "tiny_v41.json")
K = CFG.block_size


@functools.lru_cache(maxsize=None)
def family(name):
    """A backbone with exact-enough numerics for token-for-token comparisons.

    XLA:CPU does not promise bitwise-equal rows across execution shapes (a [B*T, 256] x [256, 24]
    product rounds differently for T = 2 and T = 6), so a position verified in a 6-token forward and
    decoded in a 1-token forward differ in the last bits. The V4.1 fp8 KV rounding amplifies such a
    difference into a 6% change of one KV element when a value sits near a rounding edge, which flips
    near-tied argmaxes (we saw a 6e-4 logit margin flip). The exactness tests therefore run the mhc
    backbone with kv_fp8 off; the sampled-distribution test keeps it on.
    """
    if name == "mhc":
        bb = MhcBackbone(MhcConfig.from_json(CONFIGS / "tiny_mhc_backbone.json").replace(kv_fp8=False))
    else:
        bb = Qwen3Backbone(Qwen3Config.from_hf_json(CONFIGS / "tiny_qwen3_backbone.json"))
    bp = bb.init_params(jax.random.key(0))
    dp = drafts.init_params(CFG, jax.random.key(1))
    return bb, sr.Weights(bp, dp, bb.tied(bp), jnp.ones(K))


@functools.lru_cache(maxsize=None)
def plain_greedy(name, n_prompts, steps, maxlen):
    """Plain autoregressive greedy decoding of the backbone, batched: i32[n, steps + 1]."""
    bb, weights = family(name)
    return plain_greedy_tokens(sr.SpecModel(bb, CFG, impl="xla"), weights, random_prompts(n_prompts, seed=1), steps,
                               maxlen)


def scaled_markov_head(params, key, scale=1.0):
    """`params` with its gate / joint linear redrawn at fan-in scale (biases too), so that a test of the
    gated / recurrent head sees gates and states far from their N(0, 0.02) init."""
    markov = dict(params["markov"])
    for name in ("gate", "joint"):
        if name in markov:
            k1, k2 = jax.random.split(jax.random.fold_in(key, len(name)))
            kernel, bias = markov[name]["kernel"], markov[name]["bias"]
            markov[name] = {"kernel": (jax.random.normal(k1, kernel.shape) * scale * kernel.shape[0] ** -0.5
                                       ).astype(kernel.dtype),
                            "bias": (jax.random.normal(k2, bias.shape) * 0.5 * scale).astype(bias.dtype)}
    return {**params, "markov": markov}
