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

Draft families. These public functions are the draft interface of every family and dispatch on
`cfg.family` (`FAMILY_MODULES`, a small registry): "deepseek_v41" is implemented here, "qwen3" (the
DeepSpec drafts for Qwen3 targets) in `dspark_jax.deepspec`. A family module provides init_params,
abstract_params, param_logical_axes, param_shardings, init_state(cfg, batch, max_len), ingest, prefill
and propose (-> DraftOutput); its state is a NamedTuple with an i32[B] `length` field. Each family's config
says which backbone taps it reads (`cfg.tap_mode`: "entry" for V4.1, "output" for DeepSpec).
"""

from __future__ import annotations

import functools
import importlib
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax import sampling
from dspark_jax.config import DSparkConfig
from dspark_jax.heads import markov_sample_loop
from dspark_jax.nn.attention import WindowAttention
from dspark_jax.nn.head import f32_head_logits
from dspark_jax.nn.linear import Linear
from dspark_jax.nn.mhc import HyperConnection, hc_post, hc_pre, one_hot_pre
from dspark_jax.nn.moe import MoE
from dspark_jax.nn.norm import RMSNorm, rms_norm
from dspark_jax.nn.params import param

# family -> module implementing it (imported on first use; "deepseek_v41" is this module).
FAMILY_MODULES = {"qwen3": "dspark_jax.deepspec"}


def family_module(cfg):
    """The module implementing `cfg`'s draft family, or None for V4.1 (this module)."""
    family = getattr(cfg, "family", "deepseek_v41")
    if family == "deepseek_v41":
        return None
    if family not in FAMILY_MODULES:
        raise ValueError(f"draft family {family!r}: expected one of {['deepseek_v41', *FAMILY_MODULES]}")
    return importlib.import_module(FAMILY_MODULES[family])


class DraftState(NamedTuple):
    ring: jax.Array  # [n_layers, B, W, hd]: per-block context KV rows at slot position % W
    length: jax.Array  # i32[B]: context positions written (p + 1)


class DraftOutput(NamedTuple):
    tokens: jax.Array  # i32[B, K] draft tokens x_1..x_K
    logits: jax.Array  # f32[B, K, V] the Markov-biased logits each token was sampled from (before 1/T)
    conf_logits: jax.Array  # f32[B, K] raw confidence logits z_k (calibrate, then sigmoid)
    markov_emb: jax.Array  # [B, K, r] W1[x_{k-1}]
    hidden: jax.Array  # [B, K, D] collapsed pre-norm hidden h_k


class Block(nn.Module):
    cfg: DSparkConfig
    impl: str = "auto"
    fp8_grad: str = "exact"  # gradient through the fp8 roundings (training: "straight_through")

    def setup(self):
        c = self.cfg
        hc = dict(hc=c.hc_mult, dim=c.dim, iters=c.hc_sinkhorn_iters, eps=c.hc_eps, norm_eps=c.norm_eps)
        self.attn_norm = RMSNorm(c.dim, c.norm_eps, c.param_dtype)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps, c.param_dtype)
        self.hc_attn = HyperConnection(**hc)
        self.hc_ffn = HyperConnection(**hc)
        self.attn = WindowAttention(c, impl=self.impl, fp8_grad=self.fp8_grad)
        self.ffn = MoE(c.dim, c.n_routed_experts, c.n_activated_experts, c.moe_inter_dim, c.n_shared_experts,
                       c.route_scale, c.score_func, c.norm_topk_prob, c.swiglu_limit, c.param_dtype,
                       c.compute_dtype, c.act_fp8, c.vision, self.fp8_grad)

    def context_kv(self, main_x: jax.Array, positions: jax.Array) -> jax.Array:
        return self.attn.kv(main_x, positions)

    def __call__(self, streams, pre_in, positions, ring_kv, ring_len):
        """Single-pass mHC block: each sub-layer collapses its input with the previous sub-layer's pre."""
        attn_pre, attn_post, attn_comb = self.hc_attn(streams)
        y = self.attn(self.attn_norm(hc_pre(streams, pre_in)), positions, ring_kv, ring_len)
        streams = hc_post(y, streams, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = self.hc_ffn(streams)
        y = self.ffn(self.ffn_norm(hc_pre(streams, attn_pre)))
        streams = hc_post(y, streams, ffn_post, ffn_comb)
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
            self.markov = _MarkovWeights(c.vocab_size, c.markov_rank, c.param_dtype)
        self.confidence = _ConfidenceWeights(c.dim + c.markov_rank, c.param_dtype)

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
        """(markov embed [V, r] | None, markov head [V, r] | None, confidence w [D + r], final norm scale)."""
        w1, w2 = self.markov() if self.cfg.markov_rank else (None, None)
        return w1, w2, self.confidence(), self.norm.variables["params"]["scale"]

    def init_all(self, main_hidden, positions, embeds, ring, ring_len):
        """Touches every parameter once (used by init only)."""
        self.context_rows(main_hidden, positions)
        self.norm(self.body(embeds, positions, ring, ring_len))
        return self.heads()


class _MarkovWeights(nn.Module):
    vocab: int
    rank: int
    param_dtype: str

    @nn.compact
    def __call__(self):
        # W1 starts small (std <= 0.02, SPEC 8) so an untrained Markov head barely moves the logits.
        init = nn.initializers.normal(stddev=0.02)
        w1 = param(self, "embed", init, (self.vocab, self.rank), self.param_dtype, ("vocab", "markov"))
        w2 = param(self, "head", init, (self.vocab, self.rank), self.param_dtype, ("vocab", "markov"))
        return w1, w2


class _ConfidenceWeights(nn.Module):
    in_dim: int
    param_dtype: str

    @nn.compact
    def __call__(self):
        return param(self, "kernel", nn.initializers.normal(stddev=self.in_dim ** -0.5), (self.in_dim,),
                     self.param_dtype, ("conf_in",))


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
    if (fam := family_module(cfg)) is not None:
        return fam.init_params(cfg, key)
    return nn.unbox(jax.jit(_init_boxed, static_argnums=0)(cfg, key))


def abstract_params(cfg: DSparkConfig) -> dict:
    """Shapes and dtypes only, nothing materialised."""
    if (fam := family_module(cfg)) is not None:
        return fam.abstract_params(cfg)
    return nn.unbox(jax.eval_shape(functools.partial(_init_boxed, cfg), jax.random.key(0)))


def param_logical_axes(cfg: DSparkConfig) -> dict:
    """The logical axis names of every parameter (a tree of PartitionSpec of names)."""
    if (fam := family_module(cfg)) is not None:
        return fam.param_logical_axes(cfg)
    return nn.get_partition_spec(jax.eval_shape(functools.partial(_init_boxed, cfg), jax.random.key(0)))


def count_params(tree) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(tree))


def ring_dtype(cfg: DSparkConfig):
    return jnp.dtype(cfg.compute_dtype)


def init_state(cfg: DSparkConfig, batch: int, max_len: int | None = None) -> DraftState:
    """The draft state of `batch` rows. `max_len` (the backbone cache length) sizes families that keep
    every committed context row (DeepSpec needs it); V4.1 keeps a ring of `window` rows and ignores it."""
    if (fam := family_module(cfg)) is not None:
        return fam.init_state(cfg, batch, max_len)
    return DraftState(jnp.zeros((cfg.n_layers, batch, cfg.window, cfg.head_dim), ring_dtype(cfg)),
                      jnp.zeros((batch,), jnp.int32))


def reset_rows(state: DraftState, rows: jax.Array) -> DraftState:
    """Forget the context of the rows where `rows` (bool[B]) is set (a slot got a new request); every
    family's state has a `length` field."""
    return state._replace(length=jnp.where(rows, 0, state.length))


def ingest(params: dict, cfg: DSparkConfig, state: DraftState, main_hidden: jax.Array, num_new: jax.Array,
           *, impl: str = "auto") -> DraftState:
    """Write the context rows of `num_new[b]` newly committed positions per request.

    main_hidden [B, T, n_taps*D] holds the backbone features of positions length .. length+T-1 (only the
    first num_new[b] are real). Rows that a later row of the same call would overwrite (T > W) are
    dropped so every ring slot gets exactly one writer: XLA leaves duplicate-index scatters unordered.
    """
    if (fam := family_module(cfg)) is not None:
        return fam.ingest(params, cfg, state, main_hidden, num_new, impl=impl)
    b, t, _ = main_hidden.shape
    positions = state.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
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
    if (fam := family_module(cfg)) is not None:
        return fam.prefill(params, cfg, state, main_hidden, num_valid, impl=impl)
    return ingest(params, cfg, DraftState(state.ring, jnp.zeros_like(state.length)), main_hidden, num_valid,
                  impl=impl)


def block_inputs(cfg: DSparkConfig, anchor: jax.Array) -> jax.Array:
    """[x0, noise x (K-1)] token ids, [B, K]."""
    noise = jnp.full((anchor.shape[0], cfg.block_size - 1), cfg.noise_token_id, jnp.int32)
    return jnp.concatenate([anchor[:, None].astype(jnp.int32), noise], axis=1)


def draft_hidden(params: dict, tied: dict, cfg: DSparkConfig, state: DraftState, anchor: jax.Array,
                 *, impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """The parallel part of a round: -> (h [B, K, D] pre-norm, base logits U f32[B, K, V])."""
    if (fam := family_module(cfg)) is not None:
        return fam.draft_hidden(params, tied, cfg, state, anchor)
    cd = jnp.dtype(cfg.compute_dtype)
    embeds = jnp.take(tied["embed"], block_inputs(cfg, anchor), axis=0).astype(cd)
    positions = state.length[:, None] + jnp.arange(cfg.block_size, dtype=jnp.int32)[None, :]
    model = DSparkDraft(cfg, impl)
    h = model.apply({"params": params}, embeds, positions, state.ring, state.length, method=DSparkDraft.body)
    base = base_logits(h, params["norm"]["scale"], tied["head"], cfg)
    return h, base


def base_logits(h: jax.Array, norm_scale: jax.Array, head: jax.Array, cfg: DSparkConfig) -> jax.Array:
    """U = f32(RMSNorm_final(h) @ head^T); the tied LM head is applied in f32 from its stored dtype."""
    return f32_head_logits(rms_norm(h, norm_scale, cfg.norm_eps), head)


def confidence_logits(h: jax.Array, markov_emb: jax.Array, w: jax.Array) -> jax.Array:
    """z_k = w . [h_k ; W1[x_{k-1}]] in f32, no bias (pre-norm h, SPEC 2.7)."""
    feats = jnp.concatenate([h.astype(jnp.float32), markov_emb.astype(jnp.float32)], axis=-1)
    return jnp.einsum("...i,i->...", feats, w.astype(jnp.float32), precision="highest")


def propose(params: dict, tied: dict, cfg: DSparkConfig, state: DraftState, anchor: jax.Array,
            sampling_params: sampling.SamplingParams, seeds: jax.Array, *, impl: str = "auto",
            filtering: bool = True) -> DraftOutput:
    """One draft block for each request: parallel body, then the Markov loop and the confidence head.

    Draft token k is sampled with key (seed, length + k, Stream.DRAFT). `filtering=False` promises that
    no request uses top-k / top-p, which lets the fused Pallas sampler run (`impl`).
    """
    if (fam := family_module(cfg)) is not None:
        return fam.propose(params, tied, cfg, state, anchor, sampling_params, seeds, impl=impl, filtering=filtering)
    h, base = draft_hidden(params, tied, cfg, state, anchor, impl=impl)
    first_position = state.length + 1
    markov = params.get("markov")
    tokens, logits, emb = markov_sample_loop(
        base, anchor, None if markov is None else markov["embed"], None if markov is None else markov["head"],
        sampling_params, seeds, first_position, impl=impl, filtering=filtering)
    conf = confidence_logits(h, emb, params["confidence"]["kernel"])
    return DraftOutput(tokens, logits, conf, emb, h)


def param_shardings(cfg: DSparkConfig, mesh, params=None) -> dict:
    """NamedSharding for every draft parameter on `mesh` (experts over the `expert` axis, etc.).

    `params`: the tree to be placed, when it may hold packed kernels (weights at checkpoint precision,
    `dspark_jax.nn.packed`); each packed node then gets shardings derived from its dequantised kernel's
    (`packed.tree_shardings`). Without it the shardings are those of the dequantised tree."""
    from dspark_jax.nn.packed import tree_shardings

    if (fam := family_module(cfg)) is not None:
        shardings = fam.param_shardings(cfg, mesh)
    else:
        from dspark_jax.parallel import fit_shardings, logical_shardings

        shardings = fit_shardings(logical_shardings(param_logical_axes(cfg), mesh), abstract_params(cfg))
    return shardings if params is None else tree_shardings(shardings, params)
