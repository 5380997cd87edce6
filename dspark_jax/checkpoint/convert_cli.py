"""`dspark convert SRC DST --to {orbax,bf16,fp8}`: V4.1 draft checkpoints between formats.

SRC is a V4.1 safetensors checkpoint (a `.safetensors` file, a folder of shards, or a folder / file
`model.safetensors.index.json`) or an Orbax checkpoint written by this command.
  * safetensors -> orbax: load `mtp.{s}.*` (+ `embed.weight`, `head.weight`) into our tree
    (fp8 / fp4 dequantised) and save `{"params": ..., "tied": {...}}` with the config in the metadata.
  * safetensors -> bf16 | fp8 safetensors: streamed one tensor at a time (memory ~ one tensor).
  * orbax -> bf16 | fp8 safetensors: restore on the host and export the V4.1 layout.
The config comes from --config, else the Orbax metadata, else `config.json` / `dspark_config.json`
beside SRC (HF, inference and our own spellings all load).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dspark_jax.checkpoint.safetensors_io import CheckpointError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", type=Path, help="V4.1 safetensors file/folder/index, or an Orbax checkpoint folder")
    parser.add_argument("dst", type=Path, help="output folder")
    parser.add_argument("--to", required=True, choices=("orbax", "bf16", "fp8"),
                        help="orbax: our tree; bf16: V4.1 layout dequantised; fp8: V4.1 layout as the official "
                             "checkpoint stores it (fp8 dense, fp4 experts)")
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


def _config_for(args, src_is_orbax: bool):
    from dspark_jax.config import DSparkConfig  # noqa: PLC0415

    if args.config is not None:
        return DSparkConfig.from_json(args.config)
    if src_is_orbax:
        from dspark_jax.checkpoint.orbax_io import saved_config  # noqa: PLC0415

        cfg = saved_config(args.src)
        if cfg is not None:
            return cfg
    folder = args.src if args.src.is_dir() else args.src.parent
    for name in ("config.json", "dspark_config.json"):
        if (folder / name).is_file():
            return DSparkConfig.from_json(folder / name)
    raise CheckpointError(f"no config: pass --config (none stored with {args.src}, no config.json beside it)")


def _check_dst(dst: Path, overwrite: bool, safetensors_out: bool) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())) and not overwrite:
        raise CheckpointError(f"{dst} exists and is not empty (pass --overwrite to replace)")
    if overwrite and safetensors_out and dst.is_dir():
        # Old shards beside new ones would be read as one checkpoint with duplicate tensors.
        for old in [*dst.glob("*.safetensors"), dst / "model.safetensors.index.json"]:
            old.unlink(missing_ok=True)


def safetensors_to_orbax(src, cfg, dst, *, dtype="bfloat16", with_tied=True, tied_path=None, overwrite=False,
                         progress=False, concurrent_gb: int = 1) -> int:
    """V4.1 safetensors -> Orbax `{"params": ..., "tied": ...}` (config in the metadata); returns the
    tree's bytes. Memory: the tree once, plus at most `concurrent_gb` staged by Orbax."""
    from dspark_jax.checkpoint import orbax_io, v41  # noqa: PLC0415

    params, tied = v41.load_v41_draft(src, cfg, dtype=dtype, with_tied=with_tied, tied_path=tied_path,
                                      progress=progress)
    tree = {"params": params} if tied is None else {"params": params, "tied": tied}
    del params, tied
    nbytes = sum(a.nbytes for a in _leaves(tree))
    orbax_io.to_device_leafwise(tree)
    orbax_io.save_params(dst, tree, config=cfg, overwrite=overwrite, concurrent_gb=concurrent_gb)
    return nbytes


def _leaves(tree):
    for v in tree.values():
        if isinstance(v, dict):
            yield from _leaves(v)
        else:
            yield v


def convert(args) -> str:
    from dspark_jax.checkpoint import orbax_io, v41  # noqa: PLC0415

    src_is_orbax = orbax_io.is_orbax_checkpoint(args.src)
    if not src_is_orbax and not args.src.exists():
        raise CheckpointError(f"{args.src}: no such file or directory")
    src_dir = (args.src if args.src.is_dir() else args.src.parent).resolve()
    if args.dst.resolve() == src_dir or src_dir.is_relative_to(args.dst.resolve()):
        raise CheckpointError(f"{args.dst}: the output folder must not contain the input {args.src}")
    cfg = _config_for(args, src_is_orbax)
    _check_dst(args.dst, args.overwrite, safetensors_out=args.to != "orbax")
    shard = int(args.max_shard_gb * (1 << 30))
    progress = not args.quiet
    with_tied = not args.no_tied

    if src_is_orbax:
        if args.to == "orbax":
            raise CheckpointError(f"{args.src} is already an Orbax checkpoint; choose --to bf16 or --to fp8")
        tree = orbax_io.restore_params(args.src)
        if not isinstance(tree, dict) or "params" not in tree:
            raise CheckpointError(f"{args.src}: expected a tree {{'params': ..., 'tied': ...}} "
                                  "written by dspark convert")
        tied = tree.get("tied") if with_tied else None
        if with_tied and tied is None:
            raise CheckpointError(f"{args.src} holds no tied embed/head; pass --no-tied to export the draft only")
        files = v41.export_v41_draft(tree["params"], tied, cfg, args.dst, fmt=args.to, max_shard_bytes=shard,
                                     fp4_dtype=args.fp4_dtype, progress=progress)
        cfg.to_json(args.dst / "dspark_config.json")
        return f"wrote {len(files)} safetensors file(s) to {args.dst}"

    if args.to == "orbax":
        safetensors_to_orbax(args.src, cfg, args.dst, dtype=args.dtype, with_tied=with_tied, tied_path=args.tied,
                             overwrite=args.overwrite, progress=progress)
        return f"wrote Orbax checkpoint {args.dst}"

    if args.tied is not None:
        raise CheckpointError("--tied is only used with --to orbax; safetensors output copies the tied tensors "
                              "from SRC (or pass --no-tied)")
    files = v41.convert_v41_safetensors(args.src, cfg, args.dst, fmt=args.to, with_tied=with_tied,
                                        max_shard_bytes=shard, fp4_dtype=args.fp4_dtype, progress=progress)
    cfg.to_json(args.dst / "dspark_config.json")
    return f"wrote {len(files)} safetensors file(s) to {args.dst}"


def run(args: argparse.Namespace) -> int:
    from dspark_jax.config import ConfigError  # noqa: PLC0415

    t0 = time.perf_counter()
    try:
        msg = convert(args)
    except (CheckpointError, ConfigError) as err:
        print(f"dspark convert: error: {err}", file=sys.stderr)
        return 1
    print(f"{msg} in {time.perf_counter() - t0:.1f} s")
    return 0
