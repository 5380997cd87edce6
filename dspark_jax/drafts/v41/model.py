"""The DeepSeek-V4.1 DSpark draft ("deepseek_v41" family), SPEC sections 2 and 7.

Pure-functional API (params are an explicit pytree, the draft state is an explicit pytree):

    params = init_params(cfg, key)               # or abstract_params(cfg) for shapes only
    state  = init_state(cfg, batch)
    state  = prefill(params, cfg, state, main_hidden, num_valid)   # seed the rings from the prompt
    out    = propose(params, tied, cfg, state, anchor, sampling, seeds)   # one draft block
    state  = ingest(params, cfg, state, main_hidden, num_new)     # rows of newly committed positions

Positions: `state.length[b]` = p + 1, the number of backbone positions whose context rows were
written. The anchor sits at position `length`, draft row k (1-based) at `length + k - 1`, and the token
draft row k predicts at `length + k` (so `verify_and_accept(positions=state.length + 1)`).

The family's confidence head and Markov weights are in `heads.py`, its training forward in
`train_forward.py`; `dspark_jax.drafts` exposes the family-agnostic API that dispatches here.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax import sampling
from dspark_jax.drafts.base import ConfidenceWeights, DraftOutput, base_logits, block_inputs, block_positions
from dspark_jax.drafts.markov import MarkovHead, sample_block
from dspark_jax.drafts.v41.config import DSparkConfig
from dspark_jax.drafts.v41.heads import confidence_logits
from dspark_jax.nn.attention import WindowAttention
from dspark_jax.nn.linear import Linear
from dspark_jax.nn.mhc import MhcBlock, hc_pre, one_hot_pre
from dspark_jax.nn.moe import MoE
from dspark_jax.nn.norm import RMSNorm, rms_norm
from dspark_jax.nn.params import abstract_unboxed, init_unboxed, logical_axes_of
from dspark_jax.nn.rows import take_rows


class DraftState(NamedTuple):
    ring: jax.Array  # [n_layers, B, W, hd]: per-block context KV rows at slot position % W
    length: jax.Array  # i32[B]: context positions written (p + 1)


class Block(MhcBlock):
    """One draft block: the single-pass mHC block with the window attention and the MoE."""

    impl: str = "auto"
    fp8_grad: str = "exact"  # gradient through the fp8 roundings (training: "straight_through")

    def setup(self):
        super().setup()
        c = self.cfg
        self.attn = WindowAttention(c, impl=self.impl, fp8_grad=self.fp8_grad)
        self.ffn = MoE(c.dim, c.n_routed_experts, c.n_activated_experts, c.moe_inter_dim, c.n_shared_experts,
                       c.route_scale, c.score_func, c.norm_topk_prob, c.swiglu_limit, c.param_dtype,
                       c.compute_dtype, c.act_fp8, c.vision, self.fp8_grad, c.moe_routing)

    def context_kv(self, main_x: jax.Array, positions: jax.Array) -> jax.Array:
        return self.attn.kv(main_x, positions)

    def __call__(self, streams, pre_in, positions, ring_kv, ring_len):
        """Each sub-layer collapses its input with the previous sub-layer's pre (single pass)."""
        streams, ffn_pre, _ = self.mix(streams, pre_in, lambda x: (self.attn(x, positions, ring_kv, ring_len), None))
        return streams, ffn_pre


class DSparkDraft(nn.Module):
    cfg: DSparkConfig
    impl: str = "auto"
    fp8_grad: str = "exact"  # gradient through the fp8 roundings (training: "straight_through")

    def setup(self):
        c = self.cfg
        self.main_proj = Linear(c.main_hidden_dim, c.dim, ("taps_embed", "embed"), c.param_dtype, c.compute_dtype,
                                c.act_fp8, self.fp8_grad)
        self.main_norm = RMSNorm(c.dim, c.norm_eps, c.param_dtype)
        self.blocks = [Block(c, self.impl, self.fp8_grad, name=f"blocks_{s}") for s in range(c.n_layers)]
        self.norm = RMSNorm(c.dim, c.norm_eps, c.param_dtype)
        if c.markov_rank:
            self.markov = MarkovHead(c.vocab_size, c.markov_rank, c.dim, c.markov_head_type, c.param_dtype)
        self.confidence = ConfidenceWeights(c.dim + c.markov_rank, c.param_dtype)

    def context_rows(self, main_hidden: jax.Array, positions: jax.Array) -> jax.Array:
        """main_hidden [B, T, n_taps*D] at absolute positions [B, T] -> ring rows [n_layers, B, T, hd]."""
        main_x = self.main_norm(self.main_proj(main_hidden))
        return jnp.stack([blk.context_kv(main_x, positions) for blk in self.blocks])

    def body(self, embeds: jax.Array, positions: jax.Array, ring: jax.Array, ring_len: jax.Array) -> jax.Array:
        """Block input embeddings [B, K, D] -> collapsed pre-norm hidden h [B, K, D]."""
        c = self.cfg
        streams = jnp.broadcast_to(embeds[..., None, :], (*embeds.shape[:-1], c.hc_mult, c.dim))
        pre = one_hot_pre(c.hc_mult, embeds.shape[:-1])
        for s, blk in enumerate(self.blocks):
            streams, pre = blk(streams, pre, positions, ring[s], ring_len)
        return hc_pre(streams, pre)  # V4.1 has no hc_head: the last ffn_pre collapses the output

    def heads(self):
        """(the markov subtree | None, confidence w [D + r], final norm scale)."""
        markov = self.markov() if self.cfg.markov_rank else None
        return markov, self.confidence()["kernel"], self.norm.variables["params"]["scale"]

    def init_all(self, main_hidden, positions, embeds, ring, ring_len):
        """Touches every parameter once (used by init only)."""
        self.context_rows(main_hidden, positions)
        self.norm(self.body(embeds, positions, ring, ring_len))
        return self.heads()


# ---------------------------------------------------------------------------------------------------
# Functional API
# ---------------------------------------------------------------------------------------------------


def _dummy_inputs(cfg: DSparkConfig, batch: int = 1):
    cd = jnp.dtype(cfg.compute_dtype)
    k = cfg.block_size
    return (jnp.zeros((batch, k, cfg.main_hidden_dim), cd), jnp.zeros((batch, k), jnp.int32),
            jnp.zeros((batch, k, cfg.dim), cd), jnp.zeros((cfg.n_layers, batch, cfg.window, cfg.head_dim), cd),
            jnp.zeros((batch,), jnp.int32))


def _init_boxed(cfg: DSparkConfig, key: jax.Array):
    return DSparkDraft(cfg, impl="xla").init(key, *_dummy_inputs(cfg), method=DSparkDraft.init_all)["params"]


def init_params(cfg: DSparkConfig, key: jax.Array) -> dict:
    """Random parameters (the tree documented in docs/params.md)."""
    return init_unboxed(_init_boxed, cfg, key)


def abstract_params(cfg: DSparkConfig) -> dict:
    return abstract_unboxed(_init_boxed, cfg)


def param_logical_axes(cfg: DSparkConfig) -> dict:
    return logical_axes_of(_init_boxed, cfg)


def ring_dtype(cfg: DSparkConfig):
    return jnp.dtype(cfg.compute_dtype)


def init_state(cfg: DSparkConfig, batch: int, max_len: int | None = None) -> DraftState:
    """The draft state of `batch` rows. `max_len` (the backbone cache length) sizes families that keep
    every committed context row (DeepSpec needs it); V4.1 keeps a ring of `window` rows and ignores it."""
    return DraftState(jnp.zeros((cfg.n_layers, batch, cfg.window, cfg.head_dim), ring_dtype(cfg)),
                      jnp.zeros((batch,), jnp.int32))


def ingest(params: dict, cfg: DSparkConfig, state: DraftState, main_hidden: jax.Array, num_new: jax.Array,
           *, impl: str = "auto") -> DraftState:
    """Write the context rows of `num_new[b]` newly committed positions per request.

    main_hidden [B, T, n_taps*D] holds the backbone features of positions length .. length+T-1 (only the
    first num_new[b] are real). Rows that a later row of the same call would overwrite (T > W) are
    dropped so every ring slot gets exactly one writer: XLA leaves duplicate-index scatters unordered.
    """
    b, t, _ = main_hidden.shape
    positions = block_positions(state.length, t)
    rows = DSparkDraft(cfg, impl).apply({"params": params}, main_hidden, positions, method=DSparkDraft.context_rows)
    new_length = state.length + num_new
    keep = (jnp.arange(t)[None, :] < num_new[:, None]) & (positions >= new_length[:, None] - cfg.window)
    slot = jnp.where(keep, positions % cfg.window, cfg.window)  # out of range -> dropped
    batch_idx = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    ring = state.ring.at[:, batch_idx, slot].set(rows.astype(state.ring.dtype), mode="drop")
    return DraftState(ring, new_length)


def prefill(params: dict, cfg: DSparkConfig, state: DraftState, main_hidden: jax.Array, num_valid: jax.Array,
            *, impl: str = "auto") -> DraftState:
    """Seed the rings from the prompt's backbone features (the draft body does not run)."""
    return ingest(params, cfg, DraftState(state.ring, jnp.zeros_like(state.length)), main_hidden, num_valid,
                  impl=impl)


def draft_hidden(params: dict, tied: dict, cfg: DSparkConfig, state: DraftState, anchor: jax.Array,
                 *, impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """The parallel part of a round: -> (h [B, K, D] pre-norm, base logits U f32[B, K, V])."""
    cd = jnp.dtype(cfg.compute_dtype)
    embeds = take_rows(tied["embed"], block_inputs(cfg, anchor)).astype(cd)
    positions = block_positions(state.length, cfg.block_size)
    model = DSparkDraft(cfg, impl)
    h = model.apply({"params": params}, embeds, positions, state.ring, state.length, method=DSparkDraft.body)
    base = base_logits(h, params["norm"]["scale"], tied["head"], cfg)
    return h, base


def propose(params: dict, tied: dict, cfg: DSparkConfig, state: DraftState, anchor: jax.Array,
            sampling_params: sampling.SamplingParams, seeds: jax.Array, *, impl: str = "auto",
            filtering: bool = True) -> DraftOutput:
    """One draft block for each request: parallel body, then the Markov loop and the confidence head.

    Draft token k is sampled with key (seed, length + k, sampling.draft_stream(params)): DRAFT, or the target's RESAMPLE for invariant rows. `filtering=False` promises that
    no request uses top-k / top-p, which lets the fused Pallas sampler run (`impl`).
    """
    h, base = draft_hidden(params, tied, cfg, state, anchor, impl=impl)
    first_position = state.length + 1
    normed = rms_norm(h, params["norm"]["scale"], cfg.norm_eps)  # what the gated / recurrent heads read
    tokens, logits, emb = sample_block(cfg.markov_head_type, params.get("markov"), base, anchor, normed,
                                       sampling_params, seeds, first_position, impl=impl, filtering=filtering)
    conf = confidence_logits(params, cfg, h, emb)
    return DraftOutput(tokens, logits, conf, emb, h)
