"""DeepSpec DSpark drafts for Qwen3 targets (`Qwen3DSparkModel`, e.g. deepseek-ai/dspark_qwen3_8b_block7)
<-> our parameter tree (`dspark_jax.drafts.deepspec`), as data plus a strict loader, an exporter and a
streaming safetensors -> safetensors converter.

A DeepSpec checkpoint folder holds `config.json` (see `DeepSpecConfig`) and `model.safetensors` (or
shards with `model.safetensors.index.json`), tensor names WITHOUT a `model.` prefix:
`embed_tokens.weight`, `lm_head.weight` (frozen copies of the target's), `fc.weight`,
`hidden_norm.weight`, `norm.weight`, `layers.{i}.*` (Qwen3 decoder layers), `markov_head.markov_w1.weight`,
`markov_head.markov_w2.weight`, `confidence_head.proj.{weight,bias}`; released in bf16.

`DEEPSPEC_TABLE` lists every draft tensor once (our path, checkpoint name, layout transform, checkpoint
shape as a function of the config, whether it is per layer, when it exists). Loading is strict: each
tensor must be in the table or be one of the two tied tensors, each table tensor must be present with
its exact shape and a float dtype; the error names the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import ml_dtypes
import numpy as np

from dspark_jax.checkpoint.safetensors_io import (
    CheckpointError, CheckpointReader, SafetensorsWriter, TensorSpec, open_checkpoint,
)
from dspark_jax.checkpoint.formats import check_finite
from dspark_jax.checkpoint.output_folder import naming_file
from dspark_jax.checkpoint.trees import check_tree, flatten_paths, match_table, unflatten_paths

TIED = {"embed": "embed_tokens.weight", "head": "lm_head.weight"}
FLOAT_DTYPES = ("BF16", "F16", "F32")
_NP = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32)}


@dataclasses.dataclass(frozen=True)
class Entry:
    path: str  # our path, "/"-separated
    name: str  # checkpoint name; "{i}" is the draft layer (stacked on axis 0 of our leaf)
    transform: str  # key of TRANSFORMS
    shape: Callable[[Any], tuple[int, ...]]  # checkpoint shape (of one layer's tensor)
    when: Callable[[Any], bool] = lambda c: True

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name


def _q(c): return c.num_attention_heads * c.head_dim
def _kv(c): return c.num_key_value_heads * c.head_dim
def _has_markov(c): return c.markov_rank > 0
def _head_is(kind): return lambda c: c.markov_rank > 0 and c.markov_head_type.strip().lower() == kind
def _has_conf(c): return c.enable_confidence_head


_L = "layers.{i}."
DEEPSPEC_TABLE: tuple[Entry, ...] = (
    Entry("fc/kernel", "fc.weight", "T", lambda c: (c.hidden_size, c.main_hidden_dim)),
    Entry("hidden_norm/scale", "hidden_norm.weight", "copy", lambda c: (c.hidden_size,)),
    Entry("layers/attn_norm/scale", _L + "input_layernorm.weight", "copy", lambda c: (c.hidden_size,)),
    Entry("layers/q_proj/kernel", _L + "self_attn.q_proj.weight", "T", lambda c: (_q(c), c.hidden_size)),
    Entry("layers/k_proj/kernel", _L + "self_attn.k_proj.weight", "T", lambda c: (_kv(c), c.hidden_size)),
    Entry("layers/v_proj/kernel", _L + "self_attn.v_proj.weight", "T", lambda c: (_kv(c), c.hidden_size)),
    Entry("layers/o_proj/kernel", _L + "self_attn.o_proj.weight", "T", lambda c: (c.hidden_size, _q(c))),
    Entry("layers/q_norm/scale", _L + "self_attn.q_norm.weight", "copy", lambda c: (c.head_dim,)),
    Entry("layers/k_norm/scale", _L + "self_attn.k_norm.weight", "copy", lambda c: (c.head_dim,)),
    Entry("layers/ffn_norm/scale", _L + "post_attention_layernorm.weight", "copy", lambda c: (c.hidden_size,)),
    Entry("layers/gate_proj/kernel", _L + "mlp.gate_proj.weight", "T",
          lambda c: (c.intermediate_size, c.hidden_size)),
    Entry("layers/up_proj/kernel", _L + "mlp.up_proj.weight", "T", lambda c: (c.intermediate_size, c.hidden_size)),
    Entry("layers/down_proj/kernel", _L + "mlp.down_proj.weight", "T",
          lambda c: (c.hidden_size, c.intermediate_size)),
    Entry("norm/scale", "norm.weight", "copy", lambda c: (c.hidden_size,)),
    Entry("markov/embed", "markov_head.markov_w1.weight", "copy", lambda c: (c.vocab_size, c.markov_rank),
          _has_markov),
    Entry("markov/head", "markov_head.markov_w2.weight", "copy", lambda c: (c.vocab_size, c.markov_rank),
          _has_markov),
    # The gated / recurrent Markov heads (SPEC 4.1); full names: each decoder layer has an `mlp.gate_proj` too.
    Entry("markov/gate/kernel", "markov_head.gate_proj.weight", "T",
          lambda c: (c.markov_rank, c.hidden_size + c.markov_rank), _head_is("gated")),
    Entry("markov/gate/bias", "markov_head.gate_proj.bias", "copy", lambda c: (c.markov_rank,), _head_is("gated")),
    Entry("markov/joint/kernel", "markov_head.joint_proj.weight", "T",
          lambda c: (3 * c.markov_rank, 2 * c.markov_rank + c.hidden_size), _head_is("rnn")),
    Entry("markov/joint/bias", "markov_head.joint_proj.bias", "copy", lambda c: (3 * c.markov_rank,), _head_is("rnn")),
    Entry("confidence/kernel", "confidence_head.proj.weight", "row", lambda c: (1, c.confidence_in_dim), _has_conf),
    Entry("confidence/bias", "confidence_head.proj.bias", "copy", lambda c: (1,), _has_conf),
)

# name -> (checkpoint layout -> ours, ours -> checkpoint layout); exact for every dtype.
TRANSFORMS: dict[str, tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]] = {
    "copy": (lambda x: x, lambda x: x),
    "T": (lambda x: x.T, lambda x: x.T),
    "row": (lambda x: x.reshape(-1), lambda x: x.reshape(1, -1)),
}


@dataclasses.dataclass(frozen=True)
class Item:
    """One leaf of our tree and its checkpoint tensor(s) (one per draft layer for per-layer entries)."""
    path: tuple[str, ...]
    names: tuple[str, ...]
    entry: Entry
    ckpt_shape: tuple[int, ...]
    our_shape: tuple[int, ...]


def expand_table(cfg) -> list[Item]:
    """The table instantiated for `cfg` (a DeepSpecConfig), in checkpoint order."""
    items = []
    for ent in DEEPSPEC_TABLE:
        if not ent.when(cfg):
            continue
        shape = tuple(ent.shape(cfg))
        leaf = tuple(TRANSFORMS[ent.transform][0](np.empty(shape, np.uint8)).shape)
        if ent.per_layer:
            names = tuple(ent.name.format(i=i) for i in range(cfg.num_hidden_layers))
            leaf = (cfg.num_hidden_layers,) + leaf
        else:
            names = (ent.name,)
        items.append(Item(tuple(ent.path.split("/")), names, ent, shape, leaf))
    return items


def expected_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a DeepSpec checkpoint of this config (tied ones included) with its shape."""
    out = {n: it.ckpt_shape for it in expand_table(cfg) for n in it.names}
    for n in TIED.values():
        out[n] = (cfg.vocab_size, cfg.hidden_size)
    return out


def check_table_against_draft(cfg) -> None:
    """The table and the DeepSpec draft module must describe the same tree (our own guard)."""
    from dspark_jax.drafts.deepspec.model import abstract_params  # noqa: PLC0415

    check_tree(flatten_paths(abstract_params(cfg)), {it.path: it.our_shape for it in expand_table(cfg)},
               "the DeepSpec draft module vs its checkpoint table", noun="param")


def _config(cfg_or_path, **overrides):
    from dspark_jax.drafts.deepspec.config import DeepSpecConfig  # noqa: PLC0415

    if isinstance(cfg_or_path, DeepSpecConfig):
        return cfg_or_path.replace(**overrides) if overrides else cfg_or_path
    return DeepSpecConfig.from_json(cfg_or_path, **overrides)


def _validate(reader: CheckpointReader, cfg, with_tied: bool) -> list[Item]:
    """Every tensor of the checkpoint is known, every expected one present with its shape and a float dtype."""
    items = expand_table(cfg)
    want = {n: it.ckpt_shape for it in items for n in it.names}
    tied = {n: (cfg.vocab_size, cfg.hidden_size) for n in TIED.values()}
    if with_tied:
        want.update(tied)
    infos = {n: reader.info(n) for n in reader.names if with_tied or n not in tied}
    check_tree(infos, want, f"{reader.root} (a {cfg.num_hidden_layers}-layer DeepSpec draft)")
    for name, info in infos.items():
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{info.file}: tensor '{name}' has dtype {info.dtype}, expected one of "
                                  f"{list(FLOAT_DTYPES)}")
    return items


def _dtype(name) -> np.dtype:
    table = {"bfloat16": _NP["BF16"], "float32": _NP["F32"], "float16": _NP["F16"]}
    if name not in table:
        raise CheckpointError(f"dtype {name!r}: expected one of {sorted(table)}")
    return table[name]


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------
def load_deepspec_draft(path: str | os.PathLike, cfg=None, *, dtype: str | None = None, with_tied: bool = True):
    """A DeepSpec checkpoint folder (config.json + safetensors) -> (cfg, params, tied) with numpy leaves.

    `cfg` defaults to the folder's config.json (a DeepSpecConfig or a path also work); leaves are cast to
    `dtype` (default cfg.param_dtype; bf16 -> f32 is exact). `tied = {"embed", "head"}` from
    `embed_tokens.weight` / `lm_head.weight`, or None with `with_tied=False` (then they may be absent).
    Serving uses the target's own embedding and head; the draft's copies are the same tensors."""
    path = Path(path)
    cfg = _config(path if cfg is None else cfg)
    if dtype is not None:
        cfg = cfg.replace(param_dtype=dtype)
    check_table_against_draft(cfg)
    reader = open_checkpoint(path)
    items = _validate(reader, cfg, with_tied)
    dt = _dtype(cfg.param_dtype)
    def read(name):
        value = reader.view(name)
        check_finite(value, f"{reader.info(name).file}: tensor '{name}'")
        return value

    flat = {}
    for it in items:
        fwd = TRANSFORMS[it.entry.transform][0]
        parts = [np.asarray(fwd(read(n))).astype(dt) for n in it.names]
        flat[it.path] = np.stack(parts) if it.entry.per_layer else parts[0]
    params = unflatten_paths(flat)
    tied = {k: np.asarray(read(n)).astype(dt) for k, n in TIED.items()} if with_tied else None
    return cfg, params, tied


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------
def _write(out_dir: Path, cfg, tensors: list[tuple[str, str, Callable[[], np.ndarray]]]) -> Path:
    """config.json + model.safetensors, one tensor in memory at a time."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with naming_file(out_dir / "config.json"):
        (out_dir / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    shapes = expected_tensors(cfg)
    specs = [TensorSpec(n, dt, shapes[n]) for n, dt, _ in tensors]
    index = out_dir / "model.safetensors.index.json"
    if index.exists():
        index.unlink()  # a stale index would shadow the new file
    with SafetensorsWriter(out_dir / "model.safetensors", specs, {"format": "pt"}) as w:
        for (n, dt, get), spec in zip(tensors, specs):
            arr = np.asarray(get())
            if tuple(arr.shape) != spec.shape:
                raise CheckpointError(f"tensor '{n}': got shape {list(arr.shape)}, expected {list(spec.shape)}")
            w.write(n, np.ascontiguousarray(arr.astype(_NP[dt])))
    return out_dir / "model.safetensors"


def export_deepspec_draft(params: Mapping, tied: Mapping | None, cfg, out_dir: str | os.PathLike, *,
                          dtype: str = "BF16") -> Path:
    """Our tree (+ the tied embed/head, or None) -> a DeepSpec checkpoint folder: config.json
    (`cfg.to_hf_dict()`) and model.safetensors with every tensor in `dtype` (BF16 as released, or F32)."""
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"export dtype {dtype!r}: expected one of {list(FLOAT_DTYPES)}")
    items = expand_table(cfg)
    flat = match_table(params, items, "DeepSpec draft")
    tensors = []
    for it in items:
        inv = TRANSFORMS[it.entry.transform][1]
        leaf = flat[it.path]
        for i, n in enumerate(it.names):
            if it.entry.per_layer:
                tensors.append((n, dtype, lambda leaf=leaf, i=i, inv=inv: inv(np.asarray(leaf[i]))))
            else:
                tensors.append((n, dtype, lambda leaf=leaf, inv=inv: inv(np.asarray(leaf))))
    if tied is not None:
        for k, n in TIED.items():
            if k not in tied:
                raise CheckpointError(f"tied is missing '{k}' ({n})")
            if tuple(np.shape(tied[k])) != (cfg.vocab_size, cfg.hidden_size):
                raise CheckpointError(f"tied['{k}']: shape {list(np.shape(tied[k]))}, expected "
                                      f"{[cfg.vocab_size, cfg.hidden_size]}")
            tensors.append((n, dtype, lambda a=tied[k]: np.asarray(a)))
    return _write(Path(out_dir), cfg, tensors)


def convert_deepspec_safetensors(src: str | os.PathLike, out_dir: str | os.PathLike, cfg=None, *,
                                 dtype: str = "BF16", with_tied: bool = True) -> Path:
    """DeepSpec checkpoint -> DeepSpec checkpoint in `dtype`, validated as `load_deepspec_draft` does, one
    tensor in memory at a time (never our tree)."""
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"export dtype {dtype!r}: expected one of {list(FLOAT_DTYPES)}")
    src = Path(src)
    cfg = _config(src if cfg is None else cfg)
    reader = open_checkpoint(src)
    items = _validate(reader, cfg, with_tied)
    names = [n for it in items for n in it.names] + (list(TIED.values()) if with_tied else [])
    return _write(Path(out_dir), cfg, [(n, dtype, lambda n=n: reader.view(n)) for n in names])
