"""The serving engine's loop (serve/engine.py, serve/decode_state.py): submit / step / cancel with
overlap, on-device finish checks, the async scheduler's plain fallback, no host transfers in steady
state, and bad requests that never stop the others."""

import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import backbone_greedy_drafts, oracle_propose
from helpers import random_prompts as prompts
from helpers.spec import CFG, family, plain_greedy

from dspark_jax import spec_round as sr
from dspark_jax.errors import UserError
from dspark_jax.schedule import CostTable
from dspark_jax.serve import decode_state as ds
from dspark_jax.serve.compiling import count_compiles
from dspark_jax.serve.engine import Engine, EngineConfig, Request
from dspark_jax.validation import ConfigError

MAXLEN = 200  # plain_greedy's cache length: the same compiled programs as test_spec_round


def _engine(mode="off", slots=3, table=None, **kw):
    bb, weights = family("mhc")
    model = sr.SpecModel(bb, CFG, impl="xla", propose_fn=oracle_propose)
    return Engine(model, weights, EngineConfig(mode=mode, max_slots=slots, max_len=MAXLEN, progress=False, **kw), table)


def _want():
    return plain_greedy("mhc", 22, 150, MAXLEN)


def test_requests_join_leave_and_cancel_mid_run_greedy_equals_plain():
    """More requests than slots, submitted while others run; one cancelled while running, one while
    queued, one that stops on a stop id: the rest are plain decoding token for token."""
    want = _want()
    eng = _engine()
    budget = {i: 120 if i == 1 else 30 + 4 * i for i in range(4)}
    ids = {eng.submit(Request(p, max_tokens=budget[i], id=i)): i for i, p in enumerate(prompts(4, seed=1))}
    got = {i: [] for i in range(8)}
    finish = {}
    steps = 0
    late = prompts(8, seed=1)[4:]
    while not eng.idle:
        for ev in eng.step():
            got[ev.request_id] += ev.tokens
            if ev.finish_reason:
                finish[ev.request_id] = ev.finish_reason
        steps += 1
        if steps == 2:  # join mid-run; request 5 stops at the token plain decoding emits 6th
            for j, p in enumerate(late):
                i = 4 + j
                stop = (int(want[i, 5]),) if i == 5 else ()
                ids[eng.submit(Request(p, max_tokens=12, stop_tokens=stop, id=i))] = i
            victim_queued = max(ids)
            assert eng.cancel(victim_queued)  # still in the queue: the slots are busy
        if 1 not in finish and len(got[1]) >= 10:
            running = next(rid for rid, i in ids.items() if i == 1)
            assert eng.cancel(running)
            assert not eng.cancel(running)  # already cancelled
    assert finish[1] == "cancelled" and finish[ids[victim_queued]] == "cancelled"
    assert got[ids[victim_queued]] == []
    assert got[1] == want[1, :len(got[1])].tolist()
    first_stop = list(want[5]).index(want[5, 5])
    assert finish[5] == "stop" and got[5] == want[5, :first_stop + 1].tolist()
    assert 10 <= len(got[1]) < 120
    for i in (0, 2, 3, 4, 6):
        assert finish[i] == "length", (i, finish[i])
        assert got[i] == want[i, :budget.get(i, 12)].tolist(), i


def test_async_scheduler_falls_back_to_plain_steps_and_stays_exact():
    """A cost table on which speculation never pays (a third batch token makes the step 10x slower): the async
    engine runs plain step programs, probing with a verify-all round at the start and after 8 and 16
    more plain steps, and emits exactly plain decoding."""
    table = CostTable(np.array([1, 3]), np.array([100.0, 10.0]), max_batch_tokens=24)
    eng = _engine("async", slots=2, table=table)
    reqs = [Request(p, max_tokens=40, id=i) for i, p in enumerate(prompts(2, seed=1))]
    want = _want()
    for r in eng.generate(reqs):
        assert r.tokens == want[r.id, :40].tolist()
    m = eng.metrics
    assert 1 <= m.spec_rounds <= 3 and m.rounds > 10 * m.spec_rounds, (m.spec_rounds, m.rounds)


def test_a_new_batch_of_the_same_size_after_a_capacity_of_zero_starts_on_plain_steps():
    """Issue 42. The last capacity read was 0 on as many rows as a new batch has (nothing else running): the
    new batch starts on plain steps and is probed after the floor of plain steps (8 here), not at once, as a
    probe per generate call would cost a full-width round for nothing. A batch of another size probes at
    once (its economics differ). The tokens are plain decoding's either way."""
    table = CostTable(np.array([1, 3]), np.array([100.0, 10.0]), max_batch_tokens=24)  # verifying never pays
    eng = _engine("async", slots=2, table=table)
    seen = _recording_dispatch(eng)
    reqs = [Request(p, max_tokens=6, id=i) for i, p in enumerate(prompts(2, seed=1))]
    want = _want()

    def first_round():
        rounds = [k[0] for k in seen if k[0] in ("spec", "plain")]
        seen.clear()
        return rounds[0], rounds.count("spec")

    eng.generate(reqs)
    assert first_round() == ("spec", 1)  # nothing known yet: a probe at once (capacity 0)
    assert [r.tokens for r in eng.generate(reqs)] == [want[i, :6].tolist() for i in range(2)]
    assert first_round() == ("plain", 0)
    assert eng.generate(reqs[:1])[0].tokens == want[0, :6].tolist()
    assert first_round()[0] == "spec"


def test_async_scheduler_speculates_when_it_pays():
    """A flat cost table (verifying is free): the capacity read back is positive and every round that
    drafts verifies drafts. The rounds that do not draft are plain steps: the one the engine runs while
    its first probe's answer is in flight, the round right after the probe (its lagged confidences are
    from before the rows joined: none) and the last ones, where no row has a draft left to verify."""
    table = CostTable(np.array([1]), np.array([100.0]), max_batch_tokens=24)
    eng = _engine("async", slots=2, table=table, record_rounds=True)
    want = _want()
    for r in eng.generate([Request(p, max_tokens=30, id=i) for i, p in enumerate(prompts(2, seed=1))]):
        assert r.tokens == want[r.id, :30].tolist()
    m = eng.metrics
    assert m.verified > 0 and m.spec_rounds >= m.rounds // 2, (m.spec_rounds, m.rounds)
    assert (eng.take_records()["num_verified"] > 0).all()  # a round that drafts verifies what it drafted


def test_an_async_round_with_no_capacity_is_a_plain_step_with_the_keys_of_a_round_verifying_nothing():
    """Async rounds whose lagged capacity is 0 (a table on which speculation never pays) do not draft:
    at T = 1 they emit exactly what rounds verifying no draft emit (the same sampling keys) and leave
    the draft's context as those do (the anchor's row ingested every round)."""
    bb, weights = family("mhc")
    model = sr.SpecModel(bb, CFG.replace(kv_fp8=False), impl="xla", propose_fn=oracle_propose)
    reqs = [Request(p, max_tokens=100, temperature=1.0, seed=7 + i, id=i) for i, p in enumerate(prompts(3, seed=2))]
    rows = ds.joining_rows([0, 1, 2], [list(r.prompt) for r in reqs], reqs, 3, MAXLEN, 1, 16)
    never_pays = CostTable(np.array([1, 4]), np.array([100.0, 10.0]), max_batch_tokens=24)
    k = model.block_size
    ends = []
    for mode in ("fixed", "async"):
        state = ds.init(model, 3, MAXLEN, 1)
        state, _ = ds.ADMIT(model, weights, state, jax.device_put(rows), max_len=MAXLEN)
        # The async rounds are dispatched at full width; their plain step forwards one token, as the
        # width-1 round verifying nothing does (same shapes, so the same bits up to the ring's rounding).
        state, delta = ds.SPEC_ROUNDS(model, weights, state, never_pays, rounds=6, max_len=MAXLEN,
                                      width=1 if mode == "fixed" else k + 1, mode=mode,
                                      num_verify=0 if mode == "fixed" else None)
        assert np.asarray(delta.drafted).tolist() == [mode == "fixed"] * 6
        ends.append((np.asarray(delta.tokens), state.round))
    (tok0, r0), (tok1, r1) = ends
    np.testing.assert_array_equal(tok0, tok1)
    assert (tok0[:, :, 0] >= 0).all() and (tok0[:, :, 1:] == -1).all()
    np.testing.assert_array_equal(np.asarray(r0.cache.length), np.asarray(r1.cache.length))
    np.testing.assert_array_equal(np.asarray(r0.draft.length), np.asarray(r1.draft.length))
    np.testing.assert_allclose(np.asarray(r1.draft.ring, np.float32), np.asarray(r0.draft.ring, np.float32),
                               rtol=1e-5, atol=1e-6)


def test_fixed_mode_verifies_exactly_num_verify_drafts():
    """num_verify = 2 runs the width-4 program (the bucket of 3 tokens) but verifies 2 drafts, not 3."""
    eng = _engine("fixed", slots=2, num_verify=2, record_rounds=True)
    want = _want()
    for r in eng.generate([Request(p, max_tokens=20, id=i) for i, p in enumerate(prompts(2, seed=1))]):
        assert r.tokens == want[r.id, :20].tolist()
    verified = eng.take_records()["num_verified"]
    assert verified.max() == 2 and (verified <= 2).all()


def test_deferred_draft_ingest_catches_up_to_the_per_step_ingest():
    """Plain steps that only buffer their taps, then one catch-up, leave the draft's context as one
    ingest per step does (fp8 KV rounding off: a last-bit difference between the [B, 1] and [B, P]
    shapes must not be amplified into an fp8 step)."""
    bb, weights = family("mhc")
    model = sr.SpecModel(bb, CFG.replace(kv_fp8=False), impl="xla")
    reqs = [Request(p, max_tokens=100, id=i) for i, p in enumerate(prompts(3, seed=2))]
    rows = ds.joining_rows([0, 1, 2], [list(r.prompt) for r in reqs], reqs, 3, MAXLEN, 1, 16)
    ends = []
    for deferred in (0, 16):
        state = ds.init(model, 3, MAXLEN, 1, deferred)
        state, _ = ds.ADMIT(model, weights, state, jax.device_put(rows), max_len=MAXLEN)
        state, delta = ds.PLAIN_ROUNDS(model, weights, state, rounds=6, max_len=MAXLEN, ingest_draft=True)
        if deferred:
            assert np.asarray(state.deferred.count).tolist() == [6, 6, 6]
            state = ds.CATCH_UP(model, weights, state, width=8)  # reads buffer rows 0..7 only
            assert np.asarray(state.deferred.count).tolist() == [0, 0, 0]
        ends.append((np.asarray(delta.tokens), state.round.draft))
    (tok0, d0), (tok1, d1) = ends
    np.testing.assert_array_equal(tok0, tok1)
    np.testing.assert_array_equal(np.asarray(d0.length), np.asarray(d1.length))
    np.testing.assert_allclose(np.asarray(d1.ring, np.float32), np.asarray(d0.ring, np.float32), rtol=1e-5, atol=1e-6)


def _liar_propose(model, weights, state, params, seeds, filtering):
    """A draft sure of itself (confidence logits +10) whose every token is wrong."""
    out = oracle_propose(model, weights, state, params, seeds, filtering)
    wrong = (backbone_greedy_drafts(model, weights, state) + 1) % model.backbone.vocab_size
    return out._replace(tokens=wrong, conf_logits=jnp.full(out.conf_logits.shape, 10.0))


def test_a_cost_table_measured_for_a_smaller_engine_is_refused_or_capped_with_a_warning():
    with pytest.raises(UserError, match="max_batch_tokens 2 is below the engine's 3 slots.*--slots 3"):
        _engine("async", slots=3, table=CostTable(np.array([1, 2]), np.array([100.0, 90.0])))
    with pytest.warns(UserWarning, match="verify at most 1 drafts per round"):
        _engine("sync", slots=3, table=CostTable(np.array([1, 4]), np.array([100.0, 90.0])))
    _engine("off", slots=3, table=CostTable(np.array([1, 2]), np.array([100.0, 90.0])))  # plain: unused


@pytest.mark.slow  # 20-65 s: in the CI's slow step, to keep the default suite near 20 min
def test_async_scheduler_learns_that_overconfident_drafts_do_not_pay():
    """On a table where sure drafts pay, a draft that claims confidence ~1 but is never accepted gets
    verified for a few rounds only: the realized / predicted acceptance scale then sends the engine to
    plain steps (probing now and then). Without the scale every round would speculate."""
    bb, weights = family("mhc")
    model = sr.SpecModel(bb, CFG, impl="xla", propose_fn=_liar_propose)
    table = CostTable(np.array([2, 4, 8, 16]), np.array([100.0, 90.0, 80.0, 70.0]))
    eng = Engine(model, weights, EngineConfig(mode="async", max_slots=2, max_len=MAXLEN, progress=False), table)
    want = _want()
    for r in eng.generate([Request(p, max_tokens=60, id=i) for i, p in enumerate(prompts(2, seed=1))]):
        assert r.tokens == want[r.id, :60].tolist()
    m = eng.metrics
    assert m.verified > 0 and m.spec_rounds < m.rounds / 3, (m.spec_rounds, m.rounds)
    assert eng.acceptance_scale < 0.1


@pytest.mark.parametrize("mode", ["off", "plain"])
def test_steady_state_rounds_move_no_data_host_to_device_and_keep_one_round_in_flight(mode):
    """Once every request is admitted, a step dispatches the next round before it reads the previous one
    (so the device is never idle waiting for the host) and copies nothing from the host to the device:
    sampling parameters, seeds, budgets and stop ids already live there."""
    eng = _engine(mode, slots=2)
    for i, p in enumerate(prompts(2, seed=1)):
        eng.submit(Request(p, max_tokens=150, id=i))
    eng.step()
    eng.step()
    with jax.transfer_guard_host_to_device("disallow_explicit"), jax.transfer_guard_device_to_host("disallow"):
        for _ in range(4):
            events = eng.step()
            assert {e.request_id for e in events} == {0, 1} and all(e.tokens for e in events)
            assert eng.in_flight == 1
    eng.cancel_all()
    while not eng.idle:
        eng.step()


def test_bad_request_is_refused_at_submit_and_the_engine_keeps_serving():
    eng = _engine()
    good = eng.submit(Request([1, 2, 3], max_tokens=5, id="ok"))
    with pytest.raises(ValueError, match="stop_tokens"):
        eng.submit(Request([1], stop_tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9], id="many-stops"))
    with pytest.raises(ValueError, match="prompt"):
        eng.submit(Request([1, 10**6], id="range"))
    out = [ev for ev in eng.stream() if ev.id == good]
    assert out[-1].finish_reason == "length" and sum(len(e.tokens) for e in out) == 5
    assert not eng.cancel(good) and not eng.cancel(12345)
    # generate(): a bad request becomes that request's error Result; the batch around it is served.
    batch = [Request([1, 2, 3], max_tokens=4, id="a"), Request((t for t in [1]), id="gen"), "not a request",
             Request([1, 2, 3], max_tokens=4, top_k=2 ** 40, temperature=1.0, seed=3, id="huge-k"),
             Request([1, 2, 3], max_tokens=4, top_k=0, temperature=1.0, seed=3, id="no-k")]
    res = eng.generate(batch)
    assert [r.finish_reason for r in res] == ["length", "error", "error", "length", "length"]
    assert "request 'prompt'" in res[1].error and "got str" in res[2].error
    assert res[3].tokens == res[4].tokens  # top_k beyond the vocabulary is top-k off


@pytest.mark.slow
def test_engine_on_eight_devices_emits_the_one_device_tokens():
    """The engine on a 2 (data) x 4 (expert) mesh of CPU devices: the draft's experts sharded over
    `expert`, the slots over `data`; greedy tokens and acceptance equal the one-device engine's. (The
    draft runs without its fp8 KV rounding: sharded sums round differently in the last bits, and the
    rounding could turn that into a different, equally valid, draft; see drafts/v41/test_model.py.)"""
    from dspark_jax.parallel import make_mesh

    assert jax.device_count() >= 8
    bb, weights = family("mhc")
    model = sr.SpecModel(bb, CFG.replace(kv_fp8=False), impl="xla")
    reqs = [Request(p, max_tokens=16, id=i) for i, p in enumerate(prompts(4, seed=1))]
    cfg = EngineConfig(mode="off", max_slots=4, max_len=MAXLEN, progress=False)
    one_device = Engine(model, weights, cfg)
    one = one_device.generate(reqs)
    mesh = make_mesh(data=2, expert=4)
    eng = Engine(model, weights, cfg, mesh=mesh)
    eight = eng.generate(reqs)
    experts = [x for x in jax.tree.leaves(eng.weights.draft) if "expert" in str(x.sharding.spec)]
    assert experts, "no draft parameter is sharded over the expert axis"
    assert [r.tokens for r in eight] == [r.tokens for r in one]
    assert [r.tokens for r in one] == [_want()[i, :16].tolist() for i in range(4)]
    assert eng.metrics.emitted == one_device.metrics.emitted and eng.metrics.rounds == one_device.metrics.rounds


def _recording_dispatch(eng):
    """Record the key of every program `eng` dispatches (serve/engine.py `_execute`)."""
    seen, execute = [], eng._execute

    def record(key, rows=None):
        seen.append(key)
        return execute(key, rows)

    eng._execute = record
    return seen


@pytest.mark.slow  # ~40 programs to compile: minutes on 2 cores
def test_warm_up_compiles_every_program_a_workload_can_dispatch(no_compiled_programs):
    """After warm_up(), a varied workload (greedy and filtered sampling, joins of 1..3 rows, short and
    long prompts, budgets that end inside a multi-round call) compiles nothing new."""
    eng = _engine(mode="off", slots=3)
    n = eng.warm_up()
    assert n == len(eng.programs()) and eng.idle
    rng = np.random.default_rng(0)
    reqs = [Request(list(rng.integers(1, 50, int(rng.integers(1, 150)))), max_tokens=int(rng.integers(1, 12)),
                    temperature=float(i % 2), top_k=5 * (i % 3 == 1), seed=i, id=i) for i in range(10)]
    with count_compiles() as c:
        res = eng.generate(reqs[:1]) + eng.generate(reqs[1:3]) + eng.generate(reqs[3:])
    assert [r.finish_reason for r in res] == ["length"] * 10
    assert c["n"] == 0


def _serve_every_width(eng, filtering=(False, True)):
    """Serve requests one at a time whose budgets make the async scheduler verify at every width above 1:
    near its end a request's bound on the drafts to verify shrinks (measured on this draft, which accepts
    every greedy draft: budget 10 visits widths 2 and 6, budget 11 widths 4 and 6). Greedy with top_k set
    runs the filtered programs with the same tokens. A request served alone starts afresh (no capacity
    carried over), so the widths do not depend on what ran before. -> the results."""
    prompt = prompts(1, seed=3)[0]
    return [r for top_k in [4 * f for f in filtering] for budget in (10, 11)
            for r in eng.generate([Request(prompt, max_tokens=budget, top_k=top_k, id=budget)])]


def _async_widths(seen):
    return {(k[2], k[4]) for k in seen if k[0] == "spec" and k[3] == "async"}


def test_every_dispatched_program_is_in_the_known_set():
    """What the eager and background policies compile ahead (`programs()`) covers what the dispatcher
    picks: an async engine (lazy here, so only what runs compiles) visits every verify width, with
    probes, plain steps, catch-ups and admits, and every key it dispatched is listed."""
    table = CostTable(np.array([1]), np.array([100.0]), max_batch_tokens=24)  # verifying is free
    eng = _engine("async", slots=2, table=table, compile="lazy")
    seen = _recording_dispatch(eng)
    res = _serve_every_width(eng, filtering=(False,))  # the filtered programs: the slow eager test below
    res += eng.generate([Request(p, max_tokens=30, id=i) for i, p in enumerate(prompts(2, seed=1))])
    assert all(r.finish_reason == "length" for r in res)
    assert set(seen) <= set(eng.programs()), sorted(set(seen) - set(eng.programs()), key=str)
    assert _async_widths(seen) == {(w, False) for w in eng.width_buckets[1:]}, sorted(_async_widths(seen))
    kinds = {k[0] for k in seen}
    assert kinds >= {"admit", "plain", "spec", "catch_up"}, kinds  # evict runs on a cancel only


@pytest.fixture
def no_compiled_programs():
    """Start with no compiled program in the process: an engine that compiles its whole set needs the
    memory maps (serve/compiling.py `fits_in_memory_maps`) that earlier tests' programs hold."""
    jax.clear_caches()
    gc.collect()


@pytest.mark.slow  # compiles every program of a 2-slot async engine: ~5 minutes on 2 cores
def test_eager_compile_policy_never_compiles_after_the_first_dispatch(no_compiled_programs):
    """Issue 42. Policy "eager": the first step compiles every program the engine can dispatch (ahead of
    time, in parallel); then the async scheduler visits every verify width, greedy and filtered, with a
    probe, plain steps and catch-ups, and XLA compiles nothing. The tokens are plain decoding's."""
    table = CostTable(np.array([1]), np.array([100.0]), max_batch_tokens=24)  # verifying is free
    eng = _engine("async", slots=2, table=table, compile="eager")
    seen = _recording_dispatch(eng)
    eng.submit(Request(prompts(1, seed=9)[0], max_tokens=1))
    eng.step()  # the first dispatch: compiles every program
    assert eng._compiled >= set(eng.programs())
    while not eng.idle:
        eng.step()
    want = _want()
    with count_compiles() as c:
        res = eng.generate([Request(p, max_tokens=20, id=i) for i, p in enumerate(prompts(2, seed=1))])
        res_varied = _serve_every_width(eng)
    assert c["n"] == 0, f"{c['n']} programs compiled after the first dispatch"
    assert [r.tokens for r in res] == [want[i, :20].tolist() for i in range(2)]
    assert all(r.finish_reason == "length" for r in res_varied)
    spec = _async_widths(seen)
    assert spec == {(w, f) for w in eng.width_buckets[1:] for f in (False, True)}, sorted(spec)
    assert any(k[0] == "catch_up" for k in seen) and any(k[0] == "plain" for k in seen)


@pytest.mark.slow  # the background thread compiles every program: minutes on 2 cores
def test_background_compile_policy_serves_with_what_is_compiled(no_compiled_programs):
    """Policy "background": tokens come before the whole set is compiled (the engine waits only for the
    programs it cannot do without, and serves with plain steps or a compiled wider width meanwhile); the
    tokens are plain decoding's whatever was compiled when; after the background compiler finished,
    nothing compiles. The policy does not depend on the scheduler: the smallest engine whose programs span
    every kind (a 1-slot sync engine, one round per call: 21 programs where the async tests' have 34 and more)."""
    table = CostTable(np.array([1]), np.array([100.0]), max_batch_tokens=24)
    eng = _engine("sync", slots=1, table=table, compile="background", rounds_per_call=1)
    want = _want()
    res = eng.generate([Request(p, max_tokens=20, id=i) for i, p in enumerate(prompts(2, seed=1))])
    assert [r.tokens for r in res] == [want[i, :20].tolist() for i in range(2)]
    assert eng._background is not None
    assert eng._background.finished.wait(timeout=600) and eng._background.error is None
    with count_compiles() as c:
        res = eng.generate([Request(p, max_tokens=20, id=i) for i, p in enumerate(prompts(2, seed=1))])
        _serve_every_width(eng)
    assert c["n"] == 0
    assert [r.tokens for r in res] == [want[i, :20].tolist() for i in range(2)]


def test_an_engine_whose_programs_would_not_fit_compiles_on_first_use(monkeypatch):
    """On XLA:CPU each compiled program holds hundreds of memory maps of the process's vm.max_map_count;
    an eager engine whose set would not fit beside what is compiled warns and compiles on first use
    instead of letting XLA abort the process."""
    from dspark_jax.serve import compiling

    monkeypatch.setattr(compiling, "map_headroom", lambda: 10 * compiling.MAPS_PER_CPU_PROGRAM)
    eng = _engine("off", slots=1, compile="eager")
    assert len(eng.programs()) > 10
    with pytest.warns(RuntimeWarning, match="would not fit"):
        res = eng.generate([Request(prompts(1, seed=1)[0], max_tokens=5)])
    assert res[0].tokens == _want()[0, :5].tolist() and eng._policy == "lazy"
    monkeypatch.setattr(compiling, "map_headroom", lambda: None)  # unknown (not Linux): no limit assumed
    assert compiling.fits_in_memory_maps(10 ** 6)


def test_compile_policy_is_checked(monkeypatch):
    with pytest.raises(ConfigError, match="'compile'"):
        EngineConfig(compile="sometimes")
    monkeypatch.delenv("DSPARK_COMPILE", raising=False)
    assert EngineConfig().compile == "eager"  # the default that never stalls after the first request
    monkeypatch.setenv("DSPARK_COMPILE", "background")
    assert EngineConfig().compile == "background"
    monkeypatch.setenv("DSPARK_COMPILE", "never")
    with pytest.raises(ConfigError, match="'compile'"):
        EngineConfig()


@pytest.mark.parametrize("mode", ["off", "plain"])
def test_a_request_longer_than_the_cache_finishes_at_the_cache_end(mode):
    """The host's count of committed positions must equal the device's: when it ran one ahead, the host
    thought a row done one round before the device did, sent no further round, and waited forever."""
    bb, weights = family("mhc")
    model = sr.SpecModel(bb, CFG, impl="xla", propose_fn=oracle_propose)
    eng = Engine(model, weights, EngineConfig(mode=mode, max_slots=2, max_len=16, progress=False))
    reqs = [Request([5, 6, 7], max_tokens=m) for m in (11, 12, 40)]
    out = []
    worker = threading.Thread(target=lambda: out.extend(eng.generate(reqs)), daemon=True)
    worker.start()
    worker.join(timeout=300)
    assert not worker.is_alive(), "generate did not return: the engine waits for a round it never sends"
    assert [len(r.tokens) for r in out] == [11, 12, 12]  # 3 prompt + 12 tokens = max_len - 1 positions
    assert [r.finish_reason for r in out] == ["length"] * 3


@pytest.mark.parametrize("field,value", [
    ("max_slots", "8"), ("max_slots", True), ("max_len", 1.5), ("max_len", 1), ("mode", "turbo"),
    ("num_verify", -1), ("num_verify", 2.0), ("min_gain", float("nan")), ("min_prompt_bucket", 0),
    ("max_stop_tokens", None), ("rounds_per_call", 0), ("max_deferred_ingest", -1), ("progress", 1),
    ("record_rounds", "yes"),
])
def test_engine_config_names_a_bad_field_before_anything_compiles(field, value):
    from dspark_jax.validation import ConfigError

    EngineConfig(max_slots=np.int64(2), min_gain=np.float32(0.5))  # NumPy scalars are fine (Python API)
    with pytest.raises(ConfigError, match=f"engine '{field}': expected"):
        EngineConfig(**{field: value})
