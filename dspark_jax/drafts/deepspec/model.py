"""The DeepSpec DSpark draft for Qwen3 targets (the "qwen3" draft family), SPEC section 4.

DeepSeek's DeepSpec trains DSpark drafts for Qwen3 targets (released as
`deepseek-ai/dspark_qwen3_{4b,8b,14b}_block7`, architecture `Qwen3DSparkModel`): N Qwen3 decoder layers
at the target's width whose attention also reads the TARGET's features as extra keys and values.

    c_p   = hidden_norm(fc(concat(taps_p)))          once per committed position p (taps = OUTPUTS of the
                                                     target layers `target_layer_ids`, -1 = embeddings)
    layer l, block rows x (slot k at position anchor + k, inputs [anchor, mask x (K-1)]):
      h = input_layernorm(x)
      q = rope(q_norm(q_proj(h)))                    queries from the block only
      K = [rope(k_norm(k_proj(c_p))) for every committed p ; rope(k_norm(k_proj(h)))]   context rows first
      V = [v_proj(c_p) ...                              ; v_proj(h)]
      x = x + o_proj(softmax(q K^T / sqrt(hd)) V)    no mask inside the block (bidirectional)
      x = x + down(silu(gate(post_attention_layernorm(x))) * up(...))
    h_final = norm(x);  U = lm_head(h_final) (the target's head, tied)
    Markov head (shared with V4.1, `drafts/markov.py`): logits_k = U_k + W2 m_k, m_k = W1[x_{k-1}] for the
    vanilla head (the gated and recurrent heads of `markov_head_type` also read h_final_k)
    confidence: z_k = proj([h_final_k ; W1[x_{k-1}]]) + bias     (post-norm h, WITH a bias)

RoPE is split-half ("rotate_half", `apply_rope_split_half`) with the config's theta; a context row
sits at its absolute position, block slot k at anchor + k. At inference the block sees ALL cached
context rows (no window); in training each block sees the context strictly before its anchor.

Functional API (the family interface of `dspark_jax.drafts.base.DraftFamily`; config in `config.py`, the
confidence head in `heads.py`, the training forward in `train_forward.py`):

    params = init_params(cfg, key)                 # or abstract_params(cfg)
    state  = init_state(cfg, batch, max_len)       # per-layer context K/V of every committed position
    state  = prefill / ingest(params, cfg, state, main_hidden, n)
    out    = propose(params, tied, cfg, state, anchor, sampling, seeds)   -> DraftOutput

Parameter tree (layer params stacked on a leading "layers" axis; kernels [in, out]) and the DeepSpec
checkpoint names (`dspark_jax.checkpoint.deepspec` holds the mapping as data):
```
fc.kernel                 [n_taps*D, D]     fc.weight [D, n_taps*D]
hidden_norm.scale         [D]               hidden_norm.weight
layers.attn_norm.scale    [L, D]            layers.{i}.input_layernorm.weight
layers.q_proj.kernel      [L, D, H*hd]      layers.{i}.self_attn.q_proj.weight [H*hd, D]
layers.k_proj.kernel      [L, D, Hkv*hd]    layers.{i}.self_attn.k_proj.weight
layers.v_proj.kernel      [L, D, Hkv*hd]    layers.{i}.self_attn.v_proj.weight
layers.o_proj.kernel      [L, H*hd, D]      layers.{i}.self_attn.o_proj.weight [D, H*hd]
layers.q_norm.scale       [L, hd]           layers.{i}.self_attn.q_norm.weight
layers.k_norm.scale       [L, hd]           layers.{i}.self_attn.k_norm.weight
layers.ffn_norm.scale     [L, D]            layers.{i}.post_attention_layernorm.weight
layers.gate_proj.kernel   [L, D, F]         layers.{i}.mlp.gate_proj.weight [F, D]
layers.up_proj.kernel     [L, D, F]         layers.{i}.mlp.up_proj.weight [F, D]
layers.down_proj.kernel   [L, F, D]         layers.{i}.mlp.down_proj.weight [D, F]
norm.scale                [D]               norm.weight
markov.embed              [V, r]            markov_head.markov_w1.weight        (markov_rank > 0)
markov.head               [V, r]            markov_head.markov_w2.weight        (markov_rank > 0)
markov.gate.{kernel,bias} [D + r, r], [r]  markov_head.gate_proj.{weight [r, D + r], bias}   (gated head)
markov.joint.{kernel,bias} [2r + D, 3r], [3r]  markov_head.joint_proj.{weight [3r, 2r + D], bias}  (rnn head)
confidence.kernel         [D (+ r)]         confidence_head.proj.weight [1, D (+ r)]   (confidence head on)
confidence.bias           [1]               confidence_head.proj.bias [1]
(tied, from the target)   embed [V, D], head [V, D]   embed_tokens.weight, lm_head.weight
```
The `norm` / `markov` / `confidence` keys match the V4.1 tree so the trainer's loss code serves both.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax import sampling
from dspark_jax.drafts.base import ConfidenceWeights, DraftOutput, base_logits, block_inputs, block_positions
from dspark_jax.drafts.deepspec.config import DeepSpecConfig
from dspark_jax.drafts.deepspec.heads import confidence_logits
from dspark_jax.drafts.markov import MarkovHead, sample_block
from dspark_jax.nn.attention import KeySegment, grouped_query_attention
from dspark_jax.nn.linear import Linear
from dspark_jax.nn.norm import RMSNorm, rms_norm
from dspark_jax.nn.params import abstract_unboxed, init_unboxed, logical_axes_of
from dspark_jax.nn.qwen3_layer import Qwen3DecoderLayer
from dspark_jax.validation import is_int


# ---------------------------------------------------------------------------------------------------
# Modules (parameters declared once, with their logical axes, by the Flax modules)
# ---------------------------------------------------------------------------------------------------


class _DraftLayer(Qwen3DecoderLayer):
    """A Qwen3 decoder layer whose queries (the block's rows) also read the target's context rows."""

    def __call__(self, x, ctx, positions, ctx_visible):
        """Scan body: x [B, N, K, D] block rows at positions [B, N, K]; ctx = this layer's context
        (k, v) [B, S, Hkv, hd], shared by the N blocks of a row; ctx_visible bool[B, N, S]."""
        k_ctx, v_ctx = ctx

        def attend(q, k, v):  # every block row sees its visible context and its whole block
            segments = [KeySegment(k_ctx[:, None], v_ctx[:, None], ctx_visible[:, :, None, :]), KeySegment(k, v)]
            return grouped_query_attention(q, segments, scale=self.cfg.head_dim ** -0.5), None

        x, _ = self.residual(x, positions, attend)
        return x, None

    def context_kv(self, c, positions):
        """Scan body: context features c [B, T, D] at positions [B, T] -> this layer's (k, v)."""
        return c, self.keys_values(c, positions)


def _scan_layers(cfg: DeepSpecConfig):
    """The layer stack as one scan over layer-stacked parameters (a leading "layers" axis), with the two
    entry points a draft needs: the block body and the context K/V of committed positions."""
    common = dict(variable_axes={"params": 0}, split_rngs={"params": True}, length=cfg.num_hidden_layers,
                  metadata_params={nn.PARTITION_NAME: "layers"})
    return nn.scan(_DraftLayer, methods={"__call__": dict(in_axes=(0, nn.broadcast, nn.broadcast), **common),
                                         "context_kv": dict(in_axes=(nn.broadcast,), **common)})


class DeepSpecDraft(nn.Module):
    cfg: DeepSpecConfig

    def setup(self):
        c = self.cfg
        self.fc = Linear(c.main_hidden_dim, c.hidden_size, ("taps_embed", "embed"), c.param_dtype, c.compute_dtype)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.param_dtype)
        self.layers = _scan_layers(c)(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.param_dtype)
        if c.markov_rank:
            self.markov = MarkovHead(c.vocab_size, c.markov_rank, c.hidden_size, c.markov_head_type, c.param_dtype)
        if c.enable_confidence_head:
            self.confidence = ConfidenceWeights(c.confidence_in_dim, c.param_dtype, bias=True)

    def context_kv(self, main_hidden: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every layer's injected context keys and values: main_hidden [B, T, n_taps*D] at absolute
        positions [B, T] -> (K, V) [L, B, T, Hkv, hd]; c = hidden_norm(fc(taps)), K = rope(k_norm(k_proj(c)))
        at the row's position, V = v_proj(c)."""
        c = self.hidden_norm(self.fc(main_hidden)).astype(jnp.dtype(self.cfg.compute_dtype))
        _, (k, v) = self.layers.context_kv(c, positions)
        return k, v

    def body(self, x: jax.Array, positions: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array,
             ctx_visible: jax.Array) -> jax.Array:
        """x [B, N, K, D] block rows, context K/V [L, B, S, Hkv, hd], ctx_visible bool[B, N, S] -> pre-norm h."""
        x, _ = self.layers(x, (k_ctx, v_ctx), positions, ctx_visible)
        return x

    def init_all(self, main_hidden, positions, x, block_positions_):
        """Touches every parameter once (used by init only)."""
        k, v = self.context_kv(main_hidden, positions)
        h = self.norm(self.body(x, block_positions_, k, v, jnp.ones(x.shape[:2] + k.shape[2:3], bool)))
        return h, self.markov() if self.cfg.markov_rank else None, (
            self.confidence() if self.cfg.enable_confidence_head else None)


def _init_boxed(cfg: DeepSpecConfig, key: jax.Array) -> dict:
    cd = jnp.dtype(cfg.compute_dtype)
    k = cfg.block_size
    dummy = (jnp.zeros((1, 1, cfg.main_hidden_dim), cd), jnp.zeros((1, 1), jnp.int32),
             jnp.zeros((1, 1, k, cfg.hidden_size), cd), jnp.zeros((1, 1, k), jnp.int32))
    return DeepSpecDraft(cfg).init(key, *dummy, method=DeepSpecDraft.init_all)["params"]


def init_params(cfg: DeepSpecConfig, key: jax.Array) -> dict:
    """Random parameters (the tree in this module's docstring)."""
    return init_unboxed(_init_boxed, cfg, key)


def abstract_params(cfg: DeepSpecConfig) -> dict:
    return abstract_unboxed(_init_boxed, cfg)


def param_logical_axes(cfg: DeepSpecConfig) -> dict:
    return logical_axes_of(_init_boxed, cfg)


def context_kv(params: dict, cfg: DeepSpecConfig, main_hidden: jax.Array, positions: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """`DeepSpecDraft.context_kv` on a param tree."""
    return DeepSpecDraft(cfg).apply({"params": params}, main_hidden, positions, method=DeepSpecDraft.context_kv)


def draft_body(params: dict, cfg: DeepSpecConfig, x: jax.Array, positions: jax.Array, k_ctx: jax.Array,
               v_ctx: jax.Array, ctx_visible: jax.Array) -> jax.Array:
    """`DeepSpecDraft.body` on a param tree."""
    return DeepSpecDraft(cfg).apply({"params": params}, x, positions, k_ctx, v_ctx, ctx_visible,
                                    method=DeepSpecDraft.body)


# ---------------------------------------------------------------------------------------------------
# Inference state and the functional API
# ---------------------------------------------------------------------------------------------------


class DeepSpecState(NamedTuple):
    ctx_k: jax.Array  # [L, B, S, Hkv, hd] post-norm post-RoPE context keys, slot = absolute position
    ctx_v: jax.Array  # [L, B, S, Hkv, hd]
    length: jax.Array  # i32[B] context positions written (p + 1); the anchor sits at `length`


def init_state(cfg: DeepSpecConfig, batch: int, max_len: int | None = None) -> DeepSpecState:
    """Context K/V for `max_len` positions per row (the backbone cache's length: the draft keeps ALL
    committed context, not a window)."""
    if not (is_int(max_len) and max_len > 0):
        raise ValueError(f"init_state: the DeepSpec draft keeps every committed context row, so it needs "
                         f"'max_len' (a positive integer, the backbone cache length); got {max_len!r}")
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    cd = jnp.dtype(cfg.compute_dtype)
    return DeepSpecState(jnp.zeros(shape, cd), jnp.zeros(shape, cd), jnp.zeros((batch,), jnp.int32))


def ingest(params: dict, cfg: DeepSpecConfig, state: DeepSpecState, main_hidden: jax.Array, num_new: jax.Array,
           *, impl: str = "auto") -> DeepSpecState:
    """Write the context K/V of `num_new[b]` newly committed positions (main_hidden [B, T, n_taps*D] holds
    positions length .. length+T-1; only the first num_new[b] are real).

    Rows past num_new land at positions >= the new length: invisible (a query sees slots < length only)
    and rewritten by the call that later commits those positions. Writes past max_len are dropped."""
    del impl
    b, t, _ = main_hidden.shape
    positions = block_positions(state.length, t)
    k, v = context_kv(params, cfg, main_hidden, positions)
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    ctx_k = state.ctx_k.at[:, rows, positions].set(k.astype(state.ctx_k.dtype), mode="drop")
    ctx_v = state.ctx_v.at[:, rows, positions].set(v.astype(state.ctx_v.dtype), mode="drop")
    return DeepSpecState(ctx_k, ctx_v, state.length + num_new.astype(jnp.int32))


def prefill(params: dict, cfg: DeepSpecConfig, state: DeepSpecState, main_hidden: jax.Array, num_valid: jax.Array,
            *, impl: str = "auto") -> DeepSpecState:
    """Seed the context from the prompt's backbone features (the draft body does not run)."""
    return ingest(params, cfg, state._replace(length=jnp.zeros_like(state.length)), main_hidden, num_valid,
                  impl=impl)


def draft_hidden(params: dict, tied: dict, cfg: DeepSpecConfig, state: DeepSpecState, anchor: jax.Array,
                 *, impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """The parallel part of a round: -> (pre-norm h [B, K, D], base logits U f32[B, K, V])."""
    cd = jnp.dtype(cfg.compute_dtype)
    kk = cfg.block_size
    x = jnp.take(tied["embed"], block_inputs(cfg, anchor), axis=0).astype(cd)[:, None]  # [B, 1, K, D]
    positions = block_positions(state.length, kk)[:, None]
    s = state.ctx_k.shape[2]
    visible = (jnp.arange(s, dtype=jnp.int32)[None, :] < state.length[:, None])[:, None]  # every committed row
    h = draft_body(params, cfg, x, positions, state.ctx_k, state.ctx_v, visible)[:, 0]
    return h, base_logits(h, params["norm"]["scale"], tied["head"], cfg)


def propose(params: dict, tied: dict, cfg: DeepSpecConfig, state: DeepSpecState, anchor: jax.Array,
            sampling_params: sampling.SamplingParams, seeds: jax.Array, *, impl: str = "auto",
            filtering: bool = True) -> DraftOutput:
    """One draft block per request (as every family's `propose`): the parallel body, the shared Markov
    loop (draft token k keyed (seed, length + k, DRAFT)), the confidence head on the post-norm h.
    DraftOutput.hidden is the pre-norm h (as for V4.1)."""
    h, base = draft_hidden(params, tied, cfg, state, anchor, impl=impl)
    normed = rms_norm(h, params["norm"]["scale"], cfg.rms_norm_eps)  # the LM head's input, what the heads read
    tokens, logits, emb = sample_block(cfg.markov_head_type, params.get("markov"), base, anchor, normed,
                                       sampling_params, seeds, state.length + 1, impl=impl, filtering=filtering)
    conf = confidence_logits(params, cfg, normed, emb)
    return DraftOutput(tokens, logits, conf, emb, h)
