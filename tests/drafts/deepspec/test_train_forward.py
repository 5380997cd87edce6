"""The DeepSpec draft's teacher-forced training forward (dspark_jax.drafts.deepspec.train_forward): each
block sees all context strictly before its anchor (= the inference draft), and the pure-parallel, no-confidence
and one-token variants go through the training loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.deepspec import CFG, K, our_params, random_hf_weights

from dspark_jax import drafts, sampling
from dspark_jax.drafts.deepspec.heads import confidence_logits
from dspark_jax.drafts.deepspec.model import draft_hidden
from dspark_jax.drafts.deepspec.train_forward import train_forward


def test_training_blocks_see_all_context_strictly_before_the_anchor():
    """train_forward = the inference draft after committing positions 0..anchor-1, for anchors far
    beyond any window; context at or after the anchor never matters, position 0 always does."""
    from dspark_jax.train import anchors as A

    params = our_params(random_hf_weights(CFG, seed=6))
    tied = {"embed": jnp.asarray(np.random.default_rng(7).normal(size=(CFG.vocab_size, CFG.dim)), jnp.float32),
            "head": jnp.asarray(np.random.default_rng(8).normal(size=(CFG.vocab_size, CFG.dim)) * 0.1, jnp.float32)}
    rng = np.random.default_rng(9)
    t = 40
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size - 1, size=(1, t)), jnp.int32)
    mh = rng.normal(size=(1, t, CFG.main_hidden_dim))
    anchors = jnp.asarray([[0, 6, 33]], jnp.int32)
    blocks = A.make_blocks(tokens, jnp.ones((1, t), bool), anchors, jnp.ones((1, 3), bool), K, CFG.noise_token_id)
    fwd = jax.jit(lambda m: train_forward(params, tied, CFG, m, blocks, anchors))
    acts = fwd(jnp.asarray(mh, jnp.float32))
    h, normed, emb, conf = acts.hidden, acts.normed, acts.markov_emb, acts.conf_logits
    infer = jax.jit(lambda m, n, a: draft_hidden(
        params, tied, CFG, drafts.prefill(params, CFG, drafts.init_state(CFG, 1, t), m, n), a))
    for i, a in enumerate([0, 6, 33]):
        hi, _ = infer(jnp.asarray(mh, jnp.float32), jnp.asarray([a]), tokens[:, a])
        np.testing.assert_allclose(h[i], hi[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(conf, confidence_logits(params, CFG, normed, emb), rtol=1e-6, atol=1e-6)
    late = mh.copy()
    late[0, 33:] += 5.0  # at/after the last anchor: invisible to every block
    np.testing.assert_array_equal(fwd(jnp.asarray(late, jnp.float32))[0], h)
    early = mh.copy()
    early[0, 0] += 5.0  # position 0: seen by the anchor-33 block (no window)
    assert not np.allclose(fwd(jnp.asarray(early, jnp.float32))[0][2], h[2])


@pytest.mark.parametrize("variant", [dict(markov_rank=0, confidence_head_with_markov=False),
                                     dict(enable_confidence_head=False), dict(block_size=1)])
def test_pure_parallel_no_confidence_and_one_token_variants_trace(variant):
    """markov_rank 0 (DFlash-like), no confidence head and K = 1 go through propose and the training loss."""
    from dspark_jax.train import anchors as A
    from dspark_jax.train import loss as L
    from dspark_jax.train import model as M

    cfg = CFG.replace(**variant)
    params = drafts.abstract_params(cfg)
    assert ("markov" in params) == bool(cfg.markov_rank) and ("confidence" in params) == cfg.enable_confidence_head
    tied = {"embed": jnp.zeros((cfg.vocab_size, cfg.dim)), "head": jnp.zeros((cfg.vocab_size, cfg.dim))}
    out = jax.eval_shape(lambda p: drafts.propose(p, tied, cfg, drafts.init_state(cfg, 2, 16), jnp.zeros(2, jnp.int32),
                                                  sampling.SamplingParams.greedy(2), jnp.zeros(2, jnp.uint32)), params)
    assert out.tokens.shape == (2, cfg.block_size) and out.conf_logits.shape == (2, cfg.block_size)
    blocks = A.make_blocks(jnp.zeros((2, 24), jnp.int32), jnp.ones((2, 24), bool), jnp.asarray([[0, 5], [3, 20]]),
                           jnp.ones((2, 2), bool), cfg.block_size, cfg.noise_token_id)

    def loss(p):
        acts = M.draft_forward(p, tied, cfg, jnp.zeros((2, 24, cfg.main_hidden_dim)), blocks, jnp.asarray([[0, 5], [3, 20]]))
        return L.loss_from_sums(M.block_loss_sums(p, tied, cfg, acts, jnp.zeros((2, 24, cfg.vocab_size)), blocks,
                                                  vocab_chunk=128))[0]

    value, grads = jax.eval_shape(jax.value_and_grad(loss), params)
    assert value.shape == () and jax.tree.structure(grads) == jax.tree.structure(params)
