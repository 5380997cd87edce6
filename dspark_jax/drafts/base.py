"""What every draft family provides (`DraftFamily`) and the pieces the families share.

A draft family is a folder (`drafts/v41/`, `drafts/deepspec/`) with the same file split: `config.py`
(its frozen config class), `model.py` (parameters, inference state, prefill / ingest / propose),
`heads.py` (its confidence head), `train_forward.py` (the teacher-forced forward of SPEC 8). Its
`__init__.py` holds one `DraftFamily` object; `drafts.registry` finds it by the config's `family`.

Shared contract of the inference state: a NamedTuple with an i32[B] `length` field, the number of
backbone positions whose context the draft holds (p + 1). The anchor sits at position `length`, draft
row k (1-based) at `length + k - 1`, and the token row k predicts at `length + k` (so
`verify_and_accept(positions=state.length + 1)`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.nn.head import f32_head_logits
from dspark_jax.nn.norm import rms_norm
from dspark_jax.nn.params import param

PyTree = Any


class DraftOutput(NamedTuple):
    """One proposed block per request (what the speculative round verifies)."""

    tokens: jax.Array  # i32[B, K] draft tokens x_1..x_K
    logits: jax.Array  # f32[B, K, V] the Markov-biased logits each token was sampled from (before 1/T)
    conf_logits: jax.Array  # f32[B, K] raw confidence logits z_k (calibrate, then sigmoid)
    markov_emb: jax.Array  # [B, K, r] W1[x_{k-1}]
    hidden: jax.Array  # [B, K, D] collapsed pre-norm hidden h_k


class DraftActs(NamedTuple):
    """The teacher-forced forward of B*N training blocks (flattened row-major)."""

    hidden: jax.Array  # [B*N, K, D] collapsed pre-norm h
    normed: jax.Array  # f32[B*N, K, D] RMSNorm_final(h), the LM head's input
    markov_emb: jax.Array | None  # [B*N, K, r] W1[prev], the confidence head's input (None without a head)
    markov_latent: jax.Array | None  # [B*N, K, r] z with Markov bias = W2 z (= W1[prev] for the vanilla head)
    conf_logits: jax.Array  # f32[B*N, K]


class DraftFamily(Protocol):
    """The interface of one draft family. Code outside `drafts/` holds a family object (from
    `registry.family_of(cfg)`) or calls the generic functions of `dspark_jax.drafts`; it never asks
    which family it holds."""

    name: str  # the config's `family` value ("deepseek_v41", "qwen3")
    tap_mode: str  # which backbone taps the draft reads: "entry" (V4.1) or "output" (DeepSpec)
    checkpoint_format: str  # the converter's name of the family's checkpoint layout ("v41", "deepspec")

    def claims(self, raw: dict) -> bool:
        """Whether a config dict is this family's (its own spelling or its upstream file)."""

    def config_from_dict(self, raw: dict, **overrides):
        """The family's frozen config from a dict (every accepted spelling)."""

    def init_params(self, cfg, key: jax.Array) -> PyTree: ...

    def abstract_params(self, cfg) -> PyTree:
        """Shapes and dtypes only, nothing materialised."""

    def param_logical_axes(self, cfg) -> PyTree:
        """Same tree as the params, each leaf a PartitionSpec of logical axis names."""

    def init_state(self, cfg, batch: int, max_len: int | None = None) -> PyTree:
        """The inference state of `batch` rows (`max_len`: the backbone cache length)."""

    def prefill(self, params, cfg, state, main_hidden, num_valid, *, impl: str = "auto") -> PyTree:
        """Seed the state from a prompt's backbone features (the draft body does not run)."""

    def ingest(self, params, cfg, state, main_hidden, num_new, *, impl: str = "auto") -> PyTree:
        """Add the context of `num_new[b]` newly committed positions per row."""

    def draft_hidden(self, params, tied, cfg, state, anchor, *, impl: str = "auto") -> tuple[jax.Array, jax.Array]:
        """The parallel half of `propose` (profiling): -> (pre-norm h [B, K, D], base logits f32[B, K, V])."""

    def propose(self, params, tied, cfg, state, anchor, sampling_params, seeds, *, impl: str = "auto",
                filtering: bool = True) -> DraftOutput:
        """One draft block per request."""

    def train_forward(self, params, tied, cfg, main_hidden, blocks, anchors, *, detach_conf_inputs: bool = False,
                      impl: str = "xla", fp8_grad: str = "exact") -> DraftActs:
        """The teacher-forced forward of SPEC 8 (blocks from `train.anchors.make_blocks`)."""

    def checkpoint_table(self, cfg) -> list:
        """The family's checkpoint mapping table expanded for `cfg` (`dspark_jax.checkpoint`)."""


class ConfidenceWeights(nn.Module):
    """The confidence head's weight w [in_dim] (and its bias [1] when `bias`: DeepSpec has one, V4.1 not).
    What the head reads and how it combines them is the family's (its `heads.confidence_logits`)."""

    in_dim: int
    param_dtype: str
    bias: bool = False

    @nn.compact
    def __call__(self) -> dict:
        out = {"kernel": param(self, "kernel", nn.initializers.normal(stddev=self.in_dim ** -0.5), (self.in_dim,),
                               self.param_dtype, ("conf_in",))}
        if self.bias:
            out["bias"] = param(self, "bias", nn.initializers.zeros, (1,), self.param_dtype, ("conf_out",))
        return out


def block_inputs(cfg, anchor: jax.Array) -> jax.Array:
    """[x0, noise x (K-1)] token ids, [B, K] (the noise / mask token is the family's `noise_token_id`)."""
    noise = jnp.full((anchor.shape[0], cfg.block_size - 1), cfg.noise_token_id, jnp.int32)
    return jnp.concatenate([anchor[:, None].astype(jnp.int32), noise], axis=1)


def block_positions(length: jax.Array, n: int) -> jax.Array:
    """Absolute positions i32[B, n] of n rows starting at `length` (a block: the anchor, then row k at
    length + k; an ingest: the newly committed positions)."""
    return length[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]


def base_logits(h: jax.Array, norm_scale: jax.Array, head: jax.Array, cfg) -> jax.Array:
    """U = f32(RMSNorm_final(h) @ head^T); the tied LM head is applied in f32 from its stored dtype."""
    return f32_head_logits(rms_norm(h, norm_scale, cfg.norm_eps), head)


def reset_rows(state, rows: jax.Array):
    """Forget the context of the rows where `rows` (bool[B]) is set (a slot got a new request)."""
    return state._replace(length=jnp.where(rows, 0, state.length))
