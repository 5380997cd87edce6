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
from helpers.spec import CFG, K, family, plain_tokens, sampled_oracle_propose

from dspark_jax import sampling
from dspark_jax import spec_round as sr
from dspark_jax.schedule import CostTable
from dspark_jax.serve.engine import Engine, EngineConfig, Request


# Rows: sampled settings of the issue (T = 1; T = 0.7 with top-k and top-p; a greedy row), then the same
# settings under the optimal coupling in the same batch (run, not compared: they only share the batch).
SETTINGS = [(1.0, 0, 1.0), (0.7, 20, 0.9), (1.0, 0, 0.95), (0.7, 0, 1.0), (0.0, 0, 1.0), (1.0, 50, 1.0)]


ROWS = 64  # the first half invariant, the second optimal; settings cycle through SETTINGS in each half


def _params():
    setting = [SETTINGS[i % len(SETTINGS)] for i in range(ROWS // 2)] * 2
    t, k, p = (np.array([s[i] for s in setting]) for i in range(3))
    return sampling.SamplingParams.make(ROWS, t, k, p, invariant=np.arange(ROWS) < ROWS // 2)


@pytest.mark.parametrize("name", ["mhc", "qwen3"])
def test_invariant_rows_of_a_round_emit_the_plain_decoding_tokens(name):
    """64 prompts, verify lengths forced through every value 0..K (rows out of phase), 32 invariant rows beside
    32 optimal ones: every invariant row's 40 tokens are plain sampling's; the invariant rows really accepted
    drafts."""
    steps, maxlen = 40, 128
    bb, weights = family(name)
    model = sr.SpecModel(bb, CFG, impl="xla", propose_fn=sampled_oracle_propose)
    n = ROWS
    prompt, plen = padded(prompts(n, seed=3))
    params, seeds, active = _params(), jnp.arange(100, 100 + n, dtype=jnp.uint32), jnp.ones(n, bool)
    want = plain_tokens(model, weights, prompt, plen, params, seeds, steps, maxlen)
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
            if r < n // 2:
                accepted[out.num_accepted[r]] += 1
        i += 1
    for r in range(n // 2):
        assert got[r][:steps + 1] == want[r].tolist(), (r, SETTINGS[r % len(SETTINGS)])
    assert (accepted > 0).all(), accepted  # every acceptance count 0..K happened on invariant rows
    # the optimal rows sampled differently somewhere (the coupling changed what they got)
    assert any(got[r][:steps + 1] != want[r].tolist() for r in range(n // 2, n))


def _requests(invariant_ids):
    """Eight requests of varied lengths (they join and leave a 3-slot engine), settings cycling SETTINGS."""
    out = []
    for i, p in enumerate(prompts(8, seed=5)):
        t, k, pp = SETTINGS[i % len(SETTINGS)]
        out.append(Request(p, max_tokens=10 + 5 * i, temperature=t, top_k=k, top_p=pp, seed=1000 + i, id=i,
                           coupling="invariant" if i in invariant_ids else "optimal"))
    return out


# ~5 min of compiles (a plain engine and four speculative ones at every width): in the slow step.
@pytest.mark.slow
def test_engine_invariant_requests_equal_a_plain_engine_in_every_mode():
    """Through the engine: requests joining and leaving 3 slots, invariant and optimal requests mixed, modes
    fixed, sync and async (and fixed at batch 1), each engine first serving other (optimal) traffic: every
    invariant request gets the tokens a `mode="plain"` engine gives it."""
    bb, weights = family("mhc")
    model = sr.SpecModel(bb, CFG, impl="xla", propose_fn=sampled_oracle_propose)
    invariant_ids = {0, 1, 3, 4, 6}
    reqs = _requests(invariant_ids)

    def engine(mode, slots=3, **kw):
        table = CostTable(np.array([1, 4, 8, 12]), np.array([100.0, 95.0, 60.0, 40.0]), max_batch_tokens=18)
        return Engine(model, weights, EngineConfig(mode=mode, max_slots=slots, max_len=128, progress=False, **kw),
                      table if mode in ("sync", "async") else None)

    want = {r.id: r.tokens for r in engine("plain").generate(reqs)}
    for slots, mode, kw in ((3, "fixed", {"num_verify": K}), (3, "sync", {}), (3, "async", {}),
                            (1, "fixed", {"num_verify": K})):  # batch 1: one request at a time
        eng = engine(mode, slots, **kw)
        eng.generate([Request(p, max_tokens=12, temperature=1.0, seed=7, id="other") for p in prompts(4, seed=9)])
        for r in eng.generate(reqs):
            if r.id in invariant_ids:
                assert r.tokens == want[r.id], (slots, mode, r.id)
        m = eng.metrics
        assert m.spec_rounds > 0 and m.accepted_at.sum() > 0, mode  # drafts were verified and accepted
