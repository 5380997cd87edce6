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
import os
from pathlib import Path
from typing import Any

from dspark_jax.errors import UserError
from dspark_jax.train.data import DataConfig


class RunConfigError(UserError):
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
        if not isinstance(self.compiler_options, dict):
            raise RunConfigError(f"compiler_options: expected a mapping of XLA options, got {self.compiler_options!r}")
        for name in ("steps", "global_batch", "grad_accum"):
            _positive_int(getattr(self, name), name)
        if self.global_batch % self.grad_accum:
            raise RunConfigError(f"global_batch ({self.global_batch}) must be a multiple of grad_accum "
                                 f"({self.grad_accum})")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise RunConfigError(f"compute_dtype: expected 'float32' or 'bfloat16', got {self.compute_dtype!r}")
        if self.backbone.family not in ("mhc", "qwen3"):
            raise RunConfigError(f"backbone.family: expected 'mhc' or 'qwen3', got {self.backbone.family!r}")
        if self.backbone.tap_mode not in (None, "entry", "output"):
            raise RunConfigError(f"backbone.tap_mode: expected 'entry' or 'output', got {self.backbone.tap_mode!r}")
        if self.draft.config is None:
            raise RunConfigError("draft.config: required (a draft config JSON: DSparkConfig or DeepSpec)")
        if self.backbone.config is None and not (self.backbone.family == "qwen3" and self.backbone.params):
            raise RunConfigError("backbone.config: required (or, for qwen3, backbone.params naming a HF folder)")
        if self.loss.fp8_grad not in ("straight_through", "exact"):
            raise RunConfigError(f"loss.fp8_grad: expected 'straight_through' or 'exact', got {self.loss.fp8_grad!r}")
        if self.loss.vocab_chunk is not None:
            _positive_int(self.loss.vocab_chunk, "loss.vocab_chunk")
        for name in ("lr", "clip_norm", "eps"):
            v = getattr(self.optim, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise RunConfigError(f"optim.{name}: expected a positive number, got {v!r}")
        if not 0 <= self.optim.warmup_frac < 1:
            raise RunConfigError(f"optim.warmup_frac: expected a number in [0, 1), got {self.optim.warmup_frac!r}")
        _positive_int(self.checkpoint.every, "checkpoint.every")
        _positive_int(self.checkpoint.keep, "checkpoint.keep")
        _positive_int(self.log.every, "log.every")

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
                raise RunConfigError(f"unknown key '{key}' (known: {sorted(top)})")
            if key in sections:
                kwargs[key] = _section(sections[key], value, key)
            else:
                kwargs[key] = value
        if "data" not in kwargs:
            raise RunConfigError("data: required section (at least data.train)")
        base = Path(base_dir) if base_dir is not None else None
        res = lambda p: _resolve(p, base)  # noqa: E731
        kwargs["backbone"] = dataclasses.replace(kwargs.get("backbone", BackboneSpec()),
                                                 config=res(kwargs.get("backbone", BackboneSpec()).config),
                                                 params=res(kwargs.get("backbone", BackboneSpec()).params))
        dr = kwargs.get("draft", DraftSpec())
        kwargs["draft"] = dataclasses.replace(dr, config=res(dr.config), init=res(dr.init))
        data = kwargs["data"]
        kwargs["data"] = dataclasses.replace(data, train=tuple(res(p) for p in data.train),
                                             tokenizer=res(data.tokenizer), seed=kwargs.get("seed", 0))
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
            raise RunConfigError(f"unknown key '{name}.{key}' (known: {sorted(fields)})")
    if cls is DataConfig and "train" not in value:
        raise RunConfigError("data.train: required (JSONL files or glob patterns)")
    if cls is DataConfig and "seed" in value:
        raise RunConfigError("data.seed: set the top-level 'seed' instead")
    try:
        return cls(**value)
    except TypeError as err:
        raise RunConfigError(f"{name}: {err}") from None


def _resolve(p, base: Path | None):
    if p is None:
        return None
    p = str(p)
    if os.path.isabs(p) or base is None:
        return p
    cand = base / p
    if cand.exists() or any(ch in p for ch in "*?[") and list(base.glob(p)):
        return str(cand)
    return p


def _positive_int(v, name):
    if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
        raise RunConfigError(f"{name}: expected a positive integer, got {v!r}")
