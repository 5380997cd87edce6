"""DSpark drafts: every family behind one interface.

    cfg    = load_config("configs/tiny_v41.json")        # any family's config (registry.load_config)
    params = init_params(cfg, key)                       # or abstract_params(cfg) for shapes only
    state  = init_state(cfg, batch, max_len)
    state  = prefill(params, cfg, state, main_hidden, num_valid)   # seed the context from the prompt
    out    = propose(params, tied, cfg, state, anchor, sampling, seeds)   # one draft block -> DraftOutput
    state  = ingest(params, cfg, state, main_hidden, num_new)     # context of newly committed positions

Each function asks the registry for the config's family (`registry.family_of`) and calls its
implementation: `v41/` (DeepSeek-V4.1, SPEC 2) and `deepspec/` (DeepSpec drafts for Qwen3, SPEC 4), both
with the same file split (config, model, heads, train_forward). `base.DraftFamily` is the protocol.
"""

from __future__ import annotations

import jax

from dspark_jax.drafts.base import DraftActs, DraftFamily, DraftOutput, base_logits, block_inputs, reset_rows
from dspark_jax.drafts.registry import FAMILY_NAMES, config_from_dict, family_named, family_of, load_config

__all__ = [
    "DraftActs", "DraftFamily", "DraftOutput", "FAMILY_NAMES", "abstract_params", "base_logits", "block_inputs",
    "config_from_dict", "count_params", "family_named", "family_of", "ingest", "init_params", "init_state",
    "load_config", "param_logical_axes", "param_shardings", "prefill", "propose", "reset_rows", "train_forward",
]


def init_params(cfg, key: jax.Array) -> dict:
    """Random parameters of the config's family (the tree its checkpoint table documents)."""
    return family_of(cfg).init_params(cfg, key)


def abstract_params(cfg) -> dict:
    """Shapes and dtypes only, nothing materialised."""
    return family_of(cfg).abstract_params(cfg)


def param_logical_axes(cfg) -> dict:
    """The logical axis names of every parameter (a tree of PartitionSpec of names)."""
    return family_of(cfg).param_logical_axes(cfg)


def param_shardings(cfg, mesh, params=None) -> dict:
    """NamedSharding for every draft parameter on `mesh` (by logical names, `dspark_jax.parallel`).

    `params`: the tree to be placed, when it may hold packed kernels (weights at checkpoint precision,
    `dspark_jax.nn.packed`); each packed node then gets shardings derived from its dequantised kernel's
    (`packed.tree_shardings`). Without it the shardings are those of the dequantised tree."""
    from dspark_jax.nn.packed import tree_shardings  # noqa: PLC0415
    from dspark_jax.parallel import fit_shardings, logical_shardings  # noqa: PLC0415

    shardings = fit_shardings(logical_shardings(param_logical_axes(cfg), mesh), abstract_params(cfg))
    return shardings if params is None else tree_shardings(shardings, params)


def count_params(tree) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(tree))


def init_state(cfg, batch: int, max_len: int | None = None):
    """The inference state of `batch` rows. `max_len` (the backbone cache length) sizes families that keep
    every committed context row (DeepSpec needs it); V4.1 keeps a ring of `window` rows and ignores it."""
    return family_of(cfg).init_state(cfg, batch, max_len)


def prefill(params: dict, cfg, state, main_hidden: jax.Array, num_valid: jax.Array, *, impl: str = "auto"):
    """Seed the context from the prompt's backbone features (the draft body does not run)."""
    return family_of(cfg).prefill(params, cfg, state, main_hidden, num_valid, impl=impl)


def ingest(params: dict, cfg, state, main_hidden: jax.Array, num_new: jax.Array, *, impl: str = "auto"):
    """Add the context of `num_new[b]` newly committed positions per row; main_hidden [B, T, n_taps*D]
    holds the backbone features of positions length .. length+T-1 (only the first num_new[b] are real)."""
    return family_of(cfg).ingest(params, cfg, state, main_hidden, num_new, impl=impl)


def propose(params: dict, tied: dict, cfg, state, anchor: jax.Array, sampling_params, seeds: jax.Array, *,
            impl: str = "auto", filtering: bool = True) -> DraftOutput:
    """One draft block per request. Draft token k is sampled with key (seed, length + k,
    sampling.draft_stream(...)): DRAFT, or the target's RESAMPLE for invariant rows.
    `filtering=False` promises that no request uses top-k / top-p, which lets the fused Pallas sampler
    run (`impl`)."""
    return family_of(cfg).propose(params, tied, cfg, state, anchor, sampling_params, seeds, impl=impl,
                                  filtering=filtering)


def train_forward(params: dict, tied: dict, cfg, main_hidden: jax.Array, blocks, anchors: jax.Array, *,
                  detach_conf_inputs: bool = False, impl: str = "xla", fp8_grad: str = "exact") -> DraftActs:
    """The teacher-forced forward of B*N training blocks (SPEC 8); see the family's train_forward."""
    return family_of(cfg).train_forward(params, tied, cfg, main_hidden, blocks, anchors,
                                        detach_conf_inputs=detach_conf_inputs, impl=impl, fp8_grad=fp8_grad)
