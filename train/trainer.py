"""Frozen-backbone DSpark training on a device mesh (SPEC 8).

    trainer = Trainer(RunConfig.from_yaml("configs/train_tiny.yaml"))
    trainer.restore()                    # resume from run_dir/checkpoints if any
    trainer.fit()                        # until cfg.steps; metrics.jsonl, checkpoints, tqdm bar

One jitted step does everything on device: the frozen backbone forward over the batch (teacher logits
and taps; its parameters are an input, never in the optimizer, under stop_gradient), the draft's
teacher-forced forward on per-anchor rings, the chunked/fused loss, gradient accumulation over
micro-batches (a scan whose loss normaliser is the whole step's weight sum, so accumulating equals one
big batch), global-norm clipping, AdamW on f32 master weights, and the metrics.

Sharding: a mesh with axes data, fsdp, expert, tensor (`dspark_jax.parallel`); draft parameters and
their Adam moments follow `draft.param_shardings` (experts over `expert`, embed dims over `fsdp`), the
backbone's follow its logical axes, the batch is split over (data, fsdp). Multi-host: each process
feeds its own slice of the global batch (`jax.make_array_from_process_local_data`); call
`init_distributed` before anything touches the devices (the CLI does).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from dspark_jax import drafts
from dspark_jax import spec_round as sr
from dspark_jax.backbones.mhc import MhcBackbone, MhcConfig
from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Config
from dspark_jax.checkpoint.orbax_io import is_orbax_checkpoint, restore_params
from dspark_jax.checkpoint.qwen3_hf import load_qwen3_hf
from dspark_jax.errors import UserError
from dspark_jax.parallel import fit_shardings, logical_shardings, make_mesh
from dspark_jax.train.anchors import make_blocks
from dspark_jax.train.config import DistributedConfig, LossConfig, MeshConfig, OptimConfig, RunConfig
from dspark_jax.train.data import Batches, JsonlStream
from dspark_jax.train.loss import LossWeights, loss_from_sums, position_weights
from dspark_jax.train.model import block_loss_sums, draft_forward


class TrainState(NamedTuple):
    step: jax.Array  # i32[]
    params: Any  # draft parameters, f32
    opt_state: Any


# ---------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------


def lr_schedule(optim: OptimConfig, steps: int):
    """Linear warmup over round(warmup_frac * steps) updates (the first update already has lr > 0), then a
    cosine from the peak to 0 over the remaining steps."""
    warmup = int(round(optim.warmup_frac * steps))
    peak = float(optim.lr)

    def schedule(count):
        s = jnp.asarray(count, jnp.float32)
        warm = peak * (s + 1.0) / max(warmup, 1)
        frac = jnp.clip((s - warmup) / max(steps - warmup, 1), 0.0, 1.0)
        cos = 0.5 * peak * (1.0 + jnp.cos(jnp.pi * frac))
        return jnp.where(s < warmup, warm, cos)

    return schedule


def make_optimizer(optim: OptimConfig, steps: int) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(optim.clip_norm),
                       optax.adamw(lr_schedule(optim, steps), b1=optim.b1, b2=optim.b2, eps=optim.eps,
                                   weight_decay=optim.weight_decay))


def resolve_mesh(cfg: MeshConfig, devices=None):
    devices = list(devices if devices is not None else jax.devices())
    sizes = {"data": cfg.data, "fsdp": cfg.fsdp, "expert": cfg.expert, "tensor": cfg.tensor}
    fill = [k for k, v in sizes.items() if v == -1]
    if len(fill) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {fill}")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if any(v == 0 or v < -1 for v in sizes.values()):
        raise ValueError(f"mesh: axis sizes must be positive or -1, got {sizes}")
    if fill:
        if len(devices) % fixed:
            raise ValueError(f"mesh: {len(devices)} devices are not a multiple of the fixed axes' product {fixed}")
        sizes[fill[0]] = len(devices) // fixed
    return make_mesh(**sizes, devices=devices)


def build_backbone(spec):
    """-> (backbone, params or None). params None = the caller initialises them randomly."""
    if spec.family == "mhc":
        return MhcBackbone(MhcConfig.from_json(spec.config))
    path = spec.config or str(Path(spec.params) / "config.json")
    return Qwen3Backbone(Qwen3Config.from_hf_json(path))


def batch_spec(mesh) -> PartitionSpec:
    """[grad_accum, batch, ...]: the batch dimension over (data, fsdp)."""
    axes = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
    return PartitionSpec(None, axes if len(axes) > 1 else (axes[0] if axes else None))


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Everything the compiled step depends on (hashable: steps with equal specs share one executable)."""

    backbone_type: type
    backbone_cfg: Any
    tap_mode: str
    draft_cfg: Any  # any draft family's config
    loss: LossConfig
    optim: OptimConfig
    steps: int
    mesh: Any
    grad_accum: int
    micro_batch: int  # global sequences per micro-batch
    seq_len: int
    anchors: int
    compiler_options: tuple = ()  # sorted (name, value) XLA options for this compile


class CompiledStep(NamedTuple):
    fn: Any  # (state, backbone params, batch) -> (state, metrics)
    tx: optax.GradientTransformation
    state_shardings: TrainState
    backbone_shardings: Any
    batch_shardings: dict


def micro_loss(spec: StepSpec, params, bb_params, mb: dict, normalizer):
    """The objective of one micro-batch: (loss = weighted term sums / normalizer, loss sums).

    The backbone runs here (teacher logits and taps of every position); everything taken from it is
    under stop_gradient, so its parameters get exactly zero gradient."""
    backbone = spec.backbone_type(spec.backbone_cfg)
    tokens = mb["tokens"]
    b, t = tokens.shape
    out = backbone.forward(bb_params, backbone.init_cache(b, t), tokens, taps=spec.draft_cfg.target_layer_ids,
                           tap_mode=spec.tap_mode)
    return draft_loss(params, backbone.tied(bb_params), spec.draft_cfg, spec.loss, out.taps, out.logits, mb,
                      normalizer)


def draft_loss(params, tied: dict, dcfg, lc: LossConfig, taps, teacher_logits, mb: dict, normalizer):
    """The draft's objective on one micro-batch given the backbone's taps [B, T, n_taps*D] and logits
    [B, T, V] (both, and the tied weights, under stop_gradient): (loss, loss sums). `mb` holds tokens,
    loss_mask, anchors and anchor_valid as in the batch."""
    blocks = make_blocks(mb["tokens"], mb["loss_mask"], mb["anchors"], mb["anchor_valid"], dcfg.block_size,
                         dcfg.noise_token_id)
    main_hidden, teacher = jax.lax.stop_gradient(taps), jax.lax.stop_gradient(teacher_logits)
    tied = jax.lax.stop_gradient(tied)
    acts = draft_forward(params, tied, dcfg, main_hidden, blocks, mb["anchors"],
                         detach_conf_inputs=lc.detach_conf_inputs, impl="xla", fp8_grad=lc.fp8_grad)
    sums = block_loss_sums(params, tied, dcfg, acts, teacher, blocks, decay_gamma=lc.decay_gamma,
                           vocab_chunk=lc.vocab_chunk, fused=lc.fused)
    loss = (lc.ce_weight * sums["ce"] + lc.l1_weight * sums["l1"] + lc.conf_weight * sums["conf"]) / normalizer
    return loss, sums


def step_normalizer(spec: StepSpec, batch: dict) -> jax.Array:
    """sum of w_k over every supervised slot of the whole step (all micro-batches) + 1e-6."""
    dcfg = spec.draft_cfg
    masks = jax.vmap(lambda mb: make_blocks(mb["tokens"], mb["loss_mask"], mb["anchors"], mb["anchor_valid"],
                                            dcfg.block_size, dcfg.noise_token_id).mask)(batch)
    w = position_weights(dcfg.block_size, spec.loss.decay_gamma)
    return jnp.sum(jnp.where(masks, w, 0.0)) + 1e-6


def _step_fn(spec: StepSpec, tx):
    lc = spec.loss
    weights = LossWeights(lc.ce_weight, lc.l1_weight, lc.conf_weight, lc.decay_gamma)
    schedule = lr_schedule(spec.optim, spec.steps)

    def micro(params, bb_params, mb, normalizer):
        (_, sums), grads = jax.value_and_grad(lambda p: micro_loss(spec, p, bb_params, mb, normalizer),
                                              has_aux=True)(params)
        return grads, sums

    def step(state: TrainState, bb_params, batch):
        bb_params = jax.lax.stop_gradient(bb_params)
        normalizer = step_normalizer(spec, batch)
        first = jax.tree.map(lambda x: x[0], batch)
        if spec.grad_accum == 1:
            grads, sums = micro(state.params, bb_params, first, normalizer)
        else:
            def body(carry, mb):
                g, s = micro(state.params, bb_params, mb, normalizer)
                return jax.tree.map(jnp.add, carry, (g, s)), None

            zeros = jax.eval_shape(lambda: micro(state.params, bb_params, first, normalizer))
            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), zeros)
            (grads, sums), _ = jax.lax.scan(body, zeros, batch)
        _, metrics = loss_from_sums(sums, weights, normalizer)
        metrics["grad_norm"] = optax.global_norm(grads)
        metrics["lr"] = schedule(state.step)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, opt_state), metrics

    return step


@functools.lru_cache(maxsize=8)
def compile_step(spec: StepSpec) -> CompiledStep:
    mesh = spec.mesh
    tx = make_optimizer(spec.optim, spec.steps)
    step = _step_fn(spec, tx)
    backbone = spec.backbone_type(spec.backbone_cfg)
    dcfg = spec.draft_cfg
    p_sh = drafts.param_shardings(dcfg, mesh)
    abstract_p = drafts.abstract_params(dcfg)
    abstract_opt = jax.eval_shape(tx.init, abstract_p)
    rep = NamedSharding(mesh, PartitionSpec())
    opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, abstract_opt, p_sh,
                                   transform_non_params=lambda _: rep)
    state_sh = TrainState(rep, p_sh, opt_sh)
    bb_sh = fit_shardings(logical_shardings(backbone.logical_axes(), mesh), backbone.abstract_params())
    bs = batch_spec(mesh)
    batch_sh = {k: NamedSharding(mesh, PartitionSpec(*bs, None)) for k in ("tokens", "loss_mask", "anchors",
                                                                          "anchor_valid")}
    a, b, t, n = spec.grad_accum, spec.micro_batch, spec.seq_len, spec.anchors
    abstract_batch = {
        "tokens": jax.ShapeDtypeStruct((a, b, t), jnp.int32, sharding=batch_sh["tokens"]),
        "loss_mask": jax.ShapeDtypeStruct((a, b, t), jnp.bool_, sharding=batch_sh["loss_mask"]),
        "anchors": jax.ShapeDtypeStruct((a, b, n), jnp.int32, sharding=batch_sh["anchors"]),
        "anchor_valid": jax.ShapeDtypeStruct((a, b, n), jnp.bool_, sharding=batch_sh["anchor_valid"]),
    }
    def with_sh(tree, shs):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shs)

    abstract_state = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), with_sh(abstract_p, p_sh),
                                with_sh(abstract_opt, opt_sh))
    jitted = jax.jit(step, in_shardings=(state_sh, bb_sh, batch_sh), out_shardings=(state_sh, rep),
                     donate_argnums=(0,))
    compiled = jitted.lower(abstract_state, with_sh(backbone.abstract_params(), bb_sh), abstract_batch).compile(
        dict(spec.compiler_options) or None)
    return CompiledStep(compiled, tx, state_sh, bb_sh, batch_sh)


def check_run_dir(run_dir: Path) -> None:
    """run_dir is a folder, or can become one (its nearest existing ancestor is a writable folder):
    checked before the compile, so a typo does not cost minutes."""
    for place in (run_dir, *run_dir.absolute().parents):
        if not place.exists():
            continue
        if not place.is_dir():
            raise UserError(f"run_dir: {run_dir}: {place} is a file; expected a folder for the checkpoints "
                            "and metrics.jsonl" if place == run_dir else
                            f"run_dir: {run_dir}: {place} is a file, so the folder cannot be created")
        if place != run_dir and not os.access(place, os.W_OK):
            raise UserError(f"run_dir: {run_dir}: cannot create it in {place} (permission denied)")
        return


def init_distributed(cfg: DistributedConfig) -> None:
    """jax.distributed.initialize from the run config or DSPARK_COORDINATOR / DSPARK_NUM_PROCESSES /
    DSPARK_PROCESS_ID (no-op for a single process). Must run before anything touches the devices."""
    coordinator = cfg.coordinator or os.environ.get("DSPARK_COORDINATOR")
    num = cfg.num_processes if cfg.num_processes is not None else os.environ.get("DSPARK_NUM_PROCESSES")
    pid = cfg.process_id if cfg.process_id is not None else os.environ.get("DSPARK_PROCESS_ID")
    if not coordinator and not cfg.auto:
        return
    if cfg.cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    if coordinator:
        if num is None or pid is None:
            raise ValueError("distributed: a coordinator needs num_processes and process_id (config or "
                             "DSPARK_NUM_PROCESSES / DSPARK_PROCESS_ID)")
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=int(num), process_id=int(pid))
    else:
        jax.distributed.initialize()


# ---------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------


class Trainer:
    """Owns the mesh, the frozen backbone parameters, the train state, the data and the checkpoints."""

    def __init__(self, cfg: RunConfig, *, mesh=None, backbone_params=None, draft_params=None):
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else resolve_mesh(cfg.mesh)
        self.backbone = build_backbone(cfg.backbone)
        self.draft_cfg = drafts.load_config(cfg.draft.config).replace(param_dtype="float32",
                                                                          compute_dtype=cfg.compute_dtype)
        self.tap_mode = _tap_mode(cfg.backbone.tap_mode, self.draft_cfg)
        sr.check_draft_fits_backbone(self.draft_cfg, self.backbone, self.tap_mode)
        # Everything a user names (data.pad_id, the data files, the tokenizer) is checked before the compile
        # below, which takes minutes at real sizes; the stream only opens files when it is read.
        cfg.check_vocab(self.draft_cfg.vocab_size)
        self._stream = JsonlStream(cfg.data, vocab_size=self.draft_cfg.vocab_size)
        self._stream.check_usable()
        check_run_dir(Path(cfg.run_dir))
        for field, path, given in (("backbone.params", cfg.backbone.params, backbone_params),
                                   ("draft.init", cfg.draft.init, draft_params)):
            if path is not None and given is None and not Path(path).exists():
                raise UserError(f"{field}: {path} does not exist")
        n_proc = jax.process_count()
        if cfg.micro_batch % n_proc:
            raise ValueError(f"global_batch / grad_accum = {cfg.micro_batch} sequences per micro-batch must be a "
                             f"multiple of the number of processes ({n_proc})")
        shards = math.prod(self.mesh.shape.get(a, 1) for a in ("data", "fsdp"))
        if cfg.micro_batch % shards:
            raise ValueError(f"global_batch / grad_accum = {cfg.micro_batch} must be a multiple of the data*fsdp "
                             f"mesh size ({shards})")
        self.spec = StepSpec(type(self.backbone), self.backbone.cfg, self.tap_mode, self.draft_cfg, cfg.loss,
                             cfg.optim, cfg.steps, self.mesh, cfg.grad_accum, cfg.micro_batch, cfg.data.seq_len,
                             cfg.data.anchors_per_seq, tuple(sorted(cfg.compiler_options.items())))
        self.compiled = compile_step(self.spec)
        self.backbone_params = self._place(backbone_params if backbone_params is not None
                                           else self._load_backbone_params(), self.compiled.backbone_shardings)
        params = draft_params if draft_params is not None else self._init_draft_params()
        self.state = self._init_state(params)
        self.run_dir = Path(cfg.run_dir)
        self._manager = None
        self._unreadable: set[int] = set()  # checkpoint steps restore() could not read
        self._batches: Batches | None = None

    # ---- parameters ------------------------------------------------------------------------------
    def _place(self, tree, shardings):
        return jax.tree.map(lambda x, s: jax.make_array_from_callback(
            np.shape(x), s, lambda idx, x=x: np.asarray(x)[idx]) if not isinstance(x, jax.Array)
            else jax.device_put(x, s), tree, shardings)

    def _load_backbone_params(self):
        spec = self.cfg.backbone
        if spec.params is None:
            return jax.device_get(self.backbone.init_params(jax.random.key(spec.init_seed)))
        if is_orbax_checkpoint(spec.params):
            return restore_params(spec.params, self.compiled.backbone_shardings)
        if spec.family == "qwen3":
            _, params = load_qwen3_hf(spec.params)
            return params
        raise ValueError(f"backbone.params: {spec.params} is not an Orbax checkpoint")

    def _init_draft_params(self):
        spec = self.cfg.draft
        if spec.init is None:
            params = drafts.init_params(self.draft_cfg, jax.random.key(spec.init_seed))
            return jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(params))
        target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=s),
                              drafts.abstract_params(self.draft_cfg), self.compiled.state_shardings.params)
        return restore_params(spec.init, target)

    def _init_state(self, params) -> TrainState:
        sh = self.compiled.state_shardings
        params = self._place(jax.tree.map(lambda x: x.astype(jnp.float32) if isinstance(x, jax.Array)
                                          else np.asarray(x, np.float32), params), sh.params)
        opt_state = jax.jit(self.compiled.tx.init, out_shardings=sh.opt_state)(params)
        step = jax.device_put(jnp.zeros((), jnp.int32), sh.step)
        return TrainState(step, params, opt_state)

    # ---- stepping --------------------------------------------------------------------------------
    def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host-local numpy batch [grad_accum, per_host_batch, ...] -> global sharded arrays."""
        out = {}
        n_proc = jax.process_count()
        for k, sh in self.compiled.batch_shardings.items():
            local = np.asarray(batch[k])
            global_shape = (local.shape[0], local.shape[1] * n_proc, *local.shape[2:])
            out[k] = jax.make_array_from_process_local_data(sh, local, global_shape)
        return out

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """One optimizer step on a host-local batch; returns the (device) metrics."""
        self.state, metrics = self.compiled.fn(self.state, self.backbone_params, self.put_batch(batch))
        return metrics

    def spec_pair(self, temperatures=None, impl: str = "auto"):
        """(SpecModel, Weights) of the current draft and the frozen backbone, for `train.rollout`."""
        k = self.draft_cfg.block_size
        temps = jnp.ones((k,), jnp.float32) if temperatures is None else jnp.asarray(temperatures, jnp.float32)
        model = sr.SpecModel(self.backbone, self.draft_cfg, tap_mode=self.tap_mode, impl=impl)
        weights = sr.Weights(self.backbone_params, self.state.params, self.backbone.tied(self.backbone_params), temps)
        return model, weights

    # ---- data ------------------------------------------------------------------------------------
    def batches(self) -> Batches:
        if self._batches is None:
            self._batches = Batches(self._stream, self.cfg.micro_batch // jax.process_count(), self.cfg.grad_accum)
        return self._batches

    def _seek_data(self, step: int) -> None:
        b = self.batches()
        b.stream.seek(step * b.per_host_batch * b.grad_accum)

    # ---- checkpoints -----------------------------------------------------------------------------
    @property
    def manager(self):
        if self._manager is None:
            import orbax.checkpoint as ocp  # noqa: PLC0415

            opts = ocp.CheckpointManagerOptions(max_to_keep=self.cfg.checkpoint.keep, create=True)
            self._manager = ocp.CheckpointManager((self.run_dir / "checkpoints").absolute(), options=opts)
        return self._manager

    def save(self) -> int:
        import orbax.checkpoint as ocp  # noqa: PLC0415

        step = int(jax.device_get(self.state.step))
        if step in self.manager.all_steps():  # after rewinding to an older checkpoint: replace it
            if step in self._unreadable:
                self._set_aside(step)  # a corrupt one is kept for inspection, never deleted
            else:
                self.manager.delete(step)
        self.manager.save(step, args=ocp.args.StandardSave(self.state._asdict()), force=True)
        self.manager.wait_until_finished()
        return step

    def restore(self, step: int | None = None) -> int | None:
        """Load the latest INTACT (or the given) checkpoint of run_dir into the state; -> its step, or
        None when there is none. An unreadable checkpoint is skipped with a warning and kept on disk
        (set aside to run_dir/unreadable_checkpoints/ if training reaches its step again); metrics.jsonl
        loses the records after the restored step, so no step is logged twice."""
        import orbax.checkpoint as ocp  # noqa: PLC0415

        where = self.run_dir / "checkpoints"
        steps = sorted(self.manager.all_steps(), reverse=True) if step is None else [step]
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                self.state._asdict())
        problems = []
        for s in steps:
            try:
                restored = self.manager.restore(s, args=ocp.args.StandardRestore(abstract))
            except Exception as err:  # noqa: BLE001 (Orbax / TensorStore raise many kinds for a bad file)
                problem = f"step {s}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                if step is not None:
                    raise UserError(f"checkpoint {where}/{s} cannot be restored ({problem})") from err
                warnings.warn(f"checkpoint {where}/{s} is unreadable ({problem}); it is kept, trying the "
                              "previous one", stacklevel=2)
                self._unreadable.add(s)
                problems.append(problem)
                continue
            self.state = TrainState(**restored)
            self._seek_data(int(jax.device_get(self.state.step)))
            self._rewind_metrics(s)
            return s
        if problems:
            raise UserError(f"no intact checkpoint in {where} ({'; '.join(problems)}); fix or move them, or "
                            "start fresh with --no-resume in another run_dir")
        return None

    def _set_aside(self, step: int) -> None:
        """Move an unreadable checkpoint out of Orbax's directory (kept), so its step can be saved again."""
        aside = self.run_dir / "unreadable_checkpoints"
        if jax.process_index() == 0:
            aside.mkdir(parents=True, exist_ok=True)
            target = aside / f"{step}-{int(time.time())}"
            (self.run_dir / "checkpoints" / str(step)).rename(target)
            warnings.warn(f"unreadable checkpoint of step {step} moved to {target}", stacklevel=3)
        self._unreadable.discard(step)
        self._manager = None  # it caches the steps on disk

    def _rewind_metrics(self, step: int) -> None:
        """Drop metrics.jsonl records after `step`: the resumed run logs those steps again."""
        log = self.run_dir / "metrics.jsonl"
        if jax.process_index() != 0 or not log.is_file():
            return
        lines = log.read_text().splitlines(keepends=True)
        kept = [x for x in lines if _logged_step(x) <= step]
        if len(kept) != len(lines):
            log.write_text("".join(kept))

    # ---- the loop --------------------------------------------------------------------------------
    def fit(self, until: int | None = None, *, progress: bool = True) -> dict[str, Any]:
        """Train until step `until` (default cfg.steps): logs metrics.jsonl, checkpoints every
        cfg.checkpoint.every steps and at the end. -> the last logged metrics."""
        from tqdm import tqdm  # noqa: PLC0415

        until = self.cfg.steps if until is None else until
        start = int(jax.device_get(self.state.step))
        lead = jax.process_index() == 0
        if lead:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.cfg.save_json(self.run_dir / "run_config.json")
        if self._batches is None:
            self._seek_data(start)
        batches = self.batches()
        tokens_per_step = self.cfg.global_batch * self.cfg.data.seq_len
        bar = tqdm(total=until, initial=start, disable=not (progress and lead), desc="train", dynamic_ncols=True)
        last: dict[str, Any] = {}
        t0 = time.perf_counter()
        since = 0
        with open(self.run_dir / "metrics.jsonl", "a") if lead else _Null() as log:
            for s in range(start, until):
                metrics = self.step(next(batches))
                since += 1
                done = s + 1
                if done % self.cfg.log.every == 0 or done == until:
                    rec = metrics_record(jax.device_get(metrics), done)
                    dt = time.perf_counter() - t0
                    rec["tokens_per_s"] = since * tokens_per_step / max(dt, 1e-9)
                    t0, since = time.perf_counter(), 0
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    bar.set_postfix(loss=f"{rec['loss']:.4f}", tau=f"{rec['tau_estimate']:.3f}")
                    last = rec
                if done % self.cfg.checkpoint.every == 0 or done == until:
                    self.save()
                bar.update(1)
        bar.close()
        return last


def _logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; a torn last line (an interrupted write) counts as after all."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")


def metrics_record(m: dict, step: int) -> dict[str, Any]:
    rec: dict[str, Any] = {"step": step}
    for k, v in m.items():
        v = np.asarray(v)
        if k == "accept_rate":
            rec.update({f"accept_rate@{i + 1}": float(a) for i, a in enumerate(v)})
        else:
            rec[k] = float(v)
    return rec


def _tap_mode(requested: str | None, cfg) -> str:
    """backbone.tap_mode of the run config, or the draft family's when unset; they must agree."""
    if requested is not None and requested != cfg.tap_mode:
        raise ValueError(f"backbone.tap_mode: the {cfg.family!r} draft family reads backbone taps {cfg.tap_mode!r}, "
                         f"got {requested!r} (leave it unset to use the family's)")
    return cfg.tap_mode


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def write(self, _):
        pass

    def flush(self):
        pass
