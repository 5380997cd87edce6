"""The engine's device-resident decode state and the jitted programs that change it (donated).

    state = init(model, slots, max_len, max_stops)
    state, delta = admit(model, weights, state, joining)            # prefill ONLY the joining rows
    state, delta = spec_round(model, weights, state, table, width=..., mode=...)
    state, delta = plain_round(model, weights, state, ingest_draft=...)
    state = catch_up(model, weights, state)                         # the draft ingests deferred positions
    state = evict(state, rows)                                      # a cancelled request leaves

Everything a round needs lives here, on the device: the backbone cache and draft state
(`spec_round.RoundState`), each slot's sampling parameters, seed, token budget and stop ids, and
whether it still runs. A round checks stop ids, max_tokens and the cache end itself, so a finished
row stops emitting in the very round it finishes, whatever the host has read so far. The host writes
a slot only when a request joins (admit) or is cancelled (evict) and reads each round's `Delta`
(the round's output buffer: the tokens each row emitted, at most K+1) asynchronously, a round late.

Deferred ingest: a speculative engine that skips speculation (a plain step) must still give the draft
every committed position, but one draft ingest per plain step costs 16-29% of the step. With a deferral
buffer (`init(..., max_deferred=P)`) a plain step only keeps its backbone taps; `catch_up` ingests up to
P of them in one batched call before the draft next proposes (the engine dispatches it).

Finish rules (per row, in emission order): a stop id ends the request after emitting it ("stop");
reaching max_tokens ends it ("length"); so does a committed length within 2 of the cache end
(`max_len - 2`: a next round needs the anchor's slot and one more).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dspark_jax import drafts
from dspark_jax import sampling
from dspark_jax import spec_round as sr
from dspark_jax.parallel import batch_sharding, fit_shardings, logical_shardings
from dspark_jax.schedule import CostTable, async_capacity, static_budget_tokens, survival

# finish codes (Delta.finish)
RUNNING, STOP, LENGTH = 0, 1, 2
FINISH_REASONS = {STOP: "stop", LENGTH: "length"}


class Slots(NamedTuple):
    """Per-slot request facts (written by admit, read by every round)."""

    params: sampling.SamplingParams  # [B]
    seeds: jax.Array  # u32[B]
    running: jax.Array  # bool[B] holds a request that has not finished
    budget: jax.Array  # i32[B] tokens it may still emit
    stop_ids: jax.Array  # i32[B, S] stop token ids, -1 = unused


class Deferred(NamedTuple):
    """Backbone taps of plain steps whose draft ingest is put off (P = 0: none, ingest every step)."""

    taps: jax.Array  # [B, P, F] taps of draft positions length .. length + count - 1
    count: jax.Array  # i32[B] positions waiting


class Feedback(NamedTuple):
    """Drafts accepted against drafts predicted to be accepted (the survivals of the verified ones), over
    the speculative rounds served so far (decayed): the async capacity's acceptance scale."""

    realized: jax.Array  # f32 scalar
    predicted: jax.Array  # f32 scalar


# The prior is worth this many predicted drafts (trust the calibrated confidences until evidence comes);
# the decay per speculative round lets the scale follow the traffic (about the last 50 rounds).
_FEEDBACK_PRIOR, _FEEDBACK_DECAY = 4.0, 0.98


class DecodeState(NamedTuple):
    round: sr.RoundState
    slots: Slots
    deferred: Deferred
    feedback: Feedback


class Delta(NamedTuple):
    """What one program emitted, per slot (the host reads this a round late)."""

    tokens: jax.Array  # i32[B, T] emitted this call (T = K+1 for rounds, 1 for plain/admit), -1 after
    num_emitted: jax.Array  # i32[B] (0 for rows that were not running)
    finish: jax.Array  # i32[B] RUNNING, STOP or LENGTH: the row finished in THIS call (else RUNNING)
    num_accepted: jax.Array  # i32[B]
    num_verify: jax.Array  # i32[B] admitted drafts l_r
    conf_logits: jax.Array  # f32[B, K] raw confidence logits (calibration records; zeros for plain)
    capacity: jax.Array  # i32 scalar: the async capacity this round's confidences give the round after next
    drafted: jax.Array  # bool scalar: the draft ran (False: a plain step, or an async round with capacity 0)


class Joining(NamedTuple):
    """Host-built rows of an admit call (J rows; padded rows carry slot index B and are dropped)."""

    slot: jax.Array  # i32[J]
    prompt: jax.Array  # i32[J, P]
    prompt_len: jax.Array  # i32[J]
    params: sampling.SamplingParams  # [J]
    seeds: jax.Array  # u32[J]
    max_tokens: jax.Array  # i32[J]
    stop_ids: jax.Array  # i32[J, S]


def init(model: sr.SpecModel, slots: int, max_len: int, max_stops: int, max_deferred: int = 0) -> DecodeState:
    rs = sr.init_state(model, slots, max_len)
    table = Slots(sampling.SamplingParams(jnp.zeros(slots, jnp.float32), jnp.zeros(slots, jnp.int32),
                                          jnp.ones(slots, jnp.float32), jnp.zeros(slots, bool)),
                  jnp.zeros(slots, jnp.uint32), jnp.zeros(slots, bool), jnp.zeros(slots, jnp.int32),
                  jnp.full((slots, max_stops), -1, jnp.int32))
    tap = _tap_spec(model, max_len)
    deferred = Deferred(jnp.zeros((slots, max_deferred, tap.shape[-1]), tap.dtype), jnp.zeros(slots, jnp.int32))
    prior = jnp.full((2,), _FEEDBACK_PRIOR, jnp.float32)  # two buffers: each is donated on its own
    return DecodeState(rs, table, deferred, Feedback(prior[0], prior[1]))


@functools.lru_cache(maxsize=None)
def _tap_spec(model: sr.SpecModel, max_len: int) -> jax.ShapeDtypeStruct:
    """Shape and dtype of one position's backbone taps ([1, 1, F])."""
    bb = model.backbone
    return jax.eval_shape(lambda p: sr.backbone_forward(model, p, bb.init_cache(1, max_len),
                                                        jnp.zeros((1, 1), jnp.int32)).taps, bb.abstract_params())


# ---------------------------------------------------------------------------------------------------
# Row scatter: a joining row's freshly prefilled state goes into its slot


@functools.lru_cache(maxsize=None)
def _batch_axes(model: sr.SpecModel, max_len: int):
    """The batch axis of every RoundState leaf, found by comparing the shapes at batch 1 and 2 (the
    backbone and draft families own their layouts; this only relies on init_state's contract)."""
    one = jax.eval_shape(lambda: sr.init_state(model, 1, max_len))
    two = jax.eval_shape(lambda: sr.init_state(model, 2, max_len))

    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(diff) != 1:
            raise ValueError(f"decode state leaf of shape {b.shape} has no single batch axis")
        return diff[0]

    return jax.tree.map(axis, one, two)


def _scatter_rows(full, part, slot, axes):
    """full leaves [.., B, ..] <- part leaves [.., J, ..] at rows `slot` i32[J] (index B = dropped)."""

    def put(f, p, ax):
        idx = (slice(None),) * ax + (slot,)
        return f.at[idx].set(p.astype(f.dtype), mode="drop")

    return jax.tree.map(put, full, part, axes)


# ---------------------------------------------------------------------------------------------------
# Finish checks (on device)


def _finish(tokens, num_emitted, slots: Slots, new_length, max_len: int):
    """Cut each row's emitted tokens at its first stop id or its budget; -> (tokens, n, finish, budget)."""
    t = tokens.shape[1]
    j = jnp.arange(t, dtype=jnp.int32)[None, :]
    emitted = j < num_emitted[:, None]
    is_stop = emitted & jnp.any((tokens[:, :, None] == slots.stop_ids[:, None, :]) & (slots.stop_ids[:, None, :] >= 0),
                                axis=-1)
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), t).astype(jnp.int32)
    n = jnp.minimum(jnp.minimum(num_emitted, slots.budget), first_stop + 1)
    n = jnp.where(slots.running, n, 0)
    hit_stop = slots.running & (first_stop < n)
    budget = slots.budget - n
    full = slots.running & ((budget <= 0) | (new_length + 2 >= max_len))
    finish = jnp.where(hit_stop, STOP, jnp.where(full, LENGTH, RUNNING)).astype(jnp.int32)
    return jnp.where(j < n[:, None], tokens, -1), n, finish, budget


def _after(state: DecodeState, rs: sr.RoundState, tokens, num_emitted, num_accepted, num_verify, conf_logits,
           capacity, max_len: int, drafted: bool = False):
    slots = state.slots
    toks, n, finish, budget = _finish(tokens, num_emitted, slots, rs.cache.length, max_len)
    slots = slots._replace(running=slots.running & (finish == RUNNING), budget=budget)
    run = state.slots.running
    delta = Delta(toks, n, finish, jnp.where(run, num_accepted, 0), jnp.where(run, num_verify, 0), conf_logits,
                  jnp.asarray(capacity, jnp.int32), jnp.asarray(drafted))
    return state._replace(round=rs, slots=slots), delta


def _no_conf(model, b):
    return jnp.zeros((b, model.block_size), jnp.float32)


# ---------------------------------------------------------------------------------------------------
# The programs


def admit(model: sr.SpecModel, weights: sr.Weights, state: DecodeState, joining: Joining, *, max_len: int
          ) -> tuple[DecodeState, Delta]:
    """Prefill the J joining rows alone (a fresh state of batch J; the LM head at each row's last prompt
    position only), draw their first tokens, and scatter the rows, their sampling facts and budgets into
    their slots. The first token goes through the same finish checks as a round's tokens (a stop id,
    max_tokens 1, a prompt that fills the cache). The Delta's leaves have a leading [1] axis, as a one-round
    call's: every program's output reads the same way."""
    j, b = joining.slot.shape[0], state.slots.running.shape[0]
    sub = sr.init_state(model, j, max_len)
    out = sr.backbone_forward(model, weights.backbone, sub.cache, joining.prompt,
                              logits_at=jnp.maximum(joining.prompt_len - 1, 0))
    cache = model.backbone.commit(out.cache, joining.prompt_len)
    dstate = drafts.ingest(weights.draft, model.cfg, sub.draft, out.taps, joining.prompt_len, impl=model.impl)
    first = sampling.sample(out.logits[:, 0], joining.params, joining.seeds, joining.prompt_len,
                            sampling.Stream.RESAMPLE)
    rs = _scatter_rows(state.round, sr.RoundState(cache, dstate, first, sub.conf_lag), joining.slot,
                       _batch_axes(model, max_len))

    def put(full, part):
        return full.at[joining.slot].set(part.astype(full.dtype), mode="drop")

    s = state.slots
    joined = put(jnp.zeros((b,), bool), jnp.ones((j,), bool))
    slots = Slots(jax.tree.map(put, s.params, joining.params), put(s.seeds, joining.seeds), joined,
                  put(s.budget, joining.max_tokens), put(s.stop_ids, joining.stop_ids))
    first_b = put(jnp.full((b,), -1, jnp.int32), first)[:, None]
    toks, n, finish, budget = _finish(first_b, joined.astype(jnp.int32), slots, rs.cache.length, max_len)
    slots = slots._replace(running=jnp.where(joined, finish == RUNNING, s.running),
                           budget=jnp.where(joined, budget, s.budget))
    zeros = jnp.zeros((b,), jnp.int32)
    deferred = state.deferred._replace(count=put(state.deferred.count, jnp.zeros((j,), jnp.int32)))
    delta = Delta(toks, n, finish, zeros, zeros, _no_conf(model, b), jnp.int32(0), jnp.asarray(False))
    return (state._replace(round=rs, slots=slots, deferred=deferred),
            host_readable(jax.tree.map(lambda x: x[None], delta)))


def _caps(model: sr.SpecModel, state: DecodeState, max_len: int) -> jax.Array:
    """Drafts each row may verify: not past its budget (the round emits l + 1 tokens), not past the
    cache end; -1 for rows not running (schedule.py's padding marker)."""
    length = state.round.cache.length
    cap = jnp.clip(jnp.minimum(state.slots.budget - 1, max_len - length - 2), 0, model.block_size)
    return jnp.where(state.slots.running, cap, -1)


def spec_round(model: sr.SpecModel, weights: sr.Weights, state: DecodeState, table: CostTable | None, *,
               max_len: int, width: int, mode: str, num_verify: int | None = None, min_gain: float = 0.0,
               filtering: bool = True) -> tuple[DecodeState, Delta]:
    """One speculative round (spec_round.spec_round) for every running slot, then the finish checks.

    `mode` is the round's admission: "fixed" (num_verify drafts, clipped to each row's cap and to
    width - 1), "sync" or "async". The Delta carries the async capacity of the round after next:
    C from this round's confidences (the lag-2 confidences that round will schedule with), so the host
    picks that round's verify width without a blocking read.

    The async capacity prices a budget of c drafts at the batch tokens this static-shape engine then
    runs (schedule.static_budget_tokens: every slot at the width bucket of 1 + min(c, K), the draft
    pass inside), not at running rows + c: one verified draft costs a whole speculative round here.

    Idle rounds: in mode "async" this round's capacity C comes from lagged confidences only, so it is
    known before the draft runs. When C = 0 the round would verify nothing and emit exactly what a plain
    step emits (same keys); it then runs as a plain step (`_idle_round`) instead of paying the draft pass
    and a width-`width` verify forward for one token. Which branch runs depends on the past only, so
    the output is the same either way; the saving is measured in BENCHMARKS.md (Demo)."""
    running = state.slots.running
    budget_tokens = jnp.asarray(static_budget_tokens(running.shape[0], model.block_size))
    kw = dict(max_len=max_len, width=width, mode=mode, num_verify=num_verify, min_gain=min_gain,
              budget_tokens=budget_tokens, filtering=filtering)
    if mode != "async" or table is None:  # (async without a table: sr.admit says what is missing)
        return _speculative_round(model, weights, state, table, **kw)
    _, num_drafts = sr.draft_counts(state.slots.running, width, _draft_cap(model, state, max_len))
    lagged = async_capacity(state.round.conf_lag[1], table, min_gain, num_drafts, budget_tokens,
                            acceptance_scale(state.feedback))
    return jax.lax.cond(lagged > 0, lambda st: _speculative_round(model, weights, st, table, **kw),
                        lambda st: _idle_round(model, weights, st, table, min_gain=min_gain,
                                               budget_tokens=budget_tokens, max_len=max_len), state)


def _draft_cap(model: sr.SpecModel, state: DecodeState, max_len: int) -> jax.Array:
    """spec_round.spec_round's draft_cap: the drafts each row may verify (0 for rows not running)."""
    return jnp.maximum(_caps(model, state, max_len), 0)


def _later_capacity(model: sr.SpecModel, state: DecodeState, conf: jax.Array, table: CostTable, min_gain: float,
                    budget_tokens: jax.Array) -> jax.Array:
    """The async capacity `conf` gives a later round: every row still running then, each with all K drafts
    (its cap then is not known now; the round clips to it)."""
    later = jnp.where(state.slots.running, model.block_size, -1)
    return async_capacity(conf, table, min_gain, later, budget_tokens, acceptance_scale(state.feedback))


def _after_plain_step(model: sr.SpecModel, state: DecodeState, rs: sr.RoundState, tokens, max_len: int
                      ) -> tuple[DecodeState, Delta]:
    """_after for a plain step: every running row emits its one token; nothing drafted or verified."""
    running = state.slots.running
    zeros = jnp.zeros_like(state.slots.budget)
    return _after(state, rs, tokens, running.astype(jnp.int32), zeros, zeros, _no_conf(model, running.shape[0]),
                  0, max_len)


def _idle_round(model: sr.SpecModel, weights: sr.Weights, state: DecodeState, table: CostTable, *,
                min_gain: float, budget_tokens: jax.Array, max_len: int) -> tuple[DecodeState, Delta]:
    """An async round whose capacity is 0, run as a plain step. The draft ingests the new position at once
    (a later round of the same call may propose). It brings no confidences of its own, so the newest
    known ones stand in for them: the next round schedules with the last round's (still the past)."""
    state, tokens = _plain_step(model, weights, state, ingest="now")
    newest = state.round.conf_lag[0]
    rs = state.round._replace(conf_lag=jnp.stack([newest, newest]))
    tokens = jnp.pad(tokens, ((0, 0), (0, model.block_size)), constant_values=-1)  # a round's [B, K+1]
    state, delta = _after_plain_step(model, state, rs, tokens, max_len)
    return state, delta._replace(capacity=_later_capacity(model, state, newest, table, min_gain, budget_tokens))


def _speculative_round(model: sr.SpecModel, weights: sr.Weights, state: DecodeState, table: CostTable | None, *,
                       max_len: int, width: int, mode: str, num_verify: int | None, min_gain: float,
                       budget_tokens: jax.Array, filtering: bool) -> tuple[DecodeState, Delta]:
    """spec_round's speculative branch: draft, admit, verify, commit."""
    running = state.slots.running
    nv = None if num_verify is None else jnp.full(running.shape, num_verify, jnp.int32)
    rs, out = sr.spec_round(model, weights, state.round, state.slots.params, state.slots.seeds, running,
                            width=width, mode=mode, num_verify=nv, draft_cap=_draft_cap(model, state, max_len),
                            table=table, min_gain=min_gain, budget_tokens=budget_tokens,
                            acceptance_scale=acceptance_scale(state.feedback), filtering=filtering)
    feedback = state.feedback
    if table is not None:  # only the async capacity reads the feedback: no table, no bookkeeping
        feedback = _feedback(feedback, out.conf, out.num_verify, out.num_accepted, running)
    state, delta = _after(state._replace(feedback=feedback), rs, out.tokens, out.num_emitted, out.num_accepted,
                          out.num_verify, out.conf_logits, 0, max_len, drafted=True)
    if table is not None:
        delta = delta._replace(capacity=_later_capacity(model, state, out.conf, table, min_gain, budget_tokens))
    return state, delta


def acceptance_scale(feedback: Feedback) -> jax.Array:
    """Realized over predicted accepted drafts so far (1 before any evidence, by the prior)."""
    return feedback.realized / feedback.predicted


def _feedback(fb: Feedback, conf, num_verify, num_accepted, running) -> Feedback:
    """Add one round: its accepted drafts, and the sum of the survivals of the drafts it verified (their
    expected number accepted). A round that verified nothing leaves the sums as they are."""
    verified = (jnp.arange(1, conf.shape[1] + 1)[None, :] <= num_verify[:, None]) & running[:, None]
    predicted = jnp.sum(jnp.where(verified, survival(conf), 0.0))
    realized = jnp.sum(jnp.where(running, num_accepted, 0)).astype(jnp.float32)
    decay = jnp.where(predicted > 0, _FEEDBACK_DECAY, 1.0)
    return Feedback(decay * fb.realized + realized, decay * fb.predicted + predicted)


def plain_round(model: sr.SpecModel, weights: sr.Weights, state: DecodeState, *, max_len: int,
                ingest_draft: bool) -> tuple[DecodeState, Delta]:
    """One plain decoding step for every running slot (the same keys a round with l = 0 uses).

    `ingest_draft` keeps the draft's context current (a speculative engine that skips speculation for a
    round must not leave a hole in the draft's context): with a deferral buffer the step's taps go there
    (the caller runs `catch_up` before the buffer overflows or the draft proposes), else the draft
    ingests them now. The plain baseline runs without (no taps)."""
    state, tokens = _plain_step(model, weights, state, ingest="defer" if ingest_draft else "none")
    return _after_plain_step(model, state, state.round, tokens, max_len)


def _plain_step(model: sr.SpecModel, weights: sr.Weights, state: DecodeState, *, ingest: str
                ) -> tuple[DecodeState, jax.Array]:
    """The backbone's step for every running slot: -> (state with the cache, anchor and draft context
    advanced, tokens i32[B, 1] (-1 where not running)). The slots' finish bookkeeping is the caller's.

    `ingest`: "none" (no taps: the plain baseline), "defer" (taps into the deferral buffer when there is
    one, else ingested now) or "now" (the draft ingests them now, buffer or not)."""
    running = state.slots.running
    rs = state.round
    n = running.astype(jnp.int32)
    if ingest == "none":
        bo = model.backbone.forward(weights.backbone, rs.cache, rs.anchor[:, None])
    else:
        bo = sr.backbone_forward(model, weights.backbone, rs.cache, rs.anchor[:, None])
        buf = state.deferred
        if ingest == "defer" and buf.taps.shape[1]:
            rows = jnp.arange(n.shape[0])
            at = jnp.where(running, buf.count, buf.taps.shape[1])  # out of range (dropped) for idle rows
            state = state._replace(deferred=Deferred(buf.taps.at[rows, at].set(bo.taps[:, 0], mode="drop"),
                                                     buf.count + n))
        else:
            rs = rs._replace(draft=drafts.ingest(weights.draft, model.cfg, rs.draft, bo.taps, n,
                                                    impl=model.impl))
    token = sampling.sample(bo.logits[:, 0], state.slots.params, state.slots.seeds, rs.cache.length + 1,
                            sampling.Stream.RESAMPLE)
    cache = model.backbone.commit(bo.cache, n)
    rs = rs._replace(cache=cache, anchor=jnp.where(running, token, rs.anchor))
    return state._replace(round=rs), jnp.where(running, token, -1)[:, None]


def catch_up(model: sr.SpecModel, weights: sr.Weights, state: DecodeState, *, width: int | None = None
             ) -> DecodeState:
    """The draft ingests every deferred position (one batched ingest); the buffer empties. `width`
    (static, default the whole buffer) bounds every row's count: only that many buffer rows are read."""
    buf = state.deferred
    taps = buf.taps if width is None else buf.taps[:, :width]
    draft = drafts.ingest(weights.draft, model.cfg, state.round.draft, taps, buf.count, impl=model.impl)
    return state._replace(round=state.round._replace(draft=draft),
                          deferred=buf._replace(count=jnp.zeros_like(buf.count)))


def evict(state: DecodeState, rows: jax.Array) -> DecodeState:
    """Stop the rows where `rows` (bool[B]) is set (cancelled requests); their slots are free."""
    return state._replace(slots=state.slots._replace(running=state.slots.running & ~rows))


def spec_rounds(model: sr.SpecModel, weights: sr.Weights, state: DecodeState, table: CostTable | None, *,
                rounds: int = 1, **kw) -> tuple[DecodeState, Delta]:
    """`rounds` consecutive speculative rounds in one call (one host dispatch for all of them, the
    finish checks still per round); the Delta's leaves gain a leading [rounds] axis."""
    state, delta = jax.lax.scan(lambda st, _: spec_round(model, weights, st, table, **kw), state, None, length=rounds)
    return state, host_readable(delta)


def plain_rounds(model: sr.SpecModel, weights: sr.Weights, state: DecodeState, *, rounds: int = 1, **kw
                 ) -> tuple[DecodeState, Delta]:
    """`rounds` consecutive plain steps in one call (Delta leaves [rounds, ...])."""
    state, delta = jax.lax.scan(lambda st, _: plain_round(model, weights, st, **kw), state, None, length=rounds)
    return state, host_readable(delta)


def host_readable(delta: Delta) -> Delta:
    """Under a mesh, the output buffer replicated on every device: any host of a multi-host slice can
    read it whole (it is small: at most K+1 tokens and a few counts per slot)."""
    if jax.sharding.get_abstract_mesh().empty:
        return delta
    return jax.lax.with_sharding_constraint(delta, jax.sharding.PartitionSpec())


# Shared compiled programs (module level, so every Engine over the same SpecModel reuses them). The state
# is donated: a round updates the cache and draft state in place instead of copying them.
ADMIT = jax.jit(admit, static_argnums=0, donate_argnames=("state",), static_argnames=("max_len",))
SPEC_ROUNDS = jax.jit(spec_rounds, static_argnums=0, donate_argnames=("state",),
                      static_argnames=("rounds", "max_len", "width", "mode", "num_verify", "min_gain", "filtering"))
PLAIN_ROUNDS = jax.jit(plain_rounds, static_argnums=0, donate_argnames=("state",),
                       static_argnames=("rounds", "max_len", "ingest_draft"))
CATCH_UP = jax.jit(catch_up, static_argnums=0, donate_argnames=("state",), static_argnames=("width",))
EVICT = jax.jit(evict, donate_argnames=("state",))


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (n >= 1): the bucket every padded host-side shape rounds up to."""
    return 1 << (n - 1).bit_length()


def prompt_bucket(longest: int, max_len: int, min_bucket: int) -> int:
    """The padded prompt length P of an admit call whose longest prompt has `longest` tokens."""
    return min(max_len, max(min_bucket, pow2_at_least(longest)))


def joining_rows(slots: list[int], prompts: list[list[int]], requests, num_slots: int, max_len: int,
                 max_stops: int, min_bucket: int) -> Joining:
    """Host side: the padded arrays of one admit call (J and P bucketed to powers of two, so few programs
    compile). Padded rows point at slot `num_slots` (dropped on device)."""
    j = pow2_at_least(len(slots))
    p_len = prompt_bucket(max(len(p) for p in prompts), max_len, min_bucket)
    slot = np.full((j,), num_slots, np.int32)
    prompt = np.zeros((j, p_len), np.int32)
    plen = np.ones((j,), np.int32)
    temp, top_k, top_p = np.zeros(j, np.float32), np.zeros(j, np.int32), np.ones(j, np.float32)
    invariant = np.zeros(j, bool)
    seeds, max_tokens = np.zeros(j, np.uint32), np.ones(j, np.int32)
    stops = np.full((j, max_stops), -1, np.int32)
    for i, (s, p, r) in enumerate(zip(slots, prompts, requests)):
        slot[i], plen[i] = s, len(p)
        prompt[i, :len(p)] = p
        temp[i], top_k[i], top_p[i], seeds[i], max_tokens[i] = r.temperature, r.top_k, r.top_p, r.seed, r.max_tokens
        invariant[i] = sampling.coupling_flag(r.coupling)
        stops[i, :len(r.stop_tokens)] = list(r.stop_tokens)
    return Joining(slot, prompt, plen, sampling.SamplingParams(temp, top_k, top_p, invariant), seeds, max_tokens, stops)


# ---------------------------------------------------------------------------------------------------
# Multi-device placement: parameters and state carry shardings by name


def weight_shardings(model: sr.SpecModel, weights: sr.Weights, mesh):
    """NamedShardings of a speculative pair's weights on `mesh`: the backbone's and the draft's by their
    logical axis names (the draft's experts over `expert`, ...; see dspark_jax.parallel), the tied
    embedding / head and the STS temperatures replicated."""
    bb = model.backbone
    replicated = NamedSharding(mesh, PartitionSpec())
    return sr.Weights(fit_shardings(logical_shardings(bb.logical_axes(), mesh), bb.abstract_params()),
                      drafts.param_shardings(model.cfg, mesh, weights.draft),  # packed nodes too
                      jax.tree.map(lambda _: replicated, weights.tied),
                      replicated)


def state_shardings(model: sr.SpecModel, state: DecodeState, max_len: int, mesh):
    """NamedShardings of a DecodeState on `mesh`: every leaf's batch (slot) axis over the mesh's batch
    axes (`data`, `fsdp`), the rest replicated (a slot count the batch axes do not divide stays whole)."""
    lead = batch_sharding(mesh, 1).spec[0]

    def at(axis, leaf):
        spec = [None] * leaf.ndim
        spec[axis] = lead
        return NamedSharding(mesh, PartitionSpec(*spec))

    round_sh = jax.tree.map(at, _batch_axes(model, max_len), state.round)
    slots_sh, deferred_sh = (jax.tree.map(lambda leaf: at(0, leaf), part) for part in (state.slots, state.deferred))
    feedback_sh = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), state.feedback)
    return fit_shardings(DecodeState(round_sh, slots_sh, deferred_sh, feedback_sh), state)
