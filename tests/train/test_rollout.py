"""Rollouts through the speculative round (dspark_jax.train.rollout): on-policy greedy output, and records
that feed calibration and regenerated training data."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import backbone_greedy_drafts

from dspark_jax import drafts
from dspark_jax.train import data as D


def corrupted_greedy_propose(model, weights, state, params, seeds, filtering):
    """A stand-in draft for the round: the backbone's own greedy continuation with draft k replaced
    by a wrong token at a pseudo-random ~27% of (position, seed) pairs, so rounds accept 0 to K."""
    k, bb = model.block_size, model.backbone
    tokens = backbone_greedy_drafts(model, weights, state)
    pos = state.draft.length[:, None] + jnp.arange(k)
    bad = (pos * 7919 + seeds[:, None].astype(jnp.int32) * 104729) % 11 < 3
    tokens = jnp.where(bad, (tokens + 1) % bb.vocab_size, tokens)
    b = tokens.shape[0]
    conf = jnp.broadcast_to(jnp.linspace(2.0, -2.0, k), (b, k))
    return drafts.DraftOutput(tokens, jax.nn.one_hot(tokens, bb.vocab_size) * 30.0, conf, jnp.zeros((b, k, 0)),
                              jnp.zeros((b, k, model.cfg.dim)))


@pytest.mark.slow
def test_rollout_is_on_policy_and_its_records_feed_calibration(trainer1, tmp_path):
    """Greedy rollouts through the speculative round reproduce the backbone's own greedy decoding
    (lossless verification), and tau / acceptance / records agree with each other. The draft is a
    corrupted copy of the backbone so that acceptance lengths vary (a random draft accepts ~nothing)."""
    from dspark_jax import sampling
    from dspark_jax import spec_round as sr
    from dspark_jax.calibration_cli import read_records
    from dspark_jax.train import rollout as R

    model, weights = trainer1.spec_pair(impl="xla")
    model = dataclasses.replace(model, propose_fn=corrupted_greedy_propose)
    prompts = [[5, 9, 11], [100, 101, 102, 103, 104, 105], [7]]
    cfg = R.RolloutConfig(max_new_tokens=9, temperature=0.0, batch_size=2, num_verify=3)
    res = R.rollout(model, weights, prompts, cfg)
    # plain greedy decoding of the backbone, one prompt at a time
    plain = jax.jit(sr.plain_step, static_argnums=0)
    start = jax.jit(sr.start, static_argnums=0)
    for p, got in zip(prompts, res.responses):
        st = sr.init_state(model, 1, 32)
        greedy, seeds, on = sampling.SamplingParams.greedy(1), jnp.zeros((1,), jnp.uint32), jnp.ones((1,), bool)
        st, tok = start(model, weights, st, jnp.asarray([p]), jnp.asarray([len(p)]), on, greedy, seeds)
        want = [int(tok[0])]
        while len(want) < 9:
            st, tok = plain(model, weights, st, greedy, seeds, on)
            want.append(int(tok[0]))
        assert got == want
    m = res.metrics
    assert m.emitted == sum(len(r) - 1 for r in res.responses)  # the first token comes from the prefill
    np.testing.assert_allclose(res.tau, m.emitted / m.request_rounds)
    n = np.array([r["num_accepted"] for r in res.records])
    v = np.array([r["num_verified"] for r in res.records])
    assert v.max() == 3 and np.all(n <= v) and set(n.tolist()) >= {0, 1, 3}
    for k in range(1, 4):  # per-position conditional acceptance recomputed from the records
        reached = (v >= k) & (n >= k - 1)
        np.testing.assert_allclose(res.acceptance[k - 1], (reached & (n >= k)).sum() / reached.sum())
    R.write_calibration_records(tmp_path / "rounds.jsonl", res.records)
    z, n2, v2 = read_records(tmp_path / "rounds.jsonl")
    assert z.shape == (len(res.records), model.block_size) and np.array_equal(n2, n)
    R.write_training_jsonl(tmp_path / "regen.jsonl", prompts, res.responses)
    s = D.JsonlStream(D.DataConfig(train=(str(tmp_path / "regen.jsonl"),), seq_len=16, shuffle_buffer=1),
                      process_index=0, process_count=1)
    e = next(s)
    assert e.loss_mask.sum() == 9 and not e.loss_mask[:len(prompts[e.record])].any()
