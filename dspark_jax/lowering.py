"""Lower the serving programs for a platform and mesh that this host does not have (a TPU pod).

Nothing is materialised: parameters, decode state and request rows are `jax.ShapeDtypeStruct`s that
carry `NamedSharding`s on a `jax.sharding.AbstractMesh`, and `jax.export` lowers each program the engine
runs (`serve/decode_state.py`: admit, the speculative round in every admission mode, the plain round,
the deferred-ingest catch-up, evict) plus the draft's `propose` and `verify_and_accept` on their own.
The kernel dispatch is told the platform through the impl string (`kernels/_common.py`:
`for_platform("pallas", "tpu")` = "pallas@tpu"), so a CPU host gets the Mosaic kernels, not their
interpret mode.

    mesh = pod_mesh(data=2, expert=4)                      # 8 chips, nothing attached
    pair = flash_pair("pallas")                            # V4.1-Flash draft + an mhc backbone at dim 5120
    for name, exported in lower_serving_programs(pair, mesh, platform="tpu").items(): ...

`dspark bench memory` reads the byte counts off these programs; `tests/test_lowering.py` checks them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from dspark_jax import configs
from dspark_jax import drafts
from dspark_jax import sampling
from dspark_jax import spec_round as sr
from dspark_jax.backbones.mhc import MhcBackbone, MhcConfig
from dspark_jax.drafts.v41.config import DSparkConfig
from dspark_jax.kernels._common import for_platform
from dspark_jax.parallel import MESH_AXES
from dspark_jax.schedule import CostTable
from dspark_jax.serve import decode_state as ds
from dspark_jax.verify import verify_and_accept

FLASH_CONFIG = configs.path("deepseek_v41_flash.json")
MODES = ("fixed", "sync", "async")  # "off", "fixed" and the async probes all run the "fixed" program


@dataclasses.dataclass(frozen=True)
class Pair:
    """A speculative pair described by shapes only: the model (static) and its abstract weights."""

    model: sr.SpecModel
    weights: sr.Weights  # leaves are ShapeDtypeStructs (no shardings yet)
    slots: int = 8
    max_len: int = 1024
    max_stops: int = 4
    prompt_len: int = 128


def pod_mesh(data: int = 1, fsdp: int = 1, expert: int = 1, tensor: int = 1) -> AbstractMesh:
    """An abstract mesh with our four named axes (parallel.MESH_AXES); no devices needed."""
    return AbstractMesh((data, fsdp, expert, tensor), MESH_AXES)


def flash_config(**changes) -> DSparkConfig:
    return DSparkConfig.from_json(FLASH_CONFIG).replace(**changes)


def flash_backbone(cfg: DSparkConfig, n_layers: int | None = None) -> MhcBackbone:
    """An mhc backbone at the draft's width with enough layers for its taps (a stand-in for V4.1's own:
    the draft reads only its taps, embedding and head). Dense FFN, bf16."""
    n_layers = n_layers or max(cfg.target_layer_ids) + 1
    return MhcBackbone(MhcConfig(
        dim=cfg.dim, vocab_size=cfg.vocab_size, n_layers=n_layers, hc_mult=cfg.hc_mult, n_heads=cfg.n_heads,
        head_dim=cfg.head_dim, rope_head_dim=cfg.rope_head_dim, q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, inter_dim=cfg.moe_inter_dim, param_dtype="bfloat16", compute_dtype="bfloat16"))


def flash_pair(impl: str = "auto", *, cfg: DSparkConfig | None = None, draft_params=None, slots: int = 8,
               max_len: int = 1024) -> Pair:
    """The V4.1-Flash draft (configs/deepseek_v41_flash.json, or `cfg`) over `flash_backbone`, abstract
    weights. `draft_params` replaces the draft's abstract tree (e.g. one at checkpoint precision)."""
    cfg = cfg or flash_config()
    bb = flash_backbone(cfg)
    model = sr.SpecModel(bb, cfg, impl=impl)
    backbone = bb.abstract_params()
    weights = sr.Weights(backbone, draft_params if draft_params is not None else drafts.abstract_params(cfg),
                         jax.eval_shape(bb.tied, backbone), jax.ShapeDtypeStruct((cfg.block_size,), jnp.float32))
    return Pair(model, weights, slots=slots, max_len=max_len)


def _with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _replicated(tree, mesh):
    return _with_shardings(tree, jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), tree))


def sharded_weights(pair: Pair, mesh) -> sr.Weights:
    """The pair's abstract weights with the engine's shardings on `mesh` (ds.weight_shardings)."""
    return _with_shardings(pair.weights, ds.weight_shardings(pair.model, pair.weights, mesh))


def sharded_state(pair: Pair, mesh) -> ds.DecodeState:
    state = jax.eval_shape(lambda: ds.init(pair.model, pair.slots, pair.max_len, pair.max_stops,
                                           max_deferred=32))
    return _with_shardings(state, ds.state_shardings(pair.model, state, pair.max_len, mesh))


def _joining(pair: Pair, mesh) -> ds.Joining:
    j, p, s = pair.slots, pair.prompt_len, pair.max_stops
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    rows = ds.Joining(i32(j), i32(j, p), i32(j),
                      sampling.SamplingParams(jax.ShapeDtypeStruct((j,), jnp.float32), i32(j),
                                              jax.ShapeDtypeStruct((j,), jnp.float32),
                                              jax.ShapeDtypeStruct((j,), jnp.bool_)),
                      jax.ShapeDtypeStruct((j,), jnp.uint32), i32(j), i32(j, s))
    return _replicated(rows, mesh)


def cost_table(pair: Pair) -> CostTable:
    """A cost table of the engine's shape (a few batch-token samples; the values do not matter here)."""
    k, b = pair.model.block_size, pair.slots
    tokens = np.asarray([b * w for w in (1, 2, 4, k + 1)], np.int32)
    return CostTable(tokens, np.linspace(100.0, 40.0, len(tokens)).astype(np.float32), max_batch_tokens=b * (k + 1))


def serving_programs(pair: Pair, mesh) -> dict:
    """name -> (jitted function, abstract arguments, static keyword arguments) of every program the
    engine and the draft interface run."""
    model, k, max_len = pair.model, pair.model.block_size, pair.max_len
    weights, state = sharded_weights(pair, mesh), sharded_state(pair, mesh)
    table = _replicated(jax.eval_shape(lambda: cost_table(pair)), mesh)
    rows = _replicated(jax.ShapeDtypeStruct((pair.slots,), jnp.int32), mesh)
    progs = {"admit": (ds.ADMIT, (model, weights, state, _joining(pair, mesh)), dict(max_len=max_len))}
    for mode in MODES:
        progs[f"spec_round/{mode}"] = (ds.SPEC_ROUNDS, (model, weights, state, table if mode != "fixed" else None),
                                       dict(rounds=1, max_len=max_len, width=k + 1, mode=mode,
                                            num_verify=k if mode == "fixed" else None, filtering=False))
    progs["plain_round"] = (ds.PLAIN_ROUNDS, (model, weights, state), dict(rounds=1, max_len=max_len,
                                                                            ingest_draft=True))
    progs["catch_up"] = (ds.CATCH_UP, (model, weights, state), dict(width=32))
    progs["evict"] = (ds.EVICT, (state, rows), {})
    progs["propose"] = (_PROPOSE, (model, weights, state.round.draft, state.round.anchor, state.slots.params,
                                   state.slots.seeds), {})
    progs["verify_and_accept"] = (_VERIFY, _verify_args(pair, mesh, state), {})
    return progs


def _propose(model, weights, dstate, anchor, params, seeds):
    return drafts.propose(weights.draft, weights.tied, model.cfg, dstate, anchor, params, seeds, impl=model.impl,
                             filtering=False)


_PROPOSE = jax.jit(_propose, static_argnums=0)
_VERIFY = jax.jit(verify_and_accept)


def _verify_args(pair: Pair, mesh, state: ds.DecodeState):
    b, k, v = pair.slots, pair.model.block_size, pair.model.cfg.vocab_size
    batch = state.slots.seeds.sharding.spec[0]

    def at(*shape, dtype=jnp.float32):
        spec = PartitionSpec(batch, *([None] * (len(shape) - 1)))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    return (at(b, k + 1, v), at(b, k, dtype=jnp.int32), at(b, k, v), at(b, dtype=jnp.int32), state.slots.params,
            state.slots.seeds, at(b, dtype=jnp.int32))


def lower_serving_programs(pair: Pair, mesh, *, platform: str = "tpu", only=None) -> dict:
    """name -> jax.export.Exported of each serving program, lowered for `platform` on `mesh`. The
    kernels dispatch for `platform` (pair.model.impl gains "@platform"). `only`: a subset of names."""
    impl = for_platform(pair.model.impl.partition("@")[0], platform)
    pair = dataclasses.replace(pair, model=dataclasses.replace(pair.model, impl=impl))
    out = {}
    with jax.sharding.use_abstract_mesh(mesh):
        for name, (fn, args, static) in serving_programs(pair, mesh).items():
            if only is not None and name not in only:
                continue
            out[name] = jax.export.export(fn, platforms=[platform])(*args, **static)
    return out
