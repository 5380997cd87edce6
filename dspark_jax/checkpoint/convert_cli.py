"""`dspark convert SRC DST --to {orbax,bf16,fp8}`: V4.1 draft checkpoints between formats.

SRC is a V4.1 safetensors checkpoint (a `.safetensors` file, a folder of shards, or a folder / file
`model.safetensors.index.json`), an Orbax checkpoint written by this command, or a `dspark train`
checkpoint (the run folder, its checkpoints/ folder or one step folder; `train_checkpoint` reads its draft).
  * safetensors -> orbax: load `mtp.{s}.*` (+ `embed.weight`, `head.weight`) into our tree
    (fp8 / fp4 dequantised) and save `{"params": ..., "tied": {...}}` with the config in the metadata.
  * safetensors -> bf16 | fp8 safetensors: streamed one tensor at a time (memory ~ one tensor).
  * orbax -> bf16 | fp8 safetensors: restore on the host and export the V4.1 layout.
The config comes from --config, else the Orbax metadata (a train checkpoint: the draft config its
run_config.json names), else `config.json` / `dspark_config.json` beside SRC (HF, inference and our own
spellings all load).
  * train checkpoint -> bf16 | fp8 (V4.1), bf16 | f32 (DeepSpec): its draft (latest step unless SRC is a step
    folder), with --no-tied: training ties the draft to the backbone's embedding and head, which it does not save.

The output is written into a hidden folder inside DST and moved into DST once complete
(`output_folder.staged_output`): a failed run (a full disk, a bad tensor, Ctrl-C) leaves DST as it was.

`--family deepspec` (chosen automatically when the config is a DeepSpec `Qwen3DSparkModel` config.json):
SRC is a DeepSpec Qwen3 draft folder (config.json + model.safetensors, e.g. deepseek-ai/dspark_qwen3_8b_block7)
or an Orbax checkpoint written by this command; `dspark_jax.checkpoint.deepspec` holds the mapping.
  * --to bf16 | f32: the DeepSpec layout again (config.json + model.safetensors), streamed;
  * --to orbax: our tree `{"params": ..., "tied": {...}}` (tied = embed_tokens / lm_head);
  * --to bundle --backbone QWEN3_DIR: a serving bundle (`dspark generate --bundle DST`) of the Hugging Face
    Qwen3 target in QWEN3_DIR (config.json + safetensors, its tokenizer.json copied when present) and the draft.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from dspark_jax.checkpoint.output_folder import leftover_staging, naming_file, staged_output
from dspark_jax.checkpoint.safetensors_io import CheckpointError
from dspark_jax.checkpoint.train_checkpoint import TrainCheckpoint, find_train_checkpoint
from dspark_jax.checkpoint.trees import flatten_paths
from dspark_jax.validation import check_number_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", type=Path, help="V4.1 safetensors file/folder/index, an Orbax checkpoint folder "
                                               "(written by convert), or a dspark train run / checkpoint folder")
    parser.add_argument("dst", type=Path, help="output folder")
    parser.add_argument("--to", required=True, choices=("orbax", "bf16", "fp8", "f32", "bundle"),
                        help="orbax: our tree; bf16: V4.1 layout dequantised; fp8: V4.1 layout as the official "
                             "checkpoint stores it (fp8 dense, fp4 experts); DeepSpec drafts: bf16 | f32 (their "
                             "layout), orbax, or bundle (with --backbone)")
    parser.add_argument("--family", default=None, choices=("v41", "deepspec"),
                        help="draft checkpoint family (default: from the config; deepspec = Qwen3DSparkModel)")
    parser.add_argument("--backbone", type=Path, default=None,
                        help="--to bundle: the Hugging Face Qwen3 target folder (config.json + safetensors)")
    parser.add_argument("--config", type=Path, default=None,
                        help="draft config json (default: Orbax metadata, or config.json beside SRC)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="dtype of non-f32 leaves when writing Orbax (default bfloat16)")
    parser.add_argument("--tied", type=Path, default=None,
                        help="checkpoint holding embed.weight / head.weight if not in SRC")
    parser.add_argument("--no-tied", action="store_true", help="do not read or write embed.weight / head.weight")
    parser.add_argument("--max-shard-gb", type=float, default=4.0, help="safetensors shard size (default 4)")
    parser.add_argument("--fp4-dtype", default="I8", choices=("I8", "F4"),
                        help="safetensors dtype of packed fp4 experts with --to fp8 (default I8 [out, in/2])")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _config_for(args, src_is_orbax: bool, train: TrainCheckpoint | None):
    from dspark_jax import drafts  # noqa: PLC0415

    if args.config is not None:
        return drafts.load_config(args.config)
    if train is not None:
        from dspark_jax.checkpoint.train_checkpoint import draft_config_path  # noqa: PLC0415

        return drafts.load_config(draft_config_path(train))
    if src_is_orbax:
        from dspark_jax.checkpoint.orbax_io import saved_config  # noqa: PLC0415

        cfg = saved_config(args.src)
        if cfg is not None:
            return cfg
    folder = args.src if args.src.is_dir() else args.src.parent
    for name in ("config.json", "dspark_config.json"):
        if (folder / name).is_file():
            return drafts.load_config(folder / name)
    raise CheckpointError(f"no config: pass --config (none stored with {args.src}, no config.json beside it)")


def _check_dst(dst: Path, overwrite: bool) -> None:
    if not dst.exists() or overwrite:
        return
    entries = list(dst.iterdir()) if dst.is_dir() else [dst]
    if not entries:
        return
    stale = leftover_staging(entries)
    if len(stale) == len(entries):  # only what a killed run left: say so rather than just "not empty"
        raise CheckpointError(f"{dst} holds only {', '.join(stale)}, the partial output of an interrupted "
                              "dspark convert: delete it (or pass --overwrite)")
    raise CheckpointError(f"{dst} exists and is not empty (pass --overwrite to replace)")


def _staged(args, *, whole: bool = False):
    """The output folder, written in staging and moved into DST at the end (see the module docstring).
    --overwrite replaces the whole of DST for an Orbax checkpoint (`whole`), else its old shards and index
    only: old shards beside new ones would be read as one checkpoint with duplicate tensors."""
    def replaced(dst: Path) -> list[Path]:
        if not args.overwrite:
            return []
        if whole:
            return list(dst.iterdir())
        return [*dst.glob("*.safetensors"), *dst.glob("model.safetensors.index.json")]

    return staged_output(args.dst, replaced)


def _write_config(cfg, path: Path) -> None:
    with naming_file(path):
        cfg.to_json(path)


def safetensors_to_orbax(src, cfg, dst, *, dtype="bfloat16", with_tied=True, tied_path=None, overwrite=False,
                         progress=False, concurrent_gb: int = 1) -> int:
    """V4.1 safetensors -> Orbax `{"params": ..., "tied": ...}` (config in the metadata); returns the
    tree's bytes. Memory: the tree once, plus at most `concurrent_gb` staged by Orbax."""
    from dspark_jax.checkpoint import orbax_io, v41  # noqa: PLC0415

    params, tied = v41.load_v41_draft(src, cfg, dtype=dtype, with_tied=with_tied, tied_path=tied_path,
                                      progress=progress)
    tree = {"params": params} if tied is None else {"params": params, "tied": tied}
    del params, tied
    nbytes = sum(a.nbytes for a in flatten_paths(tree).values())
    orbax_io.to_device_leafwise(tree)
    orbax_io.save_params(dst, tree, config=cfg, overwrite=overwrite, concurrent_gb=concurrent_gb)
    return nbytes


def convert(args) -> str:
    from dspark_jax import drafts  # noqa: PLC0415
    from dspark_jax.checkpoint import orbax_io, v41  # noqa: PLC0415

    # A shard size <= 0 wrote one shard per tensor and NaN failed with a bare message: refuse both first.
    check_number_flags(args, "max_shard_gb", above=True)
    train = find_train_checkpoint(args.src)
    src_is_orbax = train is not None or orbax_io.is_orbax_checkpoint(args.src)
    if not src_is_orbax and not args.src.exists():
        raise CheckpointError(f"{args.src}: no such file or directory")
    src_dir = (args.src if args.src.is_dir() else args.src.parent).resolve()
    if args.dst.resolve() == src_dir or src_dir.is_relative_to(args.dst.resolve()):
        raise CheckpointError(f"{args.dst}: the output folder must not contain the input {args.src}")
    cfg = _config_for(args, src_is_orbax, train)
    layout = args.family or drafts.family_of(cfg).checkpoint_format  # --family names a checkpoint layout
    if layout == "deepspec":
        return convert_deepspec(args, cfg, src_is_orbax, train)
    if args.to in ("f32", "bundle") or args.backbone is not None:
        raise CheckpointError(f"--to {args.to} / --backbone are for DeepSpec drafts (--family deepspec); V4.1 "
                              "checkpoints convert --to orbax, bf16 or fp8")
    _check_dst(args.dst, args.overwrite)
    shard = int(args.max_shard_gb * (1 << 30))
    progress = not args.quiet
    with_tied = not args.no_tied

    if src_is_orbax:
        if args.to == "orbax":
            raise CheckpointError(_already_orbax(args.src, train, "--to bf16 or --to fp8"))
        tree = _orbax_tree(args.src, train)
        tied = _tied_of(args, tree, train)
        with _staged(args) as out:
            files = v41.export_v41_draft(tree["params"], tied, cfg, out, fmt=args.to, max_shard_bytes=shard,
                                         fp4_dtype=args.fp4_dtype, progress=progress)
            _write_config(cfg, out / "dspark_config.json")
        return f"wrote {len(files)} safetensors file(s) to {args.dst}{_from_train(train)}"

    if args.to == "orbax":
        with _staged(args, whole=True) as out:
            safetensors_to_orbax(args.src, cfg, out / "checkpoint", dtype=args.dtype, with_tied=with_tied,
                                 tied_path=args.tied, progress=progress)
            _flatten_into(out / "checkpoint", out)
        return f"wrote Orbax checkpoint {args.dst}"

    if args.tied is not None:
        raise CheckpointError("--tied is only used with --to orbax; safetensors output copies the tied tensors "
                              "from SRC (or pass --no-tied)")
    with _staged(args) as out:
        files = v41.convert_v41_safetensors(args.src, cfg, out, fmt=args.to, with_tied=with_tied,
                                            max_shard_bytes=shard, fp4_dtype=args.fp4_dtype, progress=progress)
        _write_config(cfg, out / "dspark_config.json")
    return f"wrote {len(files)} safetensors file(s) to {args.dst}"


def _already_orbax(src: Path, train: TrainCheckpoint | None, choices: str) -> str:
    if train is None:
        return f"{src} is already an Orbax checkpoint; choose {choices}"
    return f"{src} is {train.describe()}; convert exports its draft {choices} (with --no-tied)"


def _from_train(train: TrainCheckpoint | None) -> str:
    return "" if train is None else f" (the draft at step {train.step} of the dspark train checkpoint {train.run_dir})"


def _orbax_tree(src: Path, train: TrainCheckpoint | None) -> dict:
    """The tree {"params": ..., "tied"?: ...} of an Orbax source: written by convert, or a train checkpoint's
    draft (the optimizer state is not read)."""
    from dspark_jax.checkpoint import orbax_io  # noqa: PLC0415
    from dspark_jax.checkpoint.train_checkpoint import restore_draft_params  # noqa: PLC0415

    if train is not None:
        return {"params": restore_draft_params(train)}
    tree = orbax_io.restore_params(src)
    if not isinstance(tree, dict) or "params" not in tree:
        raise CheckpointError(f"{src}: expected a tree {{'params': ..., 'tied': ...}} written by dspark convert")
    return tree


def _tied_of(args, tree: dict, train: TrainCheckpoint | None):
    """The tied embed/head to export with the draft, None with --no-tied; a tree without them needs --no-tied,
    so that a draft-only output is never a surprise."""
    if args.no_tied:
        return None
    if "tied" in tree:
        return tree["tied"]
    if train is not None:
        raise CheckpointError(f"{args.src} is {train.describe()}: it holds the draft only (training reads the "
                              "embedding and head from the backbone); pass --no-tied to export the draft of step "
                              f"{train.step} alone")
    raise CheckpointError(f"{args.src} holds no tied embed/head; pass --no-tied to export the draft only")


def _flatten_into(folder: Path, out: Path) -> None:
    """Move `folder`'s entries up into `out`: Orbax writes a checkpoint to a folder that must not exist yet
    (and stages it beside that folder), so it writes one level down in the staging folder."""
    for entry in folder.iterdir():
        os.replace(entry, out / entry.name)
    folder.rmdir()


def convert_deepspec(args, cfg, src_is_orbax: bool, train: TrainCheckpoint | None = None) -> str:
    """The DeepSpec (`Qwen3DSparkModel`) conversions; see the module docstring."""
    from dspark_jax.checkpoint import deepspec, orbax_io  # noqa: PLC0415
    from dspark_jax.drafts.deepspec.config import DeepSpecConfig  # noqa: PLC0415

    if not isinstance(cfg, DeepSpecConfig):
        raise CheckpointError(f"--family deepspec needs a DeepSpec config (architectures [\"Qwen3DSparkModel\"]), "
                              f"got a {cfg.family!r} draft config")
    if args.to == "fp8":
        raise CheckpointError("DeepSpec drafts are stored in bf16 or f32; choose --to bf16, f32, orbax or bundle")
    if args.tied is not None:
        raise CheckpointError("--tied is for V4.1 checkpoints; a DeepSpec checkpoint carries embed_tokens / lm_head")
    if (args.to == "bundle") != (args.backbone is not None):
        raise CheckpointError("--to bundle needs --backbone QWEN3_DIR (and --backbone is only used with --to bundle)")
    _check_dst(args.dst, args.overwrite)
    with_tied = not args.no_tied
    dtype = {"bf16": "BF16", "f32": "F32"}.get(args.to)
    if src_is_orbax:
        if args.to in ("orbax", "bundle") and train is not None:
            raise CheckpointError(f"{args.src} is {train.describe()}; convert exports its draft --to bf16 or f32 "
                                  "(with --no-tied), and that folder converts --to bundle --backbone QWEN3_DIR "
                                  "--no-tied")
        if args.to in ("orbax", "bundle"):
            raise CheckpointError(f"{args.src} is an Orbax checkpoint; convert it --to bf16 or f32 (the DeepSpec "
                                  "layout) first")
        tree = _orbax_tree(args.src, train)
        tied = _tied_of(args, tree, train)
        with _staged(args) as out:
            deepspec.export_deepspec_draft(tree["params"], tied, cfg, out, dtype=dtype)
        return f"wrote the DeepSpec checkpoint {args.dst} ({args.to}){_from_train(train)}"
    if dtype is not None:
        with _staged(args) as out:
            deepspec.convert_deepspec_safetensors(args.src, out, cfg, dtype=dtype, with_tied=with_tied)
        return f"wrote the DeepSpec checkpoint {args.dst} ({args.to})"
    if args.to == "orbax":
        cfg, params, tied = deepspec.load_deepspec_draft(args.src, cfg, dtype=args.dtype, with_tied=with_tied)
        tree = {"params": params} if tied is None else {"params": params, "tied": tied}
        orbax_io.to_device_leafwise(tree)
        with _staged(args, whole=True) as out:
            orbax_io.save_params(out / "checkpoint", tree, config=cfg)
            _flatten_into(out / "checkpoint", out)
        return f"wrote Orbax checkpoint {args.dst}"
    with _staged(args) as out:
        return _deepspec_bundle(args, cfg, out)


def _deepspec_bundle(args, cfg, out: Path) -> str:
    """A serving bundle of a Hugging Face Qwen3 target and a DeepSpec draft (both in --dtype), written to
    `out` (the staging folder of DST)."""
    import shutil  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    from dspark_jax.backbones.qwen3 import Qwen3Backbone  # noqa: PLC0415
    from dspark_jax.bundle import save_bundle  # noqa: PLC0415
    from dspark_jax.checkpoint import deepspec  # noqa: PLC0415
    from dspark_jax.checkpoint.qwen3_hf import load_qwen3_hf  # noqa: PLC0415

    dt = args.dtype
    bcfg, bparams = load_qwen3_hf(args.backbone, param_dtype=dt, compute_dtype=dt)
    cfg, params, tied = deepspec.load_deepspec_draft(args.src, cfg.replace(compute_dtype=dt), dtype=dt,
                                                     with_tied=not args.no_tied)
    if (bcfg.vocab_size, bcfg.hidden_size) != (cfg.vocab_size, cfg.hidden_size):
        raise CheckpointError(f"draft vocab/width {cfg.vocab_size}/{cfg.hidden_size} do not match the target's "
                              f"{bcfg.vocab_size}/{bcfg.hidden_size} ({args.backbone})")
    if bcfg.num_hidden_layers != cfg.num_target_layers:
        raise CheckpointError(f"the draft was trained on a {cfg.num_target_layers}-layer target, {args.backbone} has "
                              f"{bcfg.num_hidden_layers} layers")
    backbone = Qwen3Backbone(bcfg)
    if tied is not None:  # the draft's frozen copies must be the target's own embedding and head
        for k, v in backbone.tied(bparams).items():
            if not np.array_equal(np.asarray(v, np.float32), np.asarray(tied[k], np.float32)):
                raise CheckpointError(f"the draft's {deepspec.TIED[k]} differs from the target's: {args.src} was not "
                                      f"trained against {args.backbone} (pass --no-tied to skip this check)")
    tok = args.backbone / "tokenizer.json"
    save_bundle(out, backbone_family="qwen3", backbone=backbone, backbone_params=bparams, draft_cfg=cfg,
                draft_params=params, tap_mode=cfg.tap_mode,
                tokenizer_json=tok.read_text() if tok.is_file() else None)
    folder = args.src if args.src.is_dir() else args.src.parent
    if (folder / "calibration.json").is_file():  # STS temperatures fitted for this draft, if the user has them
        shutil.copy(folder / "calibration.json", out / "calibration.json")
    return f"wrote the bundle {args.dst} (Qwen3 target + DeepSpec draft, {dt})"


def run(args: argparse.Namespace) -> int:
    """A bad checkpoint, config or path raises a UserError: `dspark` prints it as one line, exit 2."""
    t0 = time.perf_counter()
    msg = convert(args)
    print(f"{msg} in {time.perf_counter() - t0:.1f} s")
    return 0
