"""The Markov head, all three DeepSpec variants (SPEC 2.7, 4.1), shared by both draft families.

The math is pure functions on the `params["markov"]` dict; `MarkovHead` (a Flax module) declares those
parameters for the draft modules of both families. For draft slot k (0-based) with prev token p_k
(the anchor for slot 0, then the drafted / ground-truth token of slot k-1), e_k = W1[p_k], hidden h_k:

    vanilla: z_k = e_k
    gated:   z_k = sigmoid(gate([h_k, e_k])) * e_k
    rnn:     [a_k, c_k, o_k] = joint([s_k, e_k, h_k]);  u_k = sigmoid(a_k)
             s_{k+1} = u_k * s_k + (1 - u_k) * tanh(c_k);  z_k = tanh(o_k);  s_0 = 0 at every block start
    bias_k = W2 z_k  (f32[..., V]);  draft logits_k = base_k + bias_k

so every head is "an effective rank-r vector z_k, then the shared W2": the fused loss of the training code
works unchanged with its embedding input replaced by z (`teacher_forced_latents`). The confidence head
always reads the RAW e_k (never z, the gate or the state), for every head type.

Parameters (the `params["markov"]` subtree; kernels stored [in, out] as everywhere in this codebase, the
checkpoint's torch tensors are [out, in]; the names are `dspark_jax.checkpoint.deepspec`'s table):

    embed            [V, r]           markov_head.markov_w1.weight        (all heads)
    head             [V, r]           markov_head.markov_w2.weight        (all heads; stored as torch's [V, r])
    gate.kernel      [H + r, r]       markov_head.gate_proj.weight.T      (gated; rows 0..H-1 act on h, then e)
    gate.bias        [r]              markov_head.gate_proj.bias
    joint.kernel     [2r + H, 3r]     markov_head.joint_proj.weight.T     (rnn; rows: s, e, h; cols: a, c, o)
    joint.bias       [3r]             markov_head.joint_proj.bias

Which hidden h_k: DeepSpec feeds the final-normed hidden (the LM head's input) in training and in block
proposal. The V4.1 family has only a vanilla head officially; for the other heads the caller decides which
vector to pass (every function takes `hidden` as an argument).

Precision. By default every computation runs in f32 from the stored dtype (weights and hidden cast up,
matmuls at Precision.HIGHEST), and the bias is f32. DeepSpec's evaluator loads the bf16 checkpoint and runs
the whole head in bf16, recurrent state included (SPEC 4.1 "Precision"); `compute_dtype=jnp.bfloat16`
approximates that: inputs cast to bf16, each linear layer accumulated in f32 (bias added in f32) and
rounded to bf16 once, the nonlinearities and products in bf16, the state in bf16, and W2 z rounded to bf16
(returned as f32). `compute_dtype=jnp.float64` (under jax x64) is the exact reference used by the tests.

Head types are host-side Python strings: pass them as static arguments under jit.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax import sampling
from dspark_jax.kernels.markov_sampler import markov_sample
from dspark_jax.nn.params import param
from dspark_jax.nn.rounding import to_dtype
from dspark_jax.validation import MARKOV_HEAD_TYPES, is_markov_head_type

HEAD_TYPES = MARKOV_HEAD_TYPES
STATEFUL_HEAD_TYPES = ("rnn",)
_HIGHEST = jax.lax.Precision.HIGHEST

# ---------------------------------------------------------------------------------------------------
# Head types and parameters
# ---------------------------------------------------------------------------------------------------


def parse_head_type(value: Any) -> str:
    """The canonical head type ("vanilla" | "gated" | "rnn") of a config value, compared case-insensitively
    (surrounding spaces ignored, as DeepSpec's `str(...).lower()`); ValueError naming the valid values."""
    if is_markov_head_type(value):
        return value.strip().lower()
    raise ValueError(f"markov_head_type: expected one of {', '.join(repr(t) for t in HEAD_TYPES)} "
                     f"(case-insensitive), got {value!r}")


def is_stateful(head_type: str) -> bool:
    """True for heads that carry a recurrent state across the slots of a block (rnn)."""
    return parse_head_type(head_type) in STATEFUL_HEAD_TYPES


class MarkovHead(nn.Module):
    """The parameters of a Markov head of `head_type` (module docstring): W1 `embed` [V, r], W2 `head`
    [V, r], and the gated head's `gate` / the recurrent head's `joint` linear. Calling it returns the
    subtree as a dict (what the functions below take).

    Init: W1 and W2 small (std 0.02, SPEC 8: an untrained head barely moves the logits); the gate / joint
    kernels N(0, 0.02^2) and zero biases, as DeepSpec's Hugging Face `post_init` draws them."""

    vocab: int
    rank: int
    hidden: int  # H, the width of the hidden vector the gated / recurrent head reads
    head_type: str = "vanilla"
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self) -> dict:
        small = nn.initializers.normal(stddev=0.02)
        v, r, h = self.vocab, self.rank, self.hidden
        out = {"embed": param(self, "embed", small, (v, r), self.param_dtype, ("vocab", "markov")),
               "head": param(self, "head", small, (v, r), self.param_dtype, ("vocab", "markov"))}
        head_type = parse_head_type(self.head_type)
        if head_type == "gated":  # inputs [h ; e] -> a gate per rank component
            out["gate"] = _Affine(h + r, r, self.param_dtype, name="gate")()
        elif head_type == "rnn":  # inputs [s ; e ; h] -> [a ; c ; o]
            out["joint"] = _Affine(2 * r + h, 3 * r, self.param_dtype, name="joint")()
        return out


class _Affine(nn.Module):
    """kernel [in, out] and bias [out]: small, replicated (no sharding rule maps their axes)."""

    in_dim: int
    out_dim: int
    param_dtype: str

    @nn.compact
    def __call__(self) -> dict:
        kernel = param(self, "kernel", nn.initializers.normal(stddev=0.02), (self.in_dim, self.out_dim),
                       self.param_dtype, ("markov_in", "markov_out"))
        bias = param(self, "bias", nn.initializers.zeros, (self.out_dim,), self.param_dtype, ("markov_out",))
        return {"kernel": kernel, "bias": bias}


# ---------------------------------------------------------------------------------------------------
# One slot
# ---------------------------------------------------------------------------------------------------


def _acc_dtype(compute_dtype) -> jnp.dtype:
    """Accumulation / output dtype of the matmuls: f32, or f64 for an f64 computation."""
    return jnp.promote_types(jnp.dtype(compute_dtype), jnp.float32)


def _linear(x: jax.Array, layer: dict, cd) -> jax.Array:
    """x @ kernel + bias, accumulated in f32 (f64 for f64), rounded once to the compute dtype."""
    acc = _acc_dtype(cd)
    y = jnp.einsum("...i,io->...o", x.astype(cd), layer["kernel"].astype(cd), precision=_HIGHEST,
                   preferred_element_type=acc)
    return to_dtype(y + layer["bias"].astype(acc), cd)


def initial_state(head_type: str, params: dict, batch_shape: tuple[int, ...], compute_dtype=jnp.float32):
    """The state at a block start: zeros [*batch_shape, r] for rnn, None for the stateless heads."""
    if not is_stateful(head_type):
        return None
    return jnp.zeros((*batch_shape, params["embed"].shape[1]), compute_dtype)


def slot_latent(head_type: str, params: dict, prev_emb: jax.Array, hidden: jax.Array | None, state=None, *,
                compute_dtype=jnp.float32):
    """One slot: (z [..., r] in compute_dtype, new state). prev_emb = W1[p_k] [..., r] (stored dtype),
    hidden h_k [..., H] (unused by vanilla, may be None), state s_k [..., r] for rnn (None = the zero state
    of a block start); the stateless heads return new state None. bias_k = W2 z (`project`)."""
    head_type = parse_head_type(head_type)
    cd = jnp.dtype(compute_dtype)
    e = prev_emb.astype(cd)
    if head_type == "vanilla":
        return e, None
    if hidden is None:
        raise ValueError(f"markov head ({head_type}): needs the slot hidden state 'hidden', got None")
    h = hidden.astype(cd)
    if head_type == "gated":
        gate = jax.nn.sigmoid(_linear(jnp.concatenate([h, e], axis=-1), params["gate"], cd))
        return gate * e, None
    s = jnp.zeros_like(e) if state is None else state.astype(cd)
    a, c, o = jnp.split(_linear(jnp.concatenate([s, e, h], axis=-1), params["joint"], cd), 3, axis=-1)
    u = jax.nn.sigmoid(a)
    new_state = u * s + (1 - u) * jnp.tanh(c)
    return jnp.tanh(o), new_state


def project(params: dict, z: jax.Array, *, compute_dtype=jnp.float32) -> jax.Array:
    """bias = W2 z: z [..., r] -> f32[..., V] (f64 for an f64 computation). In bf16 the product is
    accumulated in f32 and rounded to bf16 once, as a bf16 nn.Linear."""
    cd = jnp.dtype(compute_dtype)
    acc = _acc_dtype(cd)
    bias = jnp.einsum("...r,vr->...v", z.astype(cd), params["head"].astype(cd), precision=_HIGHEST,
                      preferred_element_type=acc)
    return to_dtype(bias, cd).astype(acc)  # a rounding point that survives fusion (nn.rounding)


def slot_bias(head_type: str, params: dict, prev_emb: jax.Array, hidden: jax.Array | None, state=None, *,
              compute_dtype=jnp.float32):
    """One slot: (bias f32[..., V], new state); arguments as `slot_latent`.
    vanilla W2 e; gated W2 (sigmoid(gate([h, e])) * e); rnn W2 tanh(o) with a, c, o = joint([s, e, h])."""
    z, new_state = slot_latent(head_type, params, prev_emb, hidden, state, compute_dtype=compute_dtype)
    return project(params, z, compute_dtype=compute_dtype), new_state


# ---------------------------------------------------------------------------------------------------
# Teacher-forced (training): every slot of every block
# ---------------------------------------------------------------------------------------------------


def latents_from_embeddings(head_type: str, params: dict, prev_emb: jax.Array, hidden: jax.Array | None, *,
                            compute_dtype=jnp.float32) -> jax.Array:
    """z of every slot, prev_emb [..., K, r], hidden [..., K, H] -> [..., K, r]. vanilla and gated run on
    all slots at once; rnn is a lax.scan over the K slots from a zero state (one state per block)."""
    head_type = parse_head_type(head_type)
    if head_type != "rnn":
        return slot_latent(head_type, params, prev_emb, hidden, compute_dtype=compute_dtype)[0]
    if hidden is None:
        raise ValueError("markov head (rnn): needs the slot hidden states 'hidden', got None")
    cd = jnp.dtype(compute_dtype)
    e_t, h_t = jnp.moveaxis(prev_emb, -2, 0), jnp.moveaxis(hidden, -2, 0)  # [K, ..., *]

    def step(state, xs):
        z, state = slot_latent("rnn", params, xs[0], xs[1], state, compute_dtype=cd)
        return state, z

    _, z = jax.lax.scan(step, initial_state("rnn", params, e_t.shape[1:-1], cd), (e_t, h_t))
    return jnp.moveaxis(z, 0, -2)


def teacher_forced_latents(head_type: str, params: dict, prev: jax.Array, hidden: jax.Array | None, *,
                           compute_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """prev i32[..., K] (anchor, then the ground truth), hidden [..., K, H]
    -> (e = W1[prev] [..., K, r] in the stored dtype (the confidence head's input),
        z [..., K, r] in compute_dtype with bias = W2 z for every head type (the fused loss's input))."""
    emb = jnp.take(params["embed"], prev, axis=0)
    return emb, latents_from_embeddings(head_type, params, emb, hidden, compute_dtype=compute_dtype)


def draft_block_latents(cfg, params: dict, prev: jax.Array, hidden: jax.Array
                        ) -> tuple[jax.Array | None, jax.Array | None]:
    """The teacher-forced Markov inputs of a draft's training blocks: (e, z) as `teacher_forced_latents`
    for `cfg.markov_head_type`, or (None, None) for a draft without a Markov head (markov_rank 0)."""
    if not cfg.markov_rank:
        return None, None
    return teacher_forced_latents(cfg.markov_head_type, params["markov"], prev, hidden)


def teacher_forced_bias(head_type: str, params: dict, prev: jax.Array, hidden: jax.Array | None, *,
                        compute_dtype=jnp.float32) -> jax.Array:
    """The bias of every slot, f32[..., K, V] (materialised; for small vocabularies and tests)."""
    _, z = teacher_forced_latents(head_type, params, prev, hidden, compute_dtype=compute_dtype)
    return project(params, z, compute_dtype=compute_dtype)


# ---------------------------------------------------------------------------------------------------
# Inference: the sequential sampling loop of one block
# ---------------------------------------------------------------------------------------------------


def draft_noise(seeds: jax.Array, first_position: jax.Array, block: int, vocab: int,
                streams: jax.Array | int = sampling.Stream.DRAFT) -> jax.Array:
    """The Gumbel noise of draft tokens 1..K, f32[B, K, V] (keys (seed, first_position + k - 1, stream),
    streams one Stream or u32[B], e.g. `sampling.draft_stream`): what `sampling.sample` draws for each
    slot, as one array for the fused sampler."""
    first_position = jnp.asarray(first_position)
    positions = first_position[:, None] + jnp.arange(block, dtype=first_position.dtype)[None, :]
    streams = jnp.asarray(streams, jnp.uint32)
    return sampling.gumbel(jnp.broadcast_to(seeds[:, None], positions.shape), positions,
                           streams[:, None] if streams.ndim else streams, vocab)


def sample_block(head_type: str, params: dict | None, base: jax.Array, anchor: jax.Array,
                 hidden: jax.Array | None, sampling_params: sampling.SamplingParams, seeds: jax.Array,
                 first_position: jax.Array, *, compute_dtype=jnp.float32, impl: str = "auto",
                 filtering: bool = True):
    """Draft one block: for slot i = 0..K-1, bias from the prev token (the anchor, then the token drafted at
    i-1), the hidden h_i and the carried state (zero at the block start); logits_i = base_i + bias_i;
    token_i = sampling.sample(logits_i, sampling_params, seeds, first_position + i, stream) (the draft
    token i is keyed (seed, first_position + i, stream): first_position is the position of the block's
    first draft token; stream = `sampling.draft_stream`: DRAFT, or RESAMPLE for invariant rows).

    base f32[B, K, V] (the LM head's logits), anchor i32[B], hidden [B, K, H] (None for vanilla),
    params the markov subtree (None = no Markov head: every slot samples from its base logits)
    -> (tokens i32[B, K], biased logits f32[B, K, V] (what each token was sampled from, before
        temperature), Markov embeddings W1[prev] [B, K, r] (raw e, the confidence head's input)).

    filtering=False (temperature-only sampling) sends the vanilla head (f32 compute) to the fused sampler
    (`kernels.markov_sampler`, Pallas on TPU), which draws the same tokens; the other heads fall back to the
    reference scan below either way (it is exact for every filtering setting)."""
    b, k, v = base.shape
    stream = sampling.draft_stream(sampling_params)
    if params is None:
        tokens = jnp.stack([sampling.sample(base[:, i], sampling_params, seeds, first_position + i, stream)
                            for i in range(k)], axis=1)
        return tokens, base, jnp.zeros((b, k, 0), base.dtype)
    head_type = parse_head_type(head_type)
    cd = jnp.dtype(compute_dtype)
    w1 = params["embed"]
    if head_type == "vanilla" and not filtering and cd == jnp.float32:
        # Temperature-only sampling: the fused sampler (Pallas on TPU) draws with the same noise. Greedy
        # rows ignore their noise, so a batch of greedy rows alone draws none. The gated and recurrent
        # heads are not fused: they take the scan below, which is exact for every setting.
        noise = jax.lax.cond(jnp.all(sampling_params.temperature <= 0.0), lambda: jnp.zeros((b, k, v), jnp.float32),
                             lambda: draft_noise(seeds, first_position, k, v, stream))
        tokens, _, emb, logits = markov_sample(base, anchor, w1, params["head"], sampling_params.temperature,
                                               noise, return_logits=True, impl=impl)
        return tokens, logits, emb
    if head_type != "vanilla" and hidden is None:
        raise ValueError(f"markov head ({head_type}): sample_block needs the slot hidden states 'hidden' "
                         f"[B, K, H], got None")
    hid = jnp.zeros((k, b, 0), cd) if hidden is None else jnp.swapaxes(hidden, 0, 1)

    def step(carry, xs):
        prev, state = carry
        base_i, hidden_i, offset = xs
        emb = jnp.take(w1, prev, axis=0)
        bias, state = slot_bias(head_type, params, emb, hidden_i, state, compute_dtype=cd)
        logits = base_i + bias
        token = sampling.sample(logits, sampling_params, seeds, first_position + offset, stream)
        return (token, state), (token, logits, emb)

    carry = (anchor.astype(jnp.int32), initial_state(head_type, params, (b,), cd))
    _, (tokens, logits, emb) = jax.lax.scan(step, carry, (jnp.swapaxes(base, 0, 1), hid,
                                                          jnp.arange(k, dtype=jnp.int32)))
    return jnp.swapaxes(tokens, 0, 1), jnp.swapaxes(logits, 0, 1), jnp.swapaxes(emb, 0, 1)
