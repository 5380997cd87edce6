"""`dspark bench memory`: device memory of the serving programs on a TPU pod mesh, from lowered programs.

Builds the V4.1-Flash draft over an mhc backbone at dim 5120 (`dspark_jax.lowering.flash_pair`) from
shapes alone, places it on an abstract mesh exactly as the engine does, and prints per chip:
  * the draft's parameter bytes, bf16 (every fp8 / fp4 weight dequantised) and at checkpoint precision
    (fp8 dense and fp4 expert weights packed, `load_v41_draft(weights="packed")`), beside the bytes the
    official checkpoint stores for the same tensors (SPEC 3);
  * the backbone stand-in's and the tied embedding / head's bytes, and the decode state's;
  * with `--temporaries`, each program's temporaries from a compile of the same program for THIS host's
    CPU on a mesh of host devices (impl "xla"). That is an XLA:CPU figure: the CPU compiler widens every
    bf16 buffer to f32, so it over-states a TPU compile; the TPU figure needs a TPU compiler.
Every figure except the temporaries is read off the programs' argument shardings (jax.export lowers them
for `--platform`, default tpu, which also checks that they lower).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from dspark_jax import output_files
from dspark_jax.errors import UserError
from dspark_jax.validation import check_int_flags, check_output_flags

# checkpoint/, lowering, nn and parallel import jax: they are imported inside the functions that run the
# benchmark, so `dspark bench memory --help` and its argument errors answer without importing jax.

GiB = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mesh", default="data=2,expert=4",
                        help="mesh axes, e.g. data=2,expert=4 (axes: data, fsdp, expert, tensor)")
    parser.add_argument("--slots", type=int, default=8, help="decode slots (batch)")
    parser.add_argument("--max-len", type=int, default=4096, help="cache length per slot")
    parser.add_argument("--platform", default="tpu", help="platform the programs are lowered for")
    parser.add_argument("--impl", default="pallas", choices=("pallas", "xla", "auto"))
    parser.add_argument("--temporaries", action="store_true",
                        help="also compile each program for this host's CPU to read its temporaries (slow)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")


def checkpoint_bytes(cfg) -> int:
    """Bytes the official V4.1 checkpoint stores for the draft's `mtp.*` tensors (SPEC 3 formats)."""
    from dspark_jax.checkpoint import formats, v41  # noqa: PLC0415  (jax)

    total = 0
    for it in v41.expand_table(cfg):
        n = len(it.names)
        shape = it.ckpt_shape
        if it.storage == "fp8":
            total += n * (math.prod(shape) + math.prod(formats.fp8_scale_shape(shape)))
        elif it.storage == "fp4":
            total += n * (math.prod(shape) // 2 + math.prod(formats.fp4_scale_shape(shape)))
        else:
            total += n * math.prod(shape) * (4 if it.storage == "f32" else 2)
    return total


def tree_bytes_per_chip(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    return sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def measure(precision: str, axes: dict[str, int], args) -> dict:
    from dspark_jax import lowering  # noqa: PLC0415  (jax)
    from dspark_jax.checkpoint import v41  # noqa: PLC0415  (jax)
    from dspark_jax.nn import packed  # noqa: PLC0415  (jax)

    cfg = lowering.flash_config()
    draft = v41.abstract_packed_params(cfg) if precision == "checkpoint" else None
    pair = lowering.flash_pair(args.impl, draft_params=draft, slots=args.slots, max_len=args.max_len)
    mesh = lowering.pod_mesh(**axes)
    weights = lowering.sharded_weights(pair, mesh)
    state = lowering.sharded_state(pair, mesh)
    t0 = time.perf_counter()
    exported = lowering.lower_serving_programs(pair, mesh, platform=args.platform)
    row = {
        "precision": precision,
        "draft_bytes_per_chip": tree_bytes_per_chip(weights.draft),
        "draft_bytes": packed.nbytes(weights.draft),
        "checkpoint_draft_bytes": checkpoint_bytes(cfg),
        "backbone_bytes_per_chip": tree_bytes_per_chip(weights.backbone),
        "tied_bytes_per_chip": tree_bytes_per_chip(weights.tied),
        "state_bytes_per_chip": tree_bytes_per_chip(state),
        "programs": sorted(exported),
        "lower_s": time.perf_counter() - t0,
    }
    if args.temporaries:
        row["temporaries_cpu"] = cpu_temporaries(pair, axes)
    return row


def cpu_temporaries(pair, axes: dict[str, int]) -> dict[str, int]:
    """program -> temp bytes of an XLA:CPU compile of it (impl "xla") on a mesh of host CPU devices."""
    import dataclasses  # noqa: PLC0415

    import jax  # noqa: PLC0415

    from dspark_jax import lowering  # noqa: PLC0415  (jax)
    from dspark_jax.parallel import make_mesh  # noqa: PLC0415  (jax)

    mesh = make_mesh(**axes)
    pair = dataclasses.replace(pair, model=dataclasses.replace(pair.model, impl="xla"))
    out = {}
    with jax.set_mesh(mesh):
        for name, (fn, fargs, static) in lowering.serving_programs(pair, mesh).items():
            out[name] = int(fn.lower(*fargs, **static).compile().memory_analysis().temp_size_in_bytes)
    return out


def _ensure_host_devices(n: int) -> None:
    import jax  # noqa: PLC0415

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already up: whatever the host has
        pass
    if jax.device_count() < n:
        raise UserError(f"--temporaries needs {n} host devices, this process has {jax.device_count()}")


def print_table(rows: list[dict], axes: dict[str, int], args) -> None:
    mesh = " x ".join(f"{k}={v}" for k, v in axes.items()) or "1 chip"
    print(f"V4.1-Flash draft + mhc backbone stand-in (dim 5120, vocab 129280), mesh {mesh}, {args.slots} slots x "
          f"{args.max_len} positions, lowered for {args.platform} (impl {args.impl}); GiB per chip")
    head = f"{'weights':<12}{'draft':>9}{'draft/ckpt':>12}{'backbone':>10}{'tied':>8}{'state':>8}"
    print(head)
    for r in rows:
        print(f"{r['precision']:<12}{r['draft_bytes_per_chip'] / GiB:>9.2f}"
              f"{r['draft_bytes'] / r['checkpoint_draft_bytes']:>12.2f}{r['backbone_bytes_per_chip'] / GiB:>10.2f}"
              f"{r['tied_bytes_per_chip'] / GiB:>8.2f}{r['state_bytes_per_chip'] / GiB:>8.2f}")
    ck = rows[0]["checkpoint_draft_bytes"]
    print(f"checkpoint: the draft's mtp.* tensors store {ck / GiB:.2f} GiB ({ck / 1e9:.2f} GB); draft/ckpt compares "
          f"the whole draft tree with them. Programs lowered: {', '.join(rows[0]['programs'])}.")
    for r in rows:
        if "temporaries_cpu" in r:
            temps = ", ".join(f"{k} {v / GiB:.2f}" for k, v in r["temporaries_cpu"].items())
            print(f"temporaries ({r['precision']}, XLA:CPU compile, impl xla, GiB per device): {temps}")


def run(args: argparse.Namespace) -> int:
    check_int_flags(args, "slots", "max_len")
    check_output_flags(args, "json")
    from dspark_jax.parallel import parse_mesh_spec  # noqa: PLC0415  (jax)

    try:
        axes = parse_mesh_spec(args.mesh)
    except ValueError as e:
        raise UserError(f"--mesh: {e}") from None
    if args.temporaries:
        _ensure_host_devices(math.prod(axes.values()))
    rows = [measure(p, axes, args) for p in ("bf16", "checkpoint")]
    print_table(rows, axes, args)
    if args.json:
        output_files.write_text(args.json, json.dumps({"mesh": axes, "rows": rows}, indent=2))
    return 0
