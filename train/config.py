"""The training run config (`dspark train --config run.yaml`).

A YAML mapping with these sections (every key optional unless marked; unknown keys are errors):

```yaml
run_dir: runs/my_run          # checkpoints, metrics.jsonl, run_config.json (relative to the CWD)
seed: 0                       # data order, anchor draws, random initialisations
steps: 10000                  # optimizer steps (the lr schedule spans them)
global_batch: 64              # sequences per optimizer step over all hosts and micro-batches
grad_accum: 1                 # micro-batches per step (global_batch / grad_accum per micro-batch)
compute_dtype: bfloat16       # draft activations; parameters and optimizer state are always f32
compiler_options: {}          # XLA options for the step's compile, e.g. {xla_backend_optimization_level: 0}
backbone:
  family: mhc                 # mhc | qwen3
  config: configs/tiny_mhc_backbone.json   # MhcConfig JSON, or a Qwen3 (HF) config.json
  params: null                # an Orbax params checkpoint, or (qwen3) a HF safetensors folder;
                              # null = random init from init_seed (tests and demos only)
  init_seed: 0
  tap_mode: null              # entry (V4.1 drafts) | output (DeepSpec); null = the draft family's
draft:
  config: configs/tiny_v41.json            # DSparkConfig JSON (any of its accepted spellings)
  init: null                  # an Orbax params checkpoint to start from; null = random init
  init_seed: 1
data:
  train: [data/train.jsonl]   # files or globs of JSON lines (see dspark_jax.train.data)
  seq_len: 2048
  tokenizer: null             # a tokenizers JSON; required for {"text": ...} records
  add_special_tokens: true
  pad_id: 0
  shuffle_buffer: 10000
  anchors_per_seq: 512
optim:
  lr: 6.0e-4                  # peak; linear warmup over warmup_frac of the steps, then cosine to 0
  warmup_frac: 0.04
  weight_decay: 0.0
  clip_norm: 1.0
  b1: 0.9
  b2: 0.95
  eps: 1.0e-8
loss:
  ce_weight: 0.1
  l1_weight: 0.9
  conf_weight: 1.0
  decay_gamma: 4.0
  detach_conf_inputs: false   # stop gradients from the confidence head into h and W1[prev]
  vocab_chunk: 8192           # vocabulary chunk of the loss (null = the whole vocabulary at once)
  fused: true                 # false = materialise [blocks, K, V] logits (the reference path)
  fp8_grad: straight_through  # straight_through | exact  (how gradients cross the fp8 KV rounding)
mesh: {data: -1, fsdp: 1, expert: 1, tensor: 1}   # -1 = all remaining devices
checkpoint: {every: 1000, keep: 3}
log: {every: 10}
distributed:                  # multi-host: also settable by DSPARK_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID
  coordinator: null           # "host:port" of process 0; null = single process (or auto: true)
  num_processes: null
  process_id: null
  auto: false                 # jax.distributed.initialize() with no arguments (TPU pods, SLURM)
  cpu_collectives: gloo       # CPU-only multi-process runs
```

Relative input paths (backbone.config/params, draft.config/init, data.train/tokenizer) are resolved
against the YAML file's folder first and the CWD second.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

from dspark_jax.train.data import DataConfig, DataError
from dspark_jax.validation import ConfigError, check_field, did_you_mean, is_int, is_number


class RunConfigError(ConfigError):
    """The run config is invalid; the message names the key."""


@dataclasses.dataclass(frozen=True)
class BackboneSpec:
    family: str = "mhc"
    config: str | None = None
    params: str | None = None
    init_seed: int = 0
    tap_mode: str | None = None  # None: the draft family's (V4.1 "entry", DeepSpec "output")


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    config: str | None = None
    init: str | None = None
    init_seed: int = 1


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8


@dataclasses.dataclass(frozen=True)
class LossConfig:
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    conf_weight: float = 1.0
    decay_gamma: float = 4.0
    detach_conf_inputs: bool = False
    vocab_chunk: int | None = 8192
    fused: bool = True
    fp8_grad: str = "straight_through"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = -1
    fsdp: int = 1
    expert: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 1000
    keep: int = 3


@dataclasses.dataclass(frozen=True)
class LogConfig:
    every: int = 10


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    cpu_collectives: str = "gloo"


@dataclasses.dataclass(frozen=True)
class RunConfig:
    data: DataConfig
    backbone: BackboneSpec = BackboneSpec()
    draft: DraftSpec = DraftSpec()
    optim: OptimConfig = OptimConfig()
    loss: LossConfig = LossConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    distributed: DistributedConfig = DistributedConfig()
    run_dir: str = "runs/dspark"
    seed: int = 0
    steps: int = 1000
    global_batch: int = 8
    grad_accum: int = 1
    compute_dtype: str = "bfloat16"
    compiler_options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _validate(self)

    def check_vocab(self, vocab_size: int) -> None:
        """What needs the model's vocabulary (known once the draft config is read, before any compile):
        data.pad_id must be a token id, or padded positions would index past the embedding."""
        _check(self.data.pad_id < vocab_size, "data.pad_id", f"a token id in [0, {vocab_size}) (the draft's "
               "vocab_size)", self.data.pad_id)

    @property
    def micro_batch(self) -> int:
        return self.global_batch // self.grad_accum

    def replace(self, **changes) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["data"]["train"] = list(self.data.train)
        return d

    # ---- loading ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], base_dir: str | os.PathLike | None = None) -> "RunConfig":
        if not isinstance(raw, dict):
            raise RunConfigError(f"expected a mapping at top level, got {type(raw).__name__}")
        sections = {"data": DataConfig, "backbone": BackboneSpec, "draft": DraftSpec, "optim": OptimConfig,
                    "loss": LossConfig, "mesh": MeshConfig, "checkpoint": CheckpointConfig, "log": LogConfig,
                    "distributed": DistributedConfig}
        top = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in raw.items():
            if key not in top:
                raise RunConfigError(f"unknown key '{key}'{did_you_mean(str(key), top)} (known: {sorted(top)})")
            if key in sections:
                kwargs[key] = _section(sections[key], value, key)
            else:
                kwargs[key] = value
        if "data" not in kwargs:
            raise RunConfigError("data: required section (at least data.train)")
        base = Path(base_dir) if base_dir is not None else None
        bb, dr, data = kwargs.get("backbone", BackboneSpec()), kwargs.get("draft", DraftSpec()), kwargs["data"]
        kwargs["backbone"] = dataclasses.replace(bb, config=_resolve(bb.config, base, "backbone.config"),
                                                 params=_resolve(bb.params, base, "backbone.params"))
        kwargs["draft"] = dataclasses.replace(dr, config=_resolve(dr.config, base, "draft.config"),
                                              init=_resolve(dr.init, base, "draft.init"))
        kwargs["data"] = dataclasses.replace(data, train=tuple(_resolve(p, base, "data.train") for p in data.train),
                                             tokenizer=_resolve(data.tokenizer, base, "data.tokenizer"),
                                             seed=kwargs.get("seed", 0))
        try:
            return cls(**kwargs)
        except TypeError as err:
            raise RunConfigError(str(err)) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "RunConfig":
        import yaml  # noqa: PLC0415

        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise RunConfigError(f"run config not found: {path}") from None
        except yaml.YAMLError as err:
            raise RunConfigError(f"{path} is not valid YAML: {err}") from None
        try:
            return cls.from_dict(raw or {}, base_dir=path.parent)
        except (RunConfigError, ValueError) as err:
            raise RunConfigError(f"{path}: {err}") from None

    def save_json(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _section(cls, value, name):
    if value is None:
        return cls() if cls is not DataConfig else _section(cls, {}, name)
    if not isinstance(value, dict):
        raise RunConfigError(f"{name}: expected a mapping, got {type(value).__name__}")
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in value:
        if key not in fields:
            raise RunConfigError(f"unknown key '{name}.{key}'{did_you_mean(str(key), fields)} "
                                 f"(known: {sorted(fields)})")
    if cls is DataConfig and "train" not in value:
        raise RunConfigError("data.train: required (JSONL files or glob patterns)")
    if cls is DataConfig and "seed" in value:
        raise RunConfigError("data.seed: set the top-level 'seed' instead")
    if cls is DataConfig:  # before DataConfig turns every entry into a string (`train: [1]` -> "1")
        train = value["train"]
        entries = [train] if isinstance(train, str) else train if isinstance(train, list) else [train]
        _check(all(isinstance(p, str) and p for p in entries), "data.train",
               "a JSONL file, glob pattern, or a list of them", train)
    try:
        return cls(**value)
    except TypeError as err:
        raise RunConfigError(f"{name}: {err}") from None
    except DataError as err:  # DataConfig's own checks (data.seq_len, ...): a config error like the rest
        raise RunConfigError(str(err)) from None


def _resolve(p, base: Path | None, field: str):
    if p is None:
        return None
    # checked here, before str(): a number or an empty string is a mistake, not a file named "3"
    _check(_path(p), field, "a path or null", p)
    if os.path.isabs(p) or base is None:
        return p
    cand = base / p
    if cand.exists() or any(ch in p for ch in "*?[") and list(base.glob(p)):
        return str(cand)
    return p


# ---- validation ------------------------------------------------------------------------------------
# One row per field: (dotted name, predicate, what was expected). Every field of every section has a row
# (test_config checks that), so a value of the wrong type or out of range is refused when the YAML is read,
# not after minutes of compiling; bools are not numbers here (YAML `true` for a rate is a mistake).

_SEED_LIMIT = 2 ** 32  # jax.random.key keeps 32 bits of a seed: larger ones would collide silently


def _positive_int(v) -> bool:
    return is_int(v) and v > 0


def _positive_number(v) -> bool:
    return is_number(v) and v > 0


def _non_negative_number(v) -> bool:
    return is_number(v) and v >= 0


def _fraction(v) -> bool:  # [0, 1): warmup share, Adam's decay rates (1 would never forget)
    return is_number(v) and 0 <= v < 1


def _seed(v) -> bool:
    return is_int(v) and 0 <= v < _SEED_LIMIT


def _path(v) -> bool:
    return isinstance(v, str) and bool(v.strip())


def _optional(pred: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or pred(v)


def _one_of(*values) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and v in values


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _mesh_axis(v) -> bool:
    return is_int(v) and (v > 0 or v == -1)


def _xla_options(v) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and k and isinstance(x, (bool, int, float, str))
                                       for k, x in v.items())


_POSITIVE_INT = (_positive_int, "a positive integer")
_POSITIVE_NUMBER = (_positive_number, "a positive finite number")
_WEIGHT = (_non_negative_number, "a finite number >= 0")
_FRACTION = (_fraction, "a finite number in [0, 1)")
_SEED = (_seed, "an integer in [0, 2**32)")
_BOOL = (_is_bool, "true or false")
_OPTIONAL_PATH = (_optional(_path), "a path or null")

_FIELD_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "run_dir": (_path, "a folder path"),
    "seed": _SEED,
    "steps": _POSITIVE_INT,
    "global_batch": _POSITIVE_INT,
    "grad_accum": _POSITIVE_INT,
    "compute_dtype": (_one_of("float32", "bfloat16"), "'float32' or 'bfloat16'"),
    "compiler_options": (_xla_options, "a mapping of XLA option names to scalar values"),
    "backbone.family": (_one_of("mhc", "qwen3"), "'mhc' or 'qwen3'"),
    "backbone.config": _OPTIONAL_PATH,
    "backbone.params": _OPTIONAL_PATH,
    "backbone.init_seed": _SEED,
    "backbone.tap_mode": (_optional(_one_of("entry", "output")), "'entry', 'output' or null"),
    "draft.config": (_optional(_path), "a draft config JSON path"),  # required: checked after, with a hint
    "draft.init": _OPTIONAL_PATH,
    "draft.init_seed": _SEED,
    "data.train": (lambda v: bool(v) and all(map(_path, v)), "a list of JSONL files or glob patterns"),
    "data.seq_len": (lambda v: is_int(v) and v >= 2, "an integer >= 2"),
    "data.tokenizer": _OPTIONAL_PATH,
    "data.add_special_tokens": _BOOL,
    "data.pad_id": (lambda v: is_int(v) and v >= 0, "a token id (an integer >= 0)"),
    "data.shuffle_buffer": _POSITIVE_INT,
    "data.seed": _SEED,  # the top-level seed, copied here by from_dict
    "data.anchors_per_seq": _POSITIVE_INT,
    "optim.lr": _POSITIVE_NUMBER,
    "optim.warmup_frac": _FRACTION,
    "optim.weight_decay": _WEIGHT,
    "optim.clip_norm": _POSITIVE_NUMBER,
    "optim.b1": _FRACTION,
    "optim.b2": _FRACTION,
    "optim.eps": _POSITIVE_NUMBER,
    "loss.ce_weight": _WEIGHT,
    "loss.l1_weight": _WEIGHT,
    "loss.conf_weight": _WEIGHT,
    "loss.decay_gamma": _POSITIVE_NUMBER,
    "loss.detach_conf_inputs": _BOOL,
    "loss.vocab_chunk": (_optional(_positive_int), "a positive integer or null (the whole vocabulary)"),
    "loss.fused": _BOOL,
    "loss.fp8_grad": (_one_of("straight_through", "exact"), "'straight_through' or 'exact'"),
    "mesh.data": (_mesh_axis, "a positive integer or -1 (all remaining devices)"),
    "mesh.fsdp": (_mesh_axis, "a positive integer or -1 (all remaining devices)"),
    "mesh.expert": (_mesh_axis, "a positive integer or -1 (all remaining devices)"),
    "mesh.tensor": (_mesh_axis, "a positive integer or -1 (all remaining devices)"),
    "checkpoint.every": _POSITIVE_INT,
    "checkpoint.keep": _POSITIVE_INT,
    "log.every": _POSITIVE_INT,
    "distributed.coordinator": (_optional(_path), "\"host:port\" or null"),
    "distributed.num_processes": (_optional(_positive_int), "a positive integer or null"),
    "distributed.process_id": (_optional(lambda v: is_int(v) and v >= 0), "an integer >= 0 or null"),
    "distributed.auto": _BOOL,
    "distributed.cpu_collectives": (_optional(lambda v: isinstance(v, str)), "a collectives name or null"),
}


def _check(ok: bool, field: str, expected: str, got: Any) -> None:
    """`check_field`'s message as a RunConfigError, the error this module's callers catch."""
    try:
        check_field(ok, field, expected, got)
    except ConfigError as err:
        raise RunConfigError(str(err)) from None


def _field(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _validate(cfg: "RunConfig") -> None:
    """Every field's type and range (`_FIELD_CHECKS`), then the rules that tie fields together."""
    for name, (ok, expected) in _FIELD_CHECKS.items():
        value = _field(cfg, name)
        _check(ok(value), name, expected + _yaml_hint(value, expected), value)
    if cfg.global_batch % cfg.grad_accum:
        raise RunConfigError(f"global_batch ({cfg.global_batch}) must be a multiple of grad_accum "
                             f"({cfg.grad_accum})")
    if cfg.draft.config is None:
        raise RunConfigError("draft.config: required (a draft config JSON: DSparkConfig or DeepSpec)")
    if cfg.backbone.config is None and not (cfg.backbone.family == "qwen3" and cfg.backbone.params):
        raise RunConfigError("backbone.config: required (or, for qwen3, backbone.params naming a HF folder)")
    loss = cfg.loss
    if not (loss.ce_weight or loss.l1_weight or loss.conf_weight):
        raise RunConfigError("loss: ce_weight, l1_weight and conf_weight are all 0; nothing would be trained")
    fill = [a for a in ("data", "fsdp", "expert", "tensor") if getattr(cfg.mesh, a) == -1]
    if len(fill) > 1:
        raise RunConfigError(f"mesh: at most one axis may be -1 (all remaining devices), got {fill}")
    d = cfg.distributed
    if d.num_processes is not None and d.process_id is not None:
        _check(d.process_id < d.num_processes, "distributed.process_id",
               f"an integer in [0, {d.num_processes}) (num_processes)", d.process_id)


def _yaml_hint(value, expected: str) -> str:
    """A number field given a string that reads as a number: YAML 1.1 reads `1e-4` (no dot) and any quoted
    value as strings, so say how to write it."""
    if not (isinstance(value, str) and ("number" in expected or "integer" in expected)):
        return ""
    try:
        if not math.isfinite(float(value)):
            return ""
    except ValueError:
        return ""
    return " (YAML read a string: write numbers unquoted, with a dot before an exponent: 1.0e-4, not 1e-4)"
