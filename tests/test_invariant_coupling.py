"""The drafter-invariant coupling (issue 44; `dspark_jax.sampling`): a seeded invariant row emits exactly the
tokens plain decoding with the same seed emits, whatever was drafted, how many drafts were verified, which
scheduler ran and what else shared the batch. (The verify rule's own chi-square and exactness tests are in
test_verify.py; the draft's keyed noise in drafts/test_markov.py.)

The draft here is an oracle that samples the BACKBONE with the draft's keys (`sampling.draft_stream`) and
corrupts some positions: under the invariant coupling its uncorrupted tokens are the target's own draws, so
rounds accept every count 0..K, which a random tiny draft (accepting ~nothing at T = 1) would not show."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import padded
from helpers import random_prompts as prompts
from helpers.spec import CFG, K, family, sampled_oracle_propose

from dspark_jax import sampling
from dspark_jax import spec_round as sr
from dspark_jax.schedule import CostTable
from dspark_jax.serve.engine import Engine, EngineConfig, Request


# Rows: sampled settings of the issue (T = 1; T = 0.7 with top-k and top-p; a greedy row), then the same
# settings under the optimal coupling in the same batch (run, not compared: they only share the batch).
SETTINGS = [(1.0, 0, 1.0), (0.7, 20, 0.9), (1.0, 0, 0.95), (0.7, 0, 1.0), (0.0, 0, 1.0), (1.0, 50, 1.0)]


def _params(invariant):
    n = len(SETTINGS)
    t, k, p = (np.tile([s[i] for s in SETTINGS], 2) for i in range(3))
    return sampling.SamplingParams.make(2 * n, t, k, p, invariant=np.repeat([invariant, False], n))


def _plain(model, weights, prompt, plen, params, seeds, steps, maxlen):
    b = prompt.shape[0]
    active = jnp.ones(b, bool)

    @jax.jit
    def run(weights):
        st, first = sr.start(model, weights, sr.init_state(model, b, maxlen), prompt, plen, active, params, seeds)
        _, toks = jax.lax.scan(lambda st, _: sr.plain_step(model, weights, st, params, seeds, active), st, None,
                               length=steps)
        return jnp.concatenate([first[:, None], toks.T], axis=1)

    return np.asarray(run(weights))


@pytest.mark.parametrize("name", ["mhc", "qwen3"])
def test_invariant_rows_of_a_round_emit_the_plain_decoding_tokens(name):
    """Verify lengths forced through every value 0..K (rows out of phase), invariant rows beside optimal ones:
    every invariant row's 60 tokens are plain sampling's; the invariant rows really accepted drafts."""
    steps, maxlen = 60, 128
    bb, weights = family(name)
    model = sr.SpecModel(bb, CFG, impl="xla", propose_fn=sampled_oracle_propose)
    n = 2 * len(SETTINGS)
    prompt, plen = padded(prompts(n, seed=3))
    params, seeds, active = _params(True), jnp.arange(100, 100 + n, dtype=jnp.uint32), jnp.ones(n, bool)
    want = _plain(model, weights, prompt, plen, params, seeds, steps, maxlen)
    state, first = sr.start(model, weights, sr.init_state(model, n, maxlen), prompt, plen, active, params, seeds)
    rnd = jax.jit(sr.spec_round, static_argnums=0, static_argnames=("width", "mode", "filtering"))
    got = [[int(f)] for f in first]
    accepted = np.zeros(K + 1, int)
    i = 0
    while min(len(g) for g in got) <= steps:
        lengths = (jnp.arange(n) + i) % (K + 1)
        state, out = rnd(model, weights, state, params, seeds, active, width=K + 1, mode="fixed", num_verify=lengths)
        out = jax.device_get(out)
        for r in range(n):
            got[r] += [int(t) for t in out.tokens[r, :out.num_emitted[r]]]
            if r < len(SETTINGS):
                accepted[out.num_accepted[r]] += 1
        i += 1
    for r in range(len(SETTINGS)):
        assert got[r][:steps + 1] == want[r].tolist(), (r, SETTINGS[r])
    assert (accepted > 0).all(), accepted  # every acceptance count 0..K happened on invariant rows
    # the optimal rows sampled differently somewhere (the coupling changed what they got)
    assert any(got[r][:steps + 1] != want[r].tolist() for r in range(len(SETTINGS), n) if SETTINGS[r % 6][0] > 0)


def _requests(invariant_ids):
    """Eight requests of varied lengths (they join and leave a 3-slot engine), settings cycling SETTINGS."""
    out = []
    for i, p in enumerate(prompts(8, seed=5)):
        t, k, pp = SETTINGS[i % len(SETTINGS)]
        out.append(Request(p, max_tokens=10 + 5 * i, temperature=t, top_k=k, top_p=pp, seed=1000 + i, id=i,
                           coupling="invariant" if i in invariant_ids else "optimal"))
    return out


# ~2-3 min of compiles (a plain engine and three speculative ones at every width): in the slow step.
@pytest.mark.slow
def test_engine_invariant_requests_equal_a_plain_engine_in_every_mode():
    """Through the engine: requests joining and leaving 3 slots, invariant and optimal requests mixed, modes
    fixed, sync and async, each engine first serving other (optimal) traffic: every invariant request gets the
    tokens a `mode="plain"` engine gives it."""
    bb, weights = family("mhc")
    model = sr.SpecModel(bb, CFG, impl="xla", propose_fn=sampled_oracle_propose)
    invariant_ids = {0, 1, 3, 4, 6}
    reqs = _requests(invariant_ids)

    def engine(mode, **kw):
        table = CostTable(np.array([1, 4, 8, 12]), np.array([100.0, 95.0, 60.0, 40.0]), max_batch_tokens=18)
        return Engine(model, weights, EngineConfig(mode=mode, max_slots=3, max_len=128, progress=False, **kw),
                      table if mode in ("sync", "async") else None)

    want = {r.id: r.tokens for r in engine("plain").generate(reqs)}
    for mode, kw in (("fixed", {"num_verify": K}), ("sync", {}), ("async", {})):
        eng = engine(mode, **kw)
        eng.generate([Request(p, max_tokens=12, temperature=1.0, seed=7, id="other") for p in prompts(4, seed=9)])
        for r in eng.generate(reqs):
            if r.id in invariant_ids:
                assert r.tokens == want[r.id], (mode, r.id)
        m = eng.metrics
        assert m.spec_rounds > 0 and m.accepted_at.sum() > 0, mode  # drafts were verified and accepted
