"""The training forward and its loss (dspark_jax.train.model): teacher-forced blocks equal the inference
draft at each anchor, the attention pattern of a block, the fused block loss, the variants without a Markov
head or with one token, and the straight-through fp8 gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CONFIGS

from dspark_jax import drafts
from dspark_jax.drafts.v41.config import DSparkConfig
from dspark_jax.drafts.v41.heads import confidence_logits
from dspark_jax.drafts.v41.model import DSparkDraft, draft_hidden
from dspark_jax.nn.norm import rms_norm
from dspark_jax.train import anchors as A
from dspark_jax.train import loss as L
from dspark_jax.train import model as M


TCFG = DSparkConfig.from_json(CONFIGS / "tiny_v41.json").replace(hc_sinkhorn_iters=3, param_dtype="float32")


@functools.lru_cache(maxsize=None)
def draft_setup():
    params = drafts.init_params(TCFG, jax.random.key(0))
    k = jax.random.split(jax.random.key(1), 2)
    v, d = TCFG.vocab_size, TCFG.dim
    tied = {"embed": jax.random.normal(k[0], (v, d)), "head": jax.random.normal(k[1], (v, d)) * d ** -0.5}
    return params, tied


@functools.lru_cache(maxsize=None)
def _forward_jit():
    return jax.jit(lambda p, tied, mh, blocks, anchors: M.draft_forward(p, tied, TCFG, mh, blocks, anchors))


def _pattern_inputs():
    rng = np.random.default_rng(3)
    b, t = 2, 40
    tokens = rng.integers(0, TCFG.vocab_size - 1, size=(b, t)).astype(np.int32)
    mh = rng.normal(size=(b, t, TCFG.main_hidden_dim)).astype(np.float32)
    anchors = np.array([[0, 7, 16, 30], [15, 17, 33, 38]], np.int32)  # empty ring, partial, full, wrapped
    valid = np.ones_like(anchors, bool)
    blocks = A.make_blocks(jnp.asarray(tokens), jnp.ones((b, t), bool), jnp.asarray(anchors), jnp.asarray(valid),
                           TCFG.block_size, TCFG.noise_token_id)
    return tokens, mh, anchors, blocks


def test_training_blocks_equal_inference_draft_at_each_anchor():
    """The per-anchor ring + body of training = prefill of positions < anchor + draft_hidden at inference.

    kv_fp8 off: training computes the context rows for the [2, 40] batch and the bodies for 8 blocks at
    once, inference for one [1, 40] row and one block, and XLA:CPU gives those shapes different last bits
    (the two hidden states differ by up to a few 1e-6). With the fp8 KV rounding on, such a difference
    moves a ring or draft-row value that sits near a rounding midpoint by one fp8 step, which moves the
    draft's outputs by 1e-4 to 7e-3 (measured for single one-step changes), far beyond this tolerance.
    Both sides call the same `context_rows` (rounding included) and body, so the rounding adds nothing to
    what this test checks (ring construction, positions, masks); a wrong ring slot, position or visible
    set changes h by O(1) and still fails."""
    cfg = TCFG.replace(kv_fp8=False)
    params, tied = draft_setup()
    tokens, mh, anchors, blocks = _pattern_inputs()
    acts = jax.jit(lambda p, mh, blocks, anchors: M.draft_forward(p, tied, cfg, mh, blocks, anchors))(
        params, jnp.asarray(mh), blocks, jnp.asarray(anchors))
    n_per = anchors.shape[1]

    @jax.jit
    def inference(mh_row, a, anchor_tok):
        st = drafts.prefill(params, cfg, drafts.init_state(cfg, 1), mh_row, a, impl="xla")
        h, base = draft_hidden(params, tied, cfg, st, anchor_tok, impl="xla")
        return h, base

    for bi in range(2):
        for n in range(n_per):
            a = int(anchors[bi, n])
            h, base = inference(jnp.asarray(mh[bi:bi + 1]), jnp.asarray([a]), jnp.asarray(tokens[bi, a:a + 1]))
            np.testing.assert_allclose(acts.hidden[bi * n_per + n], h[0], rtol=1e-5, atol=1e-5)
            u = M.draft_logits(params, tied, cfg, acts._replace(markov_latent=None))[bi * n_per + n]
            np.testing.assert_allclose(u, base[0], rtol=1e-5, atol=1e-5)
    # Teacher-forced Markov inputs and the confidence head.
    emb = np.asarray(params["markov"]["embed"])[np.asarray(blocks.prev).reshape(-1, cfg.block_size)]
    np.testing.assert_array_equal(acts.markov_emb, emb)
    np.testing.assert_allclose(acts.conf_logits, confidence_logits(params, cfg, acts.hidden, emb), rtol=1e-6)


def test_block_sees_only_its_window_of_earlier_context_and_its_own_slots():
    params, tied = draft_setup()
    tokens, mh, anchors, blocks = _pattern_inputs()
    n_per, w = anchors.shape[1], TCFG.window
    fwd = lambda mh, blocks: np.asarray(_forward_jit()(params, tied, jnp.asarray(mh), blocks,  # noqa: E731
                                                       jnp.asarray(anchors)).hidden)
    base = fwd(mh, blocks)
    rng = np.random.default_rng(4)

    def perturbed(positions, row=0):
        out = mh.copy()
        out[row, positions] += rng.normal(size=out[row, positions].shape).astype(np.float32) * 3
        return out

    changed = lambda got, m: float(np.abs(got[m] - base[m]).max())  # noqa: E731
    # Row 0 anchors: 0, 7, 16, 30 (blocks 0..3). Block 3 (anchor 30) has the window 14..29.
    # 1) a block's own anchor position and everything after: invisible to it, visible to later blocks
    got = fwd(perturbed(slice(16, None)), blocks)
    assert changed(got, 2) == 0 and changed(got, 1) == 0 and changed(got, 0) == 0
    assert changed(got, 3) > 1e-3
    got = fwd(perturbed(slice(30, None)), blocks)
    assert changed(got, 3) == 0
    # 2) positions before the window (0..13): invisible to block 3, visible to block 1 (anchor 7)
    got = fwd(perturbed(slice(0, 30 - w)), blocks)
    assert changed(got, 3) == 0 and changed(got, 1) > 1e-3
    # 3) any single position of the window: visible
    for p in (30 - w, 22, 29):
        assert changed(fwd(perturbed([p]), blocks), 3) > 1e-3, p
    # 4) the other sequence's context and every other block's inputs: invisible
    got = fwd(perturbed(slice(None), row=1), blocks)
    assert all(changed(got, m) == 0 for m in range(n_per))
    others = blocks._replace(inputs=blocks.inputs.at[0, :3].set(7).at[1].set(11))
    got = fwd(mh, others)
    assert changed(got, 3) == 0 and changed(got, 0) > 0
    # 5) its own later slots: visible to its first slot (the block is bidirectional)
    mine = fwd(mh, blocks._replace(inputs=blocks.inputs.at[0, 3, -1].set(7)))
    assert np.abs(mine[3, 0] - base[3, 0]).max() > 1e-4


def test_fused_block_loss_equals_reference_path_with_gradients():
    """The trainer's fused path (teacher rows b*T + pos, label logits from x . head[label] +
    W1[prev] . W2[label]) against materialised logits and gathered teachers, value and gradient."""
    params, tied = draft_setup()
    tokens, _, anchors, blocks = _pattern_inputs()
    rng = np.random.default_rng(6)
    nb, k, d = anchors.size, TCFG.block_size, TCFG.dim
    teacher = jnp.asarray(rng.normal(size=(2, 40, TCFG.vocab_size)) * 2, jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(nb, k, d)), jnp.float32)
    emb = jnp.take(params["markov"]["embed"], blocks.prev.reshape(nb, k), axis=0)
    conf = jnp.asarray(rng.normal(size=(nb, k)), jnp.float32)
    trained = {"norm": params["norm"], "markov": params["markov"]}

    def total(p, hidden, emb, fused, chunk):
        normed = rms_norm(hidden, p["norm"]["scale"], TCFG.norm_eps).astype(jnp.float32)
        acts = M.DraftActs(hidden, normed, emb, emb, conf)  # vanilla: the latent z is W1[prev]
        s = M.block_loss_sums(p, tied, TCFG, acts, teacher, blocks, fused=fused, vocab_chunk=chunk)
        return L.loss_from_sums(s)[0]

    grad = lambda fused, chunk: jax.jit(jax.value_and_grad(  # noqa: E731
        lambda p, h, e: total(p, h, e, fused, chunk), argnums=(0, 1, 2)))(trained, hidden, emb)
    v0, g0 = grad(False, None)
    for chunk in (96, None):
        v1, g1 = grad(True, chunk)
        np.testing.assert_allclose(v1, v0, rtol=1e-5)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    assert float(jnp.abs(g0[0]["markov"]["head"]).max()) > 1e-6 and float(jnp.abs(g0[1]).max()) > 1e-6


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_markov_head_variants_train_through_the_fused_loss(head):
    """The gated and recurrent heads in the training forward: the fused loss (bias = W2 z chunk by chunk)
    equals the materialised reference path in value and in the gradient of every parameter; the head's own
    linear gets a gradient; the confidence head reads the raw W1[prev], the loss the head's z."""
    from helpers.spec import scaled_markov_head

    cfg = TCFG.replace(markov_head_type=head)
    _, tied = draft_setup()
    params = scaled_markov_head(drafts.init_params(cfg, jax.random.key(0)), jax.random.key(3))
    tokens, mh, anchors, blocks = _pattern_inputs()
    teacher = jnp.asarray(np.random.default_rng(6).normal(size=(2, 40, cfg.vocab_size)) * 2, jnp.float32)

    def total(p, fused):
        acts = M.draft_forward(p, tied, cfg, jnp.asarray(mh), blocks, jnp.asarray(anchors))
        return L.loss_from_sums(M.block_loss_sums(p, tied, cfg, acts, teacher, blocks, fused=fused,
                                                  vocab_chunk=96))[0]

    acts = jax.jit(lambda p: M.draft_forward(p, tied, cfg, jnp.asarray(mh), blocks, jnp.asarray(anchors)))(params)
    prev = blocks.prev.reshape(acts.markov_emb.shape[:2])
    np.testing.assert_array_equal(acts.markov_emb, jnp.take(params["markov"]["embed"], prev, axis=0))
    assert float(jnp.abs(acts.markov_latent - acts.markov_emb).max()) > 1e-3  # z is not e for these heads
    v0, g0 = jax.jit(jax.value_and_grad(lambda p: total(p, False)))(params)
    v1, g1 = jax.jit(jax.value_and_grad(lambda p: total(p, True)))(params)
    np.testing.assert_allclose(v1, v0, rtol=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    own = g0["markov"]["gate" if head == "gated" else "joint"]
    assert float(jnp.abs(own["kernel"]).max()) > 1e-6 and float(jnp.abs(own["bias"]).max()) > 1e-6


@pytest.mark.parametrize("variant", [dict(markov_rank=0), dict(block_size=1)])
def test_pure_parallel_and_one_token_drafts_trace(variant):
    """No Markov head (markov_rank 0) and K = 1 go through the same forward, loss and gradient."""
    cfg = TCFG.replace(**variant)
    params = drafts.abstract_params(cfg)
    _, tied = draft_setup()
    tokens, mh, anchors, _ = _pattern_inputs()
    blocks = A.make_blocks(jnp.asarray(tokens), jnp.ones(tokens.shape, bool), jnp.asarray(anchors),
                           jnp.ones(anchors.shape, bool), cfg.block_size, cfg.noise_token_id)
    teacher = jnp.zeros((2, 40, cfg.vocab_size))

    def loss(p):
        acts = M.draft_forward(p, tied, cfg, jnp.asarray(mh), blocks, jnp.asarray(anchors))
        return L.loss_from_sums(M.block_loss_sums(p, tied, cfg, acts, teacher, blocks, vocab_chunk=100))[0]

    value, grads = jax.eval_shape(jax.value_and_grad(loss), params)
    assert value.shape == () and jax.tree.structure(grads) == jax.tree.structure(params)
    assert ("markov" in grads) == bool(cfg.markov_rank)


def test_straight_through_fp8_keeps_values_and_passes_gradients():
    from dspark_jax.nn.quant import fp8_quant_dequant

    x = jax.random.normal(jax.random.key(0), (2, 64))
    st = functools.partial(fp8_quant_dequant, grad="straight_through")
    np.testing.assert_array_equal(st(x), fp8_quant_dequant(x))
    ct = jnp.arange(64.0) * 1e-3
    g_exact = jax.grad(lambda x: jnp.sum(fp8_quant_dequant(x) * ct))(x)
    g_st = jax.grad(lambda x: jnp.sum(st(x) * ct))(x)
    np.testing.assert_allclose(g_st, jnp.broadcast_to(ct, x.shape))
    # The literal derivative rounds the cotangent to fp8: small cotangents vanish (why the trainer uses ST).
    assert float(jnp.abs(g_exact).max()) == 0.0
    with pytest.raises(ValueError, match="fp8 'grad'"):
        fp8_quant_dequant(x, grad="straight")
    # Through the real draft: the context rows' gradient reaches main_proj only with straight-through.
    params, _ = draft_setup()
    mh = jax.random.normal(jax.random.key(1), (1, 6, TCFG.main_hidden_dim))
    pos = jnp.arange(6)[None]

    def rows_grad(fp8_grad):
        f = lambda p: jnp.sum(DSparkDraft(TCFG, "xla", fp8_grad).apply(  # noqa: E731
            {"params": p}, mh, pos, method=DSparkDraft.context_rows) * 1e-3)
        return jax.jit(jax.grad(f))(params)["main_proj"]["kernel"]

    assert float(jnp.abs(rows_grad("exact")).max()) == 0.0
    assert float(jnp.abs(rows_grad("straight_through")).max()) > 1e-6
