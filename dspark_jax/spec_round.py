"""The ONE speculative round (SPEC sections 1, 5, 6, 7), shared by serving and training rollouts.

    state, first = start(model, weights, state, prompt, prompt_len, joining, sampling, seeds)
    state, out   = spec_round(model, weights, state, sampling, seeds, active, width=..., mode=...)

A round, per request slot: draft propose -> calibrated confidences -> admission of l_r drafts (fixed,
sync or async scheduler) -> ONE backbone forward over [anchor, x_1..x_l] (width static, chosen on the
host) -> verify_and_accept -> backbone cache commit of the anchor and the accepted drafts (rejected
entries roll back) -> draft ring backfill of every newly committed position -> the emitted
correction/bonus token becomes the next anchor.

Positions: the anchor sits at `length` (= committed positions of backbone and draft), draft token k at
`length + k`. Keys: the first token after a prompt of length n is drawn with (seed, n, RESAMPLE), the
same key plain decoding uses, so a round with l_r = 0 reproduces plain sampling exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax import drafts, sampling
from dspark_jax.backbones.base import Backbone, tap_state_ids
from dspark_jax.validation import ConfigError
from dspark_jax.schedule import CostTable, schedule_async, schedule_sync
from dspark_jax.verify import verify_and_accept

MODES = ("fixed", "sync", "async")


@dataclasses.dataclass(frozen=True)
class SpecModel:
    """The static half of a speculative pair (hashable: a jit static argument)."""

    backbone: Backbone
    cfg: Any  # any draft family's config (`dspark_jax.drafts`)
    # Which backbone taps the draft reads; None = the draft family's own (`cfg.tap_mode`: V4.1 reads layer
    # entries, DeepSpec layer outputs). An explicit value must agree with the family.
    tap_mode: str | None = None
    impl: str = "auto"  # kernel dispatch for the draft
    # The draft step (model, weights, state, params, seeds, filtering) -> DraftOutput; replaceable so
    # tests can drive the round with an oracle draft that reads the backbone.
    propose_fn: Callable | None = None

    def __post_init__(self):
        family_mode = drafts.family_of(self.cfg).tap_mode
        if self.tap_mode is None:
            object.__setattr__(self, "tap_mode", family_mode)
        elif self.tap_mode != family_mode:
            raise ValueError(f"SpecModel 'tap_mode': the {self.cfg.family!r} draft family reads backbone taps "
                             f"{family_mode!r}, got {self.tap_mode!r} (leave it unset to use the family's)")
        check_draft_fits_backbone(self.cfg, self.backbone, self.tap_mode)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size


def check_draft_fits_backbone(cfg, backbone: Backbone, tap_mode: str) -> None:
    """The draft reads taps the backbone has, of the backbone's width, and shares its vocabulary (the tied
    embedding and head); a mismatch would otherwise surface as a shape error inside the first compile."""
    if cfg.vocab_size != backbone.vocab_size:
        raise ConfigError(f"draft config field 'vocab_size': expected the backbone's {backbone.vocab_size}, "
                          f"got {cfg.vocab_size}")
    if cfg.main_hidden_dim != cfg.n_taps * backbone.dim:
        raise ConfigError(f"draft config: its width {cfg.main_hidden_dim // cfg.n_taps} ('dim' / 'hidden_size') "
                          f"differs from the backbone's {backbone.dim}")
    # A draft config that records its target's depth (DeepSpec's `num_target_layers`) was trained on it.
    depth = getattr(cfg, "num_target_layers", backbone.n_layers)
    if depth != backbone.n_layers:
        raise ConfigError(f"draft config field 'num_target_layers': expected the backbone's {backbone.n_layers} "
                          f"layers, got {depth}")
    try:
        tap_state_ids(cfg.target_layer_ids, tap_mode, backbone.n_layers)
    except ValueError as err:
        raise ConfigError(f"draft config field 'target_layer_ids': {str(err).removeprefix('forward: ')}") from None


class Weights(NamedTuple):
    backbone: Any
    draft: Any
    tied: dict
    # STS temperatures (ones = uncalibrated): f32[K] for both couplings, or f32[2, K] (optimal, invariant) when
    # the drafter-invariant coupling, whose acceptance is lower, has its own calibration
    temperatures: jax.Array


class RoundState(NamedTuple):
    cache: Any  # backbone KV cache (committed length per row)
    draft: Any  # the draft family's inference state (a NamedTuple with `length`)
    anchor: jax.Array  # i32[B] the last emitted token, not yet processed by the backbone
    conf_lag: jax.Array  # f32[2, B, K] calibrated confidences of the previous two rounds (async)


class RoundOutput(NamedTuple):
    tokens: jax.Array  # i32[B, K+1] emitted this round, -1 after the last (all -1 for inactive rows)
    num_emitted: jax.Array  # i32[B] (0 for inactive rows)
    num_accepted: jax.Array  # i32[B]
    num_verify: jax.Array  # i32[B] admitted drafts l_r
    conf: jax.Array  # f32[B, K] calibrated conditional confidences
    conf_logits: jax.Array  # f32[B, K] raw confidence logits (calibration records)


def init_state(model: SpecModel, batch: int, max_len: int) -> RoundState:
    k = model.block_size
    return RoundState(model.backbone.init_cache(batch, max_len), drafts.init_state(model.cfg, batch, max_len),
                      jnp.zeros((batch,), jnp.int32), jnp.zeros((2, batch, k), jnp.float32))


def backbone_forward(model: SpecModel, params, cache, tokens, logits_at=None):
    """The backbone forward with the taps the draft reads."""
    return model.backbone.forward(params, cache, tokens, taps=model.cfg.target_layer_ids, tap_mode=model.tap_mode,
                                  logits_at=logits_at)


def start(model: SpecModel, weights: Weights, state: RoundState, prompt: jax.Array, prompt_len: jax.Array,
          joining: jax.Array, params: sampling.SamplingParams, seeds: jax.Array) -> tuple[RoundState, jax.Array]:
    """Prefill the `joining` rows with their prompts (i32[B, P], lengths i32[B]) and draw their first
    token. Other rows keep their state (the forward writes past their committed length, which is never
    visible)."""
    cache = state.cache._replace(length=jnp.where(joining, 0, state.cache.length))
    dstate = drafts.reset_rows(state.draft, joining)
    out = backbone_forward(model, weights.backbone, cache, prompt)
    n = jnp.where(joining, prompt_len, 0).astype(jnp.int32)
    cache = model.backbone.commit(out.cache, n)
    dstate = drafts.ingest(weights.draft, model.cfg, dstate, out.taps, n, impl=model.impl)
    last = jnp.take_along_axis(out.logits, jnp.maximum(prompt_len - 1, 0)[:, None, None], axis=1)[:, 0]
    first = sampling.sample(last, params, seeds, prompt_len, sampling.Stream.RESAMPLE)
    anchor = jnp.where(joining, first, state.anchor)
    conf_lag = jnp.where(joining[None, :, None], 0.0, state.conf_lag)
    return RoundState(cache, dstate, anchor, conf_lag), first


def draft_propose(model: SpecModel, weights: Weights, state: RoundState, params: sampling.SamplingParams,
                  seeds: jax.Array, filtering: bool) -> drafts.DraftOutput:
    return drafts.propose(weights.draft, weights.tied, model.cfg, state.draft, state.anchor, params, seeds,
                             impl=model.impl, filtering=filtering)


def admit(mode: str, conf: jax.Array, conf_lagged: jax.Array, num_drafts: jax.Array, *, num_verify=None,
          table: CostTable | None = None, min_gain: float = 0.0, budget_tokens=None,
          acceptance_scale=1.0) -> jax.Array:
    """Verify lengths i32[B] for this round; num_drafts i32[B] caps each row (-1 = inactive slot);
    `budget_tokens`, `acceptance_scale`: the async capacity's cost and acceptance models
    (schedule.async_capacity)."""
    if mode == "fixed":
        if num_verify is None:
            raise ValueError("mode 'fixed' needs num_verify")
        return jnp.where(num_drafts >= 0, jnp.clip(num_verify, 0, jnp.maximum(num_drafts, 0)), 0)
    if table is None:
        raise ValueError(f"mode {mode!r} schedules against a measured cost table; none was given "
                         "(profile one with `dspark profile`, or use mode 'fixed')")
    if mode == "sync":
        return schedule_sync(conf, table, num_drafts)
    if mode == "async":
        return schedule_async(conf, conf_lagged, table, min_gain, num_drafts, budget_tokens, acceptance_scale)
    raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")


def row_temperatures(temperatures: jax.Array, invariant: jax.Array) -> jax.Array:
    """Each row's STS temperatures, f32[B, K], from `Weights.temperatures` (f32[K], or f32[2, K]: optimal,
    invariant) and the rows' couplings (bool[B])."""
    if temperatures.ndim == 1:
        return jnp.broadcast_to(temperatures, invariant.shape + temperatures.shape)
    return jnp.where(invariant[:, None], temperatures[1], temperatures[0])


def draft_counts(active: jax.Array, width: int, draft_cap: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array]:
    """-> (cap i32[B]: the drafts each row may verify in a round of this width, num_drafts: cap for the
    active rows and -1 for the others, the schedulers' padding marker)."""
    cap = (jnp.full(active.shape, width - 1, jnp.int32) if draft_cap is None
           else jnp.clip(draft_cap, 0, width - 1))
    return cap, jnp.where(active, cap, -1)


def spec_round(model: SpecModel, weights: Weights, state: RoundState, params: sampling.SamplingParams,
               seeds: jax.Array, active: jax.Array, *, width: int, mode: str = "fixed",
               num_verify: jax.Array | None = None, draft_cap: jax.Array | None = None,
               table: CostTable | None = None, min_gain: float = 0.0, budget_tokens=None,
               acceptance_scale=1.0, filtering: bool = True) -> tuple[RoundState, RoundOutput]:
    """One round for every slot. `width` (static, 1..K+1) is the verify forward's token count: the
    host picks it so compute follows the admitted count; admitted lengths are clipped to width - 1.
    `draft_cap` i32[B] optionally limits drafts per row (e.g. tokens left before max_tokens)."""
    k = model.block_size
    if not 1 <= width <= k + 1:
        raise ValueError(f"width: expected 1..{k + 1}, got {width}")
    length = state.draft.length
    out = (model.propose_fn or draft_propose)(model, weights, state, params, seeds, filtering)
    conf = jax.nn.sigmoid(out.conf_logits / row_temperatures(weights.temperatures, params.invariant))
    cap, num_drafts = draft_counts(active, width, draft_cap)
    lengths = admit(mode, conf, state.conf_lag[1], num_drafts, num_verify=num_verify, table=table,
                    min_gain=min_gain, budget_tokens=budget_tokens, acceptance_scale=acceptance_scale)
    lengths = jnp.where(active, jnp.clip(lengths, 0, cap), 0)

    verify_tokens = jnp.concatenate([state.anchor[:, None], out.tokens], axis=1)[:, :width]
    bo = backbone_forward(model, weights.backbone, state.cache, verify_tokens)
    target = jnp.pad(bo.logits, ((0, 0), (0, k + 1 - width), (0, 0)))  # rows >= width are never read
    res = verify_and_accept(target, out.tokens, out.logits, lengths, params, seeds, length + 1)

    n_commit = jnp.where(active, res.num_accepted + 1, 0)  # the anchor and the accepted drafts
    cache = model.backbone.commit(bo.cache, n_commit)
    dstate = drafts.ingest(weights.draft, model.cfg, state.draft, bo.taps, n_commit, impl=model.impl)
    emitted_last = jnp.take_along_axis(res.tokens, res.num_accepted[:, None], axis=1)[:, 0]
    anchor = jnp.where(active, emitted_last, state.anchor)
    conf_lag = jnp.stack([jnp.where(active[:, None], conf, 0.0), state.conf_lag[0]])
    output = RoundOutput(jnp.where(active[:, None], res.tokens, -1), jnp.where(active, res.num_emitted, 0),
                         jnp.where(active, res.num_accepted, 0), lengths, conf, out.conf_logits)
    return RoundState(cache, dstate, anchor, conf_lag), output


def plain_step(model: SpecModel, weights: Weights, state: RoundState, params: sampling.SamplingParams,
               seeds: jax.Array, active: jax.Array) -> tuple[RoundState, jax.Array]:
    """Plain autoregressive decoding (no draft): the reference speculative decoding must match.
    Emits i32[B] (-1 for inactive rows) with the same keys a round with l_r = 0 uses."""
    length = state.cache.length
    bo = model.backbone.forward(weights.backbone, state.cache, state.anchor[:, None])  # no taps: no draft
    token = sampling.sample(bo.logits[:, 0], params, seeds, length + 1, sampling.Stream.RESAMPLE)
    cache = model.backbone.commit(bo.cache, active.astype(jnp.int32))
    anchor = jnp.where(active, token, state.anchor)
    return state._replace(cache=cache, anchor=anchor), jnp.where(active, token, -1)
