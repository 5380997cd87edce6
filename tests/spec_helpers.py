"""Helpers shared by the end-to-end exactness tests of both draft families (test_spec_round, test_deepspec):
an oracle draft, random prompts, and plain greedy decoding through the shared round's `plain_step`."""

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import draft, sampling
from dspark_jax import spec_round as sr


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
    return draft.DraftOutput(tokens, jax.nn.one_hot(tokens, v) * 30.0, jnp.zeros((b, k)), jnp.zeros((b, k, 0)),
                             jnp.zeros((b, k, model.cfg.dim)))


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
    sp, seeds, active = sampling.SamplingParams.greedy(b), jnp.arange(b, dtype=jnp.uint32), jnp.ones(b, bool)

    @jax.jit
    def run(weights):
        st, first = sr.start(model, weights, sr.init_state(model, b, maxlen), prompt, plen, active, sp, seeds)
        _, toks = jax.lax.scan(lambda st, _: sr.plain_step(model, weights, st, sp, seeds, active), st, None,
                               length=steps)
        return jnp.concatenate([first[:, None], toks.T], axis=1)

    return np.asarray(run(weights))
