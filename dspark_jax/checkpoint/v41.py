"""DeepSeek-V4.1 draft (`mtp.{s}.*`) <-> our parameter tree (docs/params.md), as data plus a loader,
an exporter and a streaming safetensors -> safetensors converter.

`V41_TABLE` lists every draft tensor once: our path, the checkpoint name under `mtp.{s}.`, the layout
transform, how the official checkpoint stores it (fp8 / fp4 / bf16 / f32), which stages carry it and
its checkpoint shape as a function of the config. Everything else here is generic over that table.

Loading is strict: each `mtp.*` tensor must be in the table (or be the scale of a quantised one),
each table tensor must be present with its exact shape, and a quantised tensor is recognised by its
dtype plus the presence of its scale. The official scale of `<linear>.weight` is `<linear>.scale`
(`mtp.0.main_proj.scale`), never `<linear>.weight.scale`; other conventions are rejected by name.
`ffn.gate.bias_vl` exists exactly when the config has a vision tower (`cfg.vision`). Tensors outside
`mtp.*`, `embed.weight`, `head.weight` belong to the backbone and are ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from pathlib import Path
from typing import Callable, Mapping

import ml_dtypes
import numpy as np

from dspark_jax.checkpoint import formats
from dspark_jax.checkpoint.safetensors_io import (
    CheckpointError, CheckpointReader, SafetensorsWriter, TensorSpec, open_checkpoint, write_index,
)
from dspark_jax.checkpoint.trees import check_tree, flatten_paths, match_table, unflatten_paths
from dspark_jax.drafts.v41.config import DSparkConfig

PREFIX = "mtp"
TIED = {"embed": "embed.weight", "head": "head.weight"}
DEFAULT_MAX_SHARD_BYTES = 4 << 30


# ---------------------------------------------------------------------------------------------
# The mapping table
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Entry:
    path: str  # our path, "/"-separated; "{s}" is the stage
    name: str  # checkpoint name after "mtp.{s}."; "{e}" is the routed expert (stacked on axis 0)
    transform: str  # key of TRANSFORMS
    storage: str  # official storage: "fp8" (E4M3 + 32x32 E8M0), "fp4" (packed E2M1 + 1x32 E8M0), "bf16", "f32"
    stages: str  # "all" | "first" | "last"
    shape: Callable[[DSparkConfig], tuple[int, ...]]  # checkpoint shape (one expert for "{e}")
    when: Callable[[DSparkConfig], bool] = lambda c: True

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.name


def _D(c): return c.dim
def _HD(c): return c.n_heads * c.head_dim
def _SI(c): return c.n_shared_experts * c.moe_inter_dim
def _hc(c): return c.hc_mult * c.dim


V41_TABLE: tuple[Entry, ...] = (
    Entry("main_proj/kernel", "main_proj.weight", "T", "fp8", "first", lambda c: (c.dim, c.main_hidden_dim)),
    Entry("main_norm/scale", "main_norm.weight", "copy", "bf16", "first", lambda c: (c.dim,)),
    Entry("blocks_{s}/attn_norm/scale", "attn_norm.weight", "copy", "bf16", "all", lambda c: (c.dim,)),
    Entry("blocks_{s}/ffn_norm/scale", "ffn_norm.weight", "copy", "bf16", "all", lambda c: (c.dim,)),
    Entry("blocks_{s}/hc_attn/fn", "hc_attn_fn", "copy", "f32", "all", lambda c: (c.hc_mix_dim, _hc(c))),
    Entry("blocks_{s}/hc_attn/base", "hc_attn_base", "copy", "f32", "all", lambda c: (c.hc_mix_dim,)),
    Entry("blocks_{s}/hc_attn/scale", "hc_attn_scale", "copy", "f32", "all", lambda c: (3,)),
    Entry("blocks_{s}/hc_ffn/fn", "hc_ffn_fn", "copy", "f32", "all", lambda c: (c.hc_mix_dim, _hc(c))),
    Entry("blocks_{s}/hc_ffn/base", "hc_ffn_base", "copy", "f32", "all", lambda c: (c.hc_mix_dim,)),
    Entry("blocks_{s}/hc_ffn/scale", "hc_ffn_scale", "copy", "f32", "all", lambda c: (3,)),
    Entry("blocks_{s}/attn/wq_a/kernel", "attn.wq_a.weight", "T", "fp8", "all", lambda c: (c.q_lora_rank, c.dim)),
    Entry("blocks_{s}/attn/q_norm/scale", "attn.q_norm.weight", "copy", "bf16", "all", lambda c: (c.q_lora_rank,)),
    Entry("blocks_{s}/attn/wq_b/kernel", "attn.wq_b.weight", "T", "fp8", "all", lambda c: (_HD(c), c.q_lora_rank)),
    Entry("blocks_{s}/attn/wkv/kernel", "attn.wkv.weight", "T", "fp8", "all", lambda c: (c.head_dim, c.dim)),
    Entry("blocks_{s}/attn/kv_norm/scale", "attn.kv_norm.weight", "copy", "bf16", "all", lambda c: (c.head_dim,)),
    Entry("blocks_{s}/attn/wo_a/kernel", "attn.wo_a.weight", "wo_a", "fp8", "all",
          lambda c: (c.o_groups * c.o_lora_rank, _HD(c) // c.o_groups)),
    Entry("blocks_{s}/attn/wo_b/kernel", "attn.wo_b.weight", "T", "fp8", "all",
          lambda c: (c.dim, c.o_groups * c.o_lora_rank)),
    Entry("blocks_{s}/attn/sink", "attn.attn_sink", "copy", "f32", "all", lambda c: (c.n_heads,)),
    Entry("blocks_{s}/ffn/gate/kernel", "ffn.gate.weight", "T", "bf16", "all", lambda c: (c.n_routed_experts, c.dim)),
    Entry("blocks_{s}/ffn/gate/bias", "ffn.gate.bias", "copy", "f32", "all", lambda c: (c.n_routed_experts,)),
    Entry("blocks_{s}/ffn/gate/bias_vl", "ffn.gate.bias_vl", "copy", "f32", "all", lambda c: (c.n_routed_experts,),
          lambda c: c.vision),
    Entry("blocks_{s}/ffn/experts/w1", "ffn.experts.{e}.w1.weight", "T", "fp4", "all",
          lambda c: (c.moe_inter_dim, c.dim)),
    Entry("blocks_{s}/ffn/experts/w3", "ffn.experts.{e}.w3.weight", "T", "fp4", "all",
          lambda c: (c.moe_inter_dim, c.dim)),
    Entry("blocks_{s}/ffn/experts/w2", "ffn.experts.{e}.w2.weight", "T", "fp4", "all",
          lambda c: (c.dim, c.moe_inter_dim)),
    Entry("blocks_{s}/ffn/shared/w1", "ffn.shared_experts.w1.weight", "T", "fp8", "all", lambda c: (_SI(c), c.dim),
          lambda c: c.n_shared_experts > 0),
    Entry("blocks_{s}/ffn/shared/w3", "ffn.shared_experts.w3.weight", "T", "fp8", "all", lambda c: (_SI(c), c.dim),
          lambda c: c.n_shared_experts > 0),
    Entry("blocks_{s}/ffn/shared/w2", "ffn.shared_experts.w2.weight", "T", "fp8", "all", lambda c: (c.dim, _SI(c)),
          lambda c: c.n_shared_experts > 0),
    Entry("norm/scale", "norm.weight", "copy", "bf16", "last", lambda c: (c.dim,)),
    Entry("markov/embed", "markov_head.embed.weight", "copy", "bf16", "last", lambda c: (c.vocab_size, c.markov_rank),
          lambda c: c.markov_rank > 0),
    Entry("markov/head", "markov_head.head.weight", "copy", "bf16", "last", lambda c: (c.vocab_size, c.markov_rank),
          lambda c: c.markov_rank > 0),
    Entry("confidence/kernel", "confidence_head.proj.weight", "row", "bf16", "last",
          lambda c: (1, c.dim + c.markov_rank)),
)


def _wo_a_fwd(x, c):
    g = c.o_groups
    return x.reshape(g, x.shape[0] // g, x.shape[1]).transpose(0, 2, 1)


def _wo_a_inv(x, c):
    return x.transpose(0, 2, 1).reshape(x.shape[0] * x.shape[2], x.shape[1])


# name -> (checkpoint layout -> ours, ours -> checkpoint layout); both return views where possible.
TRANSFORMS: dict[str, tuple[Callable, Callable]] = {
    "copy": (lambda x, c: x, lambda x, c: x),
    "T": (lambda x, c: x.T, lambda x, c: x.T),
    "wo_a": (_wo_a_fwd, _wo_a_inv),
    "row": (lambda x, c: x.reshape(-1), lambda x, c: x.reshape(1, -1)),
}


def _copy_2d(dst: np.ndarray, src: np.ndarray, block: int = 128) -> None:
    """dst[...] = src for 2-D arrays, tiled when src is a transposed view (numpy's strided copy of a
    large transpose thrashes the cache; ml_dtypes types are copied as same-width integers)."""
    if dst.dtype == src.dtype and dst.dtype.itemsize in (2, 4):
        ui = np.uint16 if dst.dtype.itemsize == 2 else np.uint32
        dst, src = dst.view(ui), src.view(ui)
    if src.flags.c_contiguous or dst.size < block * block * 4:
        dst[...] = src
        return
    n, m = src.shape
    for i in range(0, n, block):
        for j in range(0, m, block):
            dst[i:i + block, j:j + block] = src[i:i + block, j:j + block]


def assign_transformed(dst: np.ndarray, src: np.ndarray, transform: str, cfg: DSparkConfig) -> None:
    """dst[...] = TRANSFORMS[transform][0](src) without a full temporary."""
    view = TRANSFORMS[transform][0](src, cfg)
    if view.shape != dst.shape:
        raise CheckpointError(f"internal: transform {transform} gives {list(view.shape)}, leaf is {list(dst.shape)}")
    if view.ndim == 2:
        _copy_2d(dst, view)
    elif view.ndim == 3:
        for g in range(view.shape[0]):
            _copy_2d(dst[g], view[g])
    else:
        dst[...] = view


def _transform_shape(transform: str, shape: tuple[int, ...], cfg: DSparkConfig) -> tuple[int, ...]:
    return tuple(TRANSFORMS[transform][0](np.empty(shape, dtype=np.uint8), cfg).shape)


@dataclasses.dataclass(frozen=True)
class Item:
    """One leaf of our tree and the checkpoint tensor(s) it comes from (E of them for experts)."""
    path: tuple[str, ...]
    names: tuple[str, ...]
    entry: Entry
    ckpt_shape: tuple[int, ...]  # one checkpoint tensor
    our_shape: tuple[int, ...]  # the whole leaf (experts: [E, ...])

    @property
    def storage(self) -> str:
        return self.entry.storage


def expand_table(cfg: DSparkConfig) -> list[Item]:
    """The table instantiated for `cfg`: every leaf of our tree in checkpoint order."""
    if cfg.markov_rank and cfg.markov_head_type.strip().lower() != "vanilla":
        raise CheckpointError(f"the V4.1 checkpoint layout (mtp.*) has only the vanilla Markov head; this draft's "
                              f"markov_head_type is {cfg.markov_head_type!r}: save it as a bundle or an Orbax "
                              f"checkpoint (dspark convert --to orbax) instead")
    items = []
    last = cfg.n_layers - 1
    for s in range(cfg.n_layers):
        for ent in V41_TABLE:
            if not ent.when(cfg):
                continue
            if (ent.stages == "first" and s != 0) or (ent.stages == "last" and s != last):
                continue
            path = tuple(ent.path.format(s=s).split("/"))
            base = f"{PREFIX}.{s}." + ent.name
            shape = tuple(ent.shape(cfg))
            leaf = _transform_shape(ent.transform, shape, cfg)
            if ent.per_expert:
                names = tuple(base.format(e=e) for e in range(cfg.n_routed_experts))
                leaf = (cfg.n_routed_experts,) + leaf
            else:
                names = (base,)
            items.append(Item(path, names, ent, shape, leaf))
    return items


def expected_shapes(cfg: DSparkConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Our tree's leaves and shapes as the table defines them (docs/params.md)."""
    return {it.path: it.our_shape for it in expand_table(cfg)}


@functools.lru_cache(maxsize=8)
def check_table_against_draft(cfg: DSparkConfig) -> None:
    """Our own guard: the table and the draft module (`drafts.v41.model`) describe the same tree."""
    from dspark_jax.drafts.v41.model import abstract_params  # noqa: PLC0415  (jax; the rest of this module needs none)

    check_tree(flatten_paths(abstract_params(cfg)), expected_shapes(cfg), "the V4.1 draft module vs its checkpoint "
               "table", noun="param")


# ---------------------------------------------------------------------------------------------
# Reading one checkpoint tensor (any storage) in checkpoint layout
# ---------------------------------------------------------------------------------------------
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


scale_name = formats.scale_name  # `<linear>.weight` -> `<linear>.scale`

# Scale names of other writers, as suffixes of the weight's name `<linear>.weight`: ours before issue 13
# (`.weight.scale`), Hugging Face fp8 (`.weight_scale_inv`), compressed-tensors (`.weight_scale`).
_FOREIGN_SCALE_SUFFIXES = (".scale", "_scale_inv", "_scale")

# Why a table tensor may be absent from / unexpected in a checkpoint: named in the errors.
_CONDITIONAL = {"ffn.gate.bias_vl": "exists only in models with a vision tower (config vision=True, "
                                    "inference `vision_n_layers > 0` / HF `vision_config`)"}


def _conditional_hint(name: str) -> str:
    for k, why in _CONDITIONAL.items():
        if name.endswith("." + k):
            return f"; '{k}' {why}"
    return ""


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    fmt: str  # "fp8" | "fp4" | "plain"
    dtype: str  # the stored safetensors dtype of the weight

    @property
    def scale_name(self) -> str:
        return scale_name(self.name)


def _check_scale_convention(reader: CheckpointReader, name: str) -> None:
    """A scale spelled another way would otherwise surface as a vague missing / unexpected tensor."""
    if not name.endswith(".weight"):
        return
    for suf in _FOREIGN_SCALE_SUFFIXES:
        other = name + suf
        if other in reader:
            raise CheckpointError(
                f"{reader.info(other).file}: tensor '{other}' found where the official layout has "
                f"'{scale_name(name)}' (the scale of an F8_E4M3 or packed fp4 weight '<linear>.weight' is "
                f"named '<linear>.scale'); rename the scales of this checkpoint")


def detect(reader: CheckpointReader, name: str, shape: tuple[int, ...]) -> Source:
    """Storage of tensor `name` (expected logical checkpoint shape `shape`), validated."""
    if name not in reader:
        raise CheckpointError(f"{reader.root}: missing tensor '{name}' (expected shape {list(shape)})"
                              + _conditional_hint(name))
    _check_scale_convention(reader, name)
    info = reader.info(name)
    sname = scale_name(name)
    has_scale = name.endswith(".weight") and sname in reader
    where = f"{info.file}: tensor '{name}'"
    if info.dtype in _FLOAT_DTYPES:
        if has_scale:
            raise CheckpointError(f"{where} is {info.dtype} but '{sname}' exists; only F8_E4M3 and "
                                  "packed fp4 (I8/U8/F4) weights carry a scale")
        if info.shape != shape:
            raise CheckpointError(f"{where}: shape {list(info.shape)}, expected {list(shape)}")
        return Source(name, "plain", info.dtype)
    if info.dtype == "F8_E4M3":
        fmt, stored, sshape = "fp8", shape, formats.fp8_scale_shape(shape) if len(shape) == 2 else None
    elif info.dtype in ("I8", "U8", "F4"):
        fmt = "fp4"
        if len(shape) != 2:
            raise CheckpointError(f"{where}: {info.dtype} (packed fp4) storage needs a 2-D weight, "
                                  f"expected shape {list(shape)}")
        if shape[1] % 2:
            raise CheckpointError(f"{where}: fp4 weight with odd inner dimension {shape[1]} "
                                  f"(expected shape {list(shape)}); fp4 packs two values per byte")
        stored = shape if info.dtype == "F4" else (shape[0], shape[1] // 2)
        sshape = formats.fp4_scale_shape(shape)
    else:
        raise CheckpointError(f"{where}: dtype {info.dtype} is not a weight storage dtype "
                              f"(expected one of {list(_FLOAT_DTYPES)}, F8_E4M3 or packed fp4 I8/U8/F4)")
    if sshape is None:
        raise CheckpointError(f"{where}: {info.dtype} block-scaled storage needs a 2-D weight, "
                              f"expected shape {list(shape)}")
    if info.shape != tuple(stored):
        extra = f" (packed fp4 of logical shape {list(shape)})" if fmt == "fp4" and info.dtype != "F4" else ""
        raise CheckpointError(f"{where}: shape {list(info.shape)}, expected {list(stored)}{extra}")
    if not has_scale:
        raise CheckpointError(f"{where} is {info.dtype} but its scale '{sname}' is missing")
    sinfo = reader.info(sname)
    if sinfo.dtype != "F8_E8M0":
        raise CheckpointError(f"{sinfo.file}: tensor '{sname}': dtype {sinfo.dtype}, expected F8_E8M0")
    if sinfo.shape != tuple(sshape):
        raise CheckpointError(f"{sinfo.file}: tensor '{sname}': shape {list(sinfo.shape)}, "
                              f"expected {list(sshape)} for {fmt} weight {list(shape)}")
    return Source(name, fmt, info.dtype)


def read_dequantized(reader: CheckpointReader, src: Source, dtype, out: np.ndarray | None = None) -> np.ndarray:
    """The tensor in checkpoint layout as `dtype` (fp8 / fp4 dequantised; exact in bf16 and f32)."""
    w = reader.view(src.name)
    if src.fmt == "plain":
        formats.check_finite(w, f"{reader.info(src.name).file}: tensor '{src.name}'")
        if out is None:
            return w.astype(dtype)  # always a copy: releases the file mapping
        out[...] = w
        return out
    scale = reader.view(src.scale_name)
    try:
        if src.fmt == "fp8":
            return formats.dequantize_fp8_block(w, scale, dtype, name=src.name, out=out)
        return formats.dequantize_fp4(w, scale, dtype, name=src.name, out=out)
    except CheckpointError as err:
        raise CheckpointError(f"{reader.info(src.name).file}: {err}") from None


def _leaf_dtype(storage: str, dtype) -> np.dtype:
    return np.dtype(np.float32) if storage == "f32" else np.dtype(dtype)


def _resolve_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str):
        table = {"bfloat16": ml_dtypes.bfloat16, "bf16": ml_dtypes.bfloat16, "float32": np.float32,
                 "f32": np.float32, "float16": np.float16}
        if dtype not in table:
            raise CheckpointError(f"dtype {dtype!r}: expected one of {sorted(table)}")
        return np.dtype(table[dtype])
    return np.dtype(dtype)


def plan_sources(reader: CheckpointReader, cfg: DSparkConfig) -> list[tuple[Item, list[Source]]]:
    """Validate every `mtp.*` tensor of the checkpoint against the table; the sources of each leaf."""
    items = expand_table(cfg)
    plan, known = [], set()
    for it in items:
        srcs = [detect(reader, n, it.ckpt_shape) for n in it.names]
        for s in srcs:
            known.add(s.name)
            if s.fmt != "plain":
                known.add(s.scale_name)
        plan.append((it, srcs))
    extra = [n for n in reader.names if n.startswith(PREFIX + ".") and n not in known]
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        hint = next((h for h in map(_conditional_hint, extra) if h), "")
        files = {reader.info(n).file for n in extra}
        where = next(iter(files)) if len(files) == 1 else reader.root
        raise CheckpointError(f"{where}: unexpected tensor(s) for a {cfg.n_layers}-stage V4.1 draft with "
                              f"{cfg.n_routed_experts} experts (vision={cfg.vision}): {extra[:5]}{more}{hint}")
    return plan


def _tied_sources(reader: CheckpointReader, cfg: DSparkConfig) -> dict[str, Source]:
    return {k: detect(reader, n, (cfg.vocab_size, cfg.dim)) for k, n in TIED.items()}


# ---------------------------------------------------------------------------------------------
# Packed leaves (weights at checkpoint precision, `dspark_jax.nn.packed`)
# ---------------------------------------------------------------------------------------------
WEIGHTS_MODES = ("dequantized", "packed")


def _packed_kind(transform: str, fmts: set[str]) -> str | None:
    """"fp8" / "fp4" when a leaf can stay packed: one quantised storage for all of its sources and a plain
    transpose as layout (the packed nodes transpose the stored byte matrices); None otherwise."""
    if transform != "T" or len(fmts) != 1 or "plain" in fmts:
        return None
    return next(iter(fmts))


def _packed_type(kind: str):
    from dspark_jax.nn import packed  # noqa: PLC0415  (imports jax)

    return {"fp8": packed.Fp8Blocks, "fp4": packed.Fp4Blocks}[kind]


def _stored_bytes(reader: CheckpointReader, src: Source) -> tuple[np.ndarray, np.ndarray]:
    """(weight bytes, E8M0 scale bytes) of a quantised source as uint8 in checkpoint layout, validated as
    dequantisation would (E4M3 NaN codes, E8M0 NaN scales)."""
    w, scale = reader.view(src.name).view(np.uint8), reader.view(src.scale_name).view(np.uint8)
    try:
        if src.fmt == "fp8":
            formats.check_e4m3(w, src.name)
        formats.e8m0_exponents(scale, src.scale_name)
    except CheckpointError as err:
        raise CheckpointError(f"{reader.info(src.name).file}: {err}") from None
    return w, scale


def _read_packed(reader: CheckpointReader, it: Item, srcs: list[Source], kind: str, bar):
    """The leaf `it` as a packed node of numpy arrays: each field is the transpose of the stored bytes
    (experts stacked on axis 0), e.g. fp4 `[out, in/2]` bytes -> `[in/2, out]`."""
    cls = _packed_type(kind)
    fields = [f.name for f in dataclasses.fields(cls)]  # (weight bytes, exponents)
    abstract = cls.abstract(it.our_shape)
    arrays = [np.empty(getattr(abstract, f).shape, np.dtype(getattr(abstract, f).dtype)) for f in fields]
    per_source = math.prod(it.our_shape) // len(srcs)
    for e, src in enumerate(srcs):
        for dst, stored in zip(arrays, _stored_bytes(reader, src)):
            _copy_2d((dst[e] if it.entry.per_expert else dst).view(np.uint8), stored.T)
        bar.update(per_source)
    return cls(*arrays)


def _as_config(cfg) -> DSparkConfig:
    return DSparkConfig.from_json(cfg) if isinstance(cfg, (str, os.PathLike)) else cfg


def abstract_packed_params(cfg: DSparkConfig | str | os.PathLike, dtype="bfloat16") -> dict:
    """ShapeDtypeStructs of the tree `load_v41_draft(..., weights="packed", dtype=dtype)` gives for an
    official-layout checkpoint: the fp8 dense linears as `Fp8Blocks`, the fp4 routed experts as `Fp4Blocks`
    (stacked over experts), `wo_a` and the bf16 / f32 tensors plain. For exports and sharding plans at full
    size without reading or materialising anything."""
    import jax  # noqa: PLC0415

    cfg = _as_config(cfg)
    dtype = _resolve_dtype(cfg.param_dtype if dtype is None else dtype)
    flat = {}
    for it in expand_table(cfg):
        official = it.storage if it.storage in ("fp8", "fp4") else "plain"  # the source format it would have
        kind = _packed_kind(it.entry.transform, {official})
        flat[it.path] = (_packed_type(kind).abstract(it.our_shape) if kind else
                         jax.ShapeDtypeStruct(it.our_shape, _leaf_dtype(it.storage, dtype)))
    return unflatten_paths(flat)


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------
def load_v41_draft(path_or_dir: str | os.PathLike | CheckpointReader, cfg: DSparkConfig, *,
                   dtype="bfloat16", with_tied: bool = True,
                   tied_path: str | os.PathLike | None = None, progress: bool = False,
                   weights: str = "dequantized"):
    """V4.1 `mtp.{s}.*` safetensors -> (params, tied) as numpy arrays in the tree of docs/params.md.

    `cfg` is a DSparkConfig or a path to any config.json spelling. fp8 / fp4 weights are dequantised
    exactly; tensors the official checkpoint keeps in f32 stay f32, the others become `dtype`
    ("bfloat16", "float32", or None for `cfg.param_dtype`). `tied = {"embed": [V, D], "head": [V, D]}` comes from `embed.weight` /
    `head.weight` of the same checkpoint, or of `tied_path`; `with_tied=False` returns `tied=None`.

    `weights="packed"` keeps the quantised weights at checkpoint precision (about 1/3.6 of the bytes):
    each fp8 linear with a transposing layout becomes a `dspark_jax.nn.packed.Fp8Blocks` and each fp4
    routed-expert stack an `Fp4Blocks`, their bytes transposed into our `[in, out]` layout, dequantised
    exactly inside the model's jitted computation where they are consumed. `wo_a` (a regrouped layout)
    is dequantised to `dtype` as the official conversion does; a weight the checkpoint stores unquantised
    (a bf16 source) stays unquantised, in `dtype`; so does a leaf whose experts mix storages.
    `abstract_packed_params(cfg)` is this tree's abstract twin for an official-layout checkpoint.
    """
    if weights not in WEIGHTS_MODES:
        raise CheckpointError(f"weights {weights!r}: expected one of {list(WEIGHTS_MODES)}")
    cfg = _as_config(cfg)
    dtype = _resolve_dtype(cfg.param_dtype if dtype is None else dtype)
    check_table_against_draft(cfg)
    reader = path_or_dir if isinstance(path_or_dir, CheckpointReader) else open_checkpoint(path_or_dir)
    plan = plan_sources(reader, cfg)
    tied_reader, tied_src = None, None
    if with_tied:
        tied_reader = reader if tied_path is None else open_checkpoint(tied_path)
        tied_src = _tied_sources(tied_reader, cfg)

    bar = _progress(sum(math.prod(it.our_shape) for it, _ in plan), progress, "load")
    flat = {}
    for it, srcs in plan:
        kind = _packed_kind(it.entry.transform, {s.fmt for s in srcs}) if weights == "packed" else None
        if kind:
            flat[it.path] = _read_packed(reader, it, srcs, kind, bar)
            continue
        ldt = _leaf_dtype(it.storage, dtype)
        leaf = np.empty(it.our_shape, dtype=ldt)
        if it.entry.per_expert:
            for e, src in enumerate(srcs):  # one expert at a time into the stacked array
                assign_transformed(leaf[e], read_dequantized(reader, src, ldt), it.entry.transform, cfg)
                bar.update(leaf[e].size)
        else:
            assign_transformed(leaf, read_dequantized(reader, srcs[0], ldt), it.entry.transform, cfg)
            bar.update(leaf.size)
        flat[it.path] = leaf
    bar.close()
    tied = None
    if with_tied:
        tied = {k: read_dequantized(tied_reader, s, dtype) for k, s in tied_src.items()}
    return unflatten_paths(flat), tied


# ---------------------------------------------------------------------------------------------
# Export (our tree or a reader -> V4.1 safetensors)
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Out:
    name: str
    storage: str  # official storage kind
    shape: tuple[int, ...]  # logical checkpoint shape
    get: Callable[[], np.ndarray]  # float array in checkpoint layout


def _target_specs(o: _Out, fmt: str, fp4_dtype: str) -> list[TensorSpec]:
    if fmt == "fp8" and o.storage == "fp8":
        return [TensorSpec(o.name, "F8_E4M3", o.shape),
                TensorSpec(scale_name(o.name), "F8_E8M0", formats.fp8_scale_shape(o.shape))]
    if fmt == "fp8" and o.storage == "fp4":
        if o.shape[1] % 2:
            raise CheckpointError(f"tensor '{o.name}': fp4 export needs an even inner dimension, shape {list(o.shape)}")
        shp = o.shape if fp4_dtype == "F4" else (o.shape[0], o.shape[1] // 2)
        return [TensorSpec(o.name, fp4_dtype, shp),
                TensorSpec(scale_name(o.name), "F8_E8M0", formats.fp4_scale_shape(o.shape))]
    return [TensorSpec(o.name, "F32" if o.storage == "f32" else "BF16", o.shape)]


def _encode(o: _Out, fmt: str, fp4_dtype: str) -> list[np.ndarray]:
    x = o.get()
    if tuple(x.shape) != o.shape:
        raise CheckpointError(f"tensor '{o.name}': got shape {list(x.shape)}, expected {list(o.shape)}")
    if fmt == "fp8" and o.storage == "fp8":
        return list(formats.quantize_fp8_block(x))
    if fmt == "fp8" and o.storage == "fp4":
        packed, scale = formats.quantize_fp4(x)
        return [packed.view(np.int8) if fp4_dtype == "I8" else packed, scale]
    return [np.asarray(x, dtype=np.float32 if o.storage == "f32" else ml_dtypes.bfloat16)]


def _write_v41(out_dir: Path, outs: list[_Out], fmt: str, *, max_shard_bytes: int, fp4_dtype: str,
               metadata: Mapping[str, str] | None, progress: bool) -> list[Path]:
    if fmt not in ("bf16", "fp8"):
        raise CheckpointError(f"export format {fmt!r}: expected 'bf16' or 'fp8'")
    if fp4_dtype not in ("I8", "F4"):
        raise CheckpointError(f"fp4_dtype {fp4_dtype!r}: expected 'I8' or 'F4'")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = [(o, _target_specs(o, fmt, fp4_dtype)) for o in outs]
    shards: list[list[tuple[_Out, list[TensorSpec]]]] = [[]]
    size = 0
    for o, specs in groups:  # a weight and its scale stay in one shard
        n = sum(s.nbytes for s in specs)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((o, specs))
        size += n
    meta = {"format": "pt", "producer": "dspark_jax", "dspark_format": fmt, **(metadata or {})}
    total = sum(s.nbytes for _, specs in groups for s in specs)
    if len(shards) == 1:
        fnames = ["model.safetensors"]
    else:
        fnames = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    bar = _progress(total, progress, f"write {fmt}", unit="B")
    weight_map = {}
    paths = []
    for fname, shard in zip(fnames, shards):
        with SafetensorsWriter(out_dir / fname, [s for _, specs in shard for s in specs], meta) as w:
            for o, specs in shard:
                for spec, arr in zip(specs, _encode(o, fmt, fp4_dtype)):
                    w.write(spec.name, arr)
                    weight_map[spec.name] = fname
                    bar.update(spec.nbytes)
        paths.append(out_dir / fname)
    bar.close()
    if len(shards) > 1:
        write_index(out_dir, weight_map, total)
    elif (out_dir / "model.safetensors.index.json").exists():
        (out_dir / "model.safetensors.index.json").unlink()  # a stale index would shadow the new file
    return paths


def _host_array(leaf, e: int | None = None) -> np.ndarray:
    """A leaf (or its expert `e`) as a host float array; a packed node (`weights="packed"`) is dequantised
    (exactly, in f32), one expert at a time."""
    packed = sys.modules.get("dspark_jax.nn.packed")  # a packed leaf implies it is imported; plain trees need no jax
    if packed is not None and packed.is_packed(leaf):
        node = leaf if e is None else type(leaf)(*(getattr(leaf, f.name)[e] for f in dataclasses.fields(leaf)))
        return np.asarray(packed.dequantize(node, np.float32))
    return np.asarray(leaf if e is None else leaf[e])


def export_v41_draft(params: Mapping, tied: Mapping | None, cfg: DSparkConfig, out_dir: str | os.PathLike, *,
                     fmt: str = "bf16", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, fp4_dtype: str = "I8",
                     progress: bool = False) -> list[Path]:
    """Our tree (+ tied embed/head, or None) -> V4.1 safetensors in `out_dir`; returns the files.
    The tree may hold packed weights (`load_v41_draft(..., weights="packed")`): they export by value.

    fmt="bf16": f32 tensors as F32, the rest BF16. fmt="fp8": the layout of the official checkpoint:
    dense linears F8_E4M3 + 32x32 E8M0 scales, routed experts packed fp4 (`fp4_dtype` "I8" [out, in/2]
    or "F4" [out, in]) + 1x32 E8M0 scales, the rest BF16 / F32. Shards above `max_shard_bytes` get a
    `model.safetensors.index.json`.
    """
    items = expand_table(cfg)
    flat = match_table(params, items, "V4.1 draft")
    outs: list[_Out] = []
    for it in items:
        inv = TRANSFORMS[it.entry.transform][1]
        leaf = flat[it.path]
        if it.entry.per_expert:
            for e, n in enumerate(it.names):
                outs.append(_Out(n, it.storage, it.ckpt_shape,
                                 lambda leaf=leaf, e=e, inv=inv: inv(_host_array(leaf, e), cfg)))
        else:
            outs.append(_Out(it.names[0], it.storage, it.ckpt_shape,
                             lambda leaf=leaf, inv=inv: inv(_host_array(leaf), cfg)))
    if tied is not None:
        for k, n in TIED.items():
            if k not in tied:
                raise CheckpointError(f"tied is missing '{k}' ({n})")
            if tuple(np.shape(tied[k])) != (cfg.vocab_size, cfg.dim):
                raise CheckpointError(f"tied['{k}']: shape {list(np.shape(tied[k]))}, expected "
                                      f"{[cfg.vocab_size, cfg.dim]}")
            outs.append(_Out(n, "bf16", (cfg.vocab_size, cfg.dim), lambda a=tied[k]: np.asarray(a)))
    return _write_v41(Path(out_dir), outs, fmt, max_shard_bytes=max_shard_bytes, fp4_dtype=fp4_dtype,
                      metadata=None, progress=progress)


def convert_v41_safetensors(src: str | os.PathLike | CheckpointReader, cfg: DSparkConfig,
                            out_dir: str | os.PathLike, *, fmt: str = "bf16", with_tied: bool = True,
                            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, fp4_dtype: str = "I8",
                            progress: bool = False) -> list[Path]:
    """V4.1 safetensors -> V4.1 safetensors in `fmt`, one tensor in memory at a time (never our tree).

    The source is validated exactly as `load_v41_draft` does; the backbone's tensors other than
    `embed.weight` / `head.weight` are not copied.
    """
    reader = src if isinstance(src, CheckpointReader) else open_checkpoint(src)
    plan = plan_sources(reader, cfg)
    outs: list[_Out] = []
    for it, srcs in plan:
        # bf16 holds fp8 / fp4 values exactly, and halves the temporary compared with f32.
        dt = _leaf_dtype(it.storage, ml_dtypes.bfloat16)
        for s in srcs:
            outs.append(_Out(s.name, it.storage, it.ckpt_shape, lambda s=s, dt=dt: read_dequantized(reader, s, dt)))
    if with_tied:
        for k, s in _tied_sources(reader, cfg).items():
            outs.append(_Out(s.name, "bf16", (cfg.vocab_size, cfg.dim),
                             lambda s=s: read_dequantized(reader, s, ml_dtypes.bfloat16)))
    return _write_v41(Path(out_dir), outs, fmt, max_shard_bytes=max_shard_bytes, fp4_dtype=fp4_dtype,
                      metadata=None, progress=progress)


def _progress(total: int, enabled: bool, desc: str, unit: str = "el"):
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(total=total, disable=not enabled, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True)
