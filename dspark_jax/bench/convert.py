"""`dspark bench convert`: checkpoint conversion throughput and peak memory.

Builds a synthetic checkpoint in the exact V4.1-Flash layout (full per-tensor shapes of SPEC section 3:
fp8 dense linears `<linear>.weight` with 32x32 E8M0 scales `<linear>.scale`, packed fp4 experts with 1x32
scales, bf16 / f32 rest, `ffn.gate.bias_vl` as in a model with a vision tower) for
`--stages` draft stages but only `--experts` routed experts, then times, each phase in a fresh process
so its peak RSS is its own:
  * fp8 -> bf16 safetensors (streaming dequantisation),
  * bf16 -> fp8 safetensors (streaming re-quantisation),
  * fp8 -> Orbax (load into our tree, then save).
Reports MB/s (read and written) and peak RSS, and checks the streaming phases stay under
3 x the largest dequantised tensor + the process's own baseline (imports) + a 64 MiB allowance.
The Orbax phase is not streaming: it holds our whole tree, and Orbax 0.12 stages a host copy of
every leaf while it writes (measured; `save_concurrent_gb` does not bound that for CPU arrays), so its
bound is that plus 2 x the tree.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dspark_jax import output_files
from dspark_jax.errors import UserError
from dspark_jax.validation import check_int_flags, check_number_flags, check_output_flags

# checkpoint/ and drafts/ import jax: they are imported inside functions, so `dspark bench convert --help` and
# its argument errors answer without importing jax; each phase process imports what it needs before it
# reads its baseline RSS (the orbax phase alone imports jax, orbax and convert_cli).

ALLOWANCE = 64 << 20
MiB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stages", type=int, default=2, help="draft stages (V4.1 has 3; default 2)")
    parser.add_argument("--experts", type=int, default=8, help="routed experts per stage (V4.1 has 128; default 8)")
    parser.add_argument("--with-tied", action="store_true",
                        help="also write the backbone's embed.weight/head.weight [129280, 5120] bf16 (+2.6 GB)")
    parser.add_argument("--shard-gb", type=float, default=1.0, help="shard size of written checkpoints")
    parser.add_argument("--phases", default="bf16,fp8,orbax", help="comma list of bf16, fp8, orbax")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--progress", action="store_true", help="progress bars in the phases")


def bench_config(stages: int, experts: int):
    from dspark_jax.drafts.v41.config import DSparkConfig  # noqa: PLC0415  (jax)

    # V4.1-Flash has a vision tower, so its routers carry `ffn.gate.bias_vl` (3 of its 2,401 draft tensors).
    return DSparkConfig().replace(n_layers=stages, n_routed_experts=experts,
                                  n_activated_experts=min(3, experts), vision=True)


# ---------------------------------------------------------------------------------------------
# Synthetic checkpoint
# ---------------------------------------------------------------------------------------------
def _random_tensor(rng: np.random.Generator, dtype: str, shape: tuple[int, ...], scale_for: str | None = None):
    import ml_dtypes  # noqa: PLC0415

    from dspark_jax.checkpoint.safetensors_io import DTYPES, stored_shape  # noqa: PLC0415  (jax)

    shp = stored_shape(dtype, shape)
    n = int(np.prod(shp))
    if dtype == "F8_E4M3":
        b = np.frombuffer(rng.bytes(n), dtype=np.uint8).copy()
        b[(b & 0x7F) == 0x7F] ^= 1  # no NaN codes
        return b.reshape(shp).view(ml_dtypes.float8_e4m3fn)
    if dtype == "F8_E8M0":  # weights of magnitude ~1e-2 .. 1
        lo, hi = (118, 123) if scale_for == "fp8" else (120, 126)
        return rng.integers(lo, hi, size=shp, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
    if dtype in ("I8", "F4"):
        return np.frombuffer(rng.bytes(n), dtype=np.uint8).reshape(shp).view(DTYPES[dtype])
    x = rng.standard_normal(shp, dtype=np.float32) * 0.02
    return x.astype(DTYPES[dtype])


def write_synthetic_v41(out_dir: Path, cfg, *, with_tied: bool, max_shard_bytes: int, seed: int = 0,
                        progress: bool = False) -> dict:
    """A V4.1-layout checkpoint (official storage formats) with random contents; returns its stats."""
    from dspark_jax.checkpoint import v41  # noqa: PLC0415  (jax)
    from dspark_jax.checkpoint.safetensors_io import SafetensorsWriter, TensorSpec, write_index  # noqa: PLC0415  (jax)

    rng = np.random.default_rng(seed)
    groups = []
    for it in v41.expand_table(cfg):
        for n in it.names:
            groups.append(v41._target_specs(v41._Out(n, it.storage, it.ckpt_shape, None), "fp8", "I8"))
    if with_tied:
        groups += [[TensorSpec(n, "BF16", (cfg.vocab_size, cfg.dim))] for n in v41.TIED.values()]
    groups.append([TensorSpec("layers.0.ffn_norm.weight", "BF16", (cfg.dim,))])  # a backbone tensor, ignored
    shards, size = [[]], 0
    for g in groups:
        n = sum(s.nbytes for s in g)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(g)
        size += n
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total, largest = {}, 0, 0
    for fname, specs in zip(names, shards):
        with SafetensorsWriter(out_dir / fname, specs, {"format": "pt"}) as w:
            for s in specs:
                kind = "fp4" if ".experts." in s.name else "fp8"
                w.write(s.name, _random_tensor(rng, s.dtype, s.shape, kind))
                weight_map[s.name] = fname
                total += s.nbytes
                if not s.name.endswith(".scale"):
                    largest = max(largest, int(np.prod(s.shape)) * (4 if s.dtype == "F32" else 2))
                if progress:
                    print(f"\r  wrote {total / MiB:8.0f} MiB", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    write_index(out_dir, weight_map, total)
    cfg.to_json(out_dir / "dspark_config.json")
    return {"bytes": total, "tensors": len(weight_map), "files": len(names), "largest_dequantized_bytes": largest}


# ---------------------------------------------------------------------------------------------
# Phases (each runs in a fresh process)
# ---------------------------------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    import resource  # noqa: PLC0415

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _phase_main(phase: str, kw: dict, q) -> None:
    try:
        from dspark_jax.checkpoint import v41  # noqa: PLC0415  (jax; before the baseline RSS)
        from dspark_jax.drafts.v41.config import DSparkConfig  # noqa: PLC0415  (jax)

        cfg = DSparkConfig.from_dict(kw["cfg"])
        if phase == "orbax":
            import jax  # noqa: PLC0415, F401
            import orbax.checkpoint  # noqa: PLC0415, F401

            from dspark_jax.checkpoint.convert_cli import safetensors_to_orbax  # noqa: PLC0415  (orbax phase only)
        base = max(_rss(), _peak_rss())
        t0 = time.perf_counter()
        extra = {}
        if phase == "build":
            extra = write_synthetic_v41(Path(kw["dst"]), cfg, with_tied=kw["with_tied"],
                                        max_shard_bytes=kw["shard"], progress=kw["progress"])
        elif phase in ("bf16", "fp8"):
            v41.convert_v41_safetensors(kw["src"], cfg, kw["dst"], fmt=phase, with_tied=kw["with_tied"],
                                        max_shard_bytes=kw["shard"], progress=kw["progress"])
        elif phase == "orbax":
            extra["tree_bytes"] = safetensors_to_orbax(kw["src"], cfg, kw["dst"], with_tied=kw["with_tied"],
                                                       progress=kw["progress"], concurrent_gb=1)
        else:
            raise ValueError(phase)
        secs = time.perf_counter() - t0
        q.put({"ok": True, "seconds": secs, "base_rss": base, "peak_rss": _peak_rss(), **extra})
    except BaseException as err:  # noqa: BLE001  (report it to the parent instead of hanging it)
        import traceback  # noqa: PLC0415

        q.put({"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})


def _run_phase(phase: str, **kw) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_phase_main, args=(phase, kw, q))
    p.start()
    res = q.get()
    p.join()
    if not res["ok"]:
        raise RuntimeError(f"phase {phase} failed: {res['error']}\n{res['traceback']}")
    return res


def run(args: argparse.Namespace) -> int:
    check_int_flags(args, "stages", "experts")
    check_number_flags(args, "shard_gb", above=True)  # <= 0 would write one shard per tensor
    check_output_flags(args, "json")
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    bad = [p for p in phases if p not in ("bf16", "fp8", "orbax")]
    if bad or not phases:
        raise UserError(f"--phases: expected a comma list of bf16, fp8, orbax, got {args.phases!r}")
    cfg = bench_config(args.stages, args.experts)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dspark_bench_convert_"))
    work.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(work).free
    est = _estimate_bytes(cfg, args.with_tied)
    # source + (bf16 copy + its fp8 re-quantisation) or the orbax tree, whichever is larger
    need = est["fp8"] + max(est["bf16"] + est["fp8"] if "fp8" in phases else est["bf16"], est["bf16"])
    print(f"dspark bench convert: {args.stages} stage(s), {args.experts} experts, tied={args.with_tied}; "
          f"scratch {work} ({free / 2**30:.1f} GiB free, needs ~{need / 2**30:.1f} GiB)")
    if need > free * 0.8:
        print("dspark bench convert: not enough free disk; use fewer --stages/--experts or another --workdir",
              file=sys.stderr)
        return 2
    common = {"cfg": cfg.to_dict(), "with_tied": args.with_tied, "shard": int(args.shard_gb * 2**30),
              "progress": args.progress}
    results, ok = {}, True
    try:
        src = work / "v41_fp8"
        r = _run_phase("build", dst=str(src), **common)
        largest = r["largest_dequantized_bytes"]
        results["build"] = _row("build synthetic fp8", 0, r["bytes"], r)
        print(f"  synthetic: {r['tensors']} tensors in {r['files']} files, {r['bytes'] / MiB:.0f} MiB; largest "
              f"dequantised tensor {largest / MiB:.0f} MiB")
        bf16_dir = None  # the bf16 output is kept as the source of the fp8 phase
        for phase in sorted(phases, key=("bf16", "fp8", "orbax").index):
            dst = work / f"out_{phase}"
            src_dir = src
            if phase == "fp8":  # re-quantise a bf16 checkpoint (made here if the bf16 phase did not run)
                if bf16_dir is None:
                    bf16_dir = work / "out_bf16"
                    _run_phase("bf16", src=str(src), dst=str(bf16_dir), **common)
                src_dir = bf16_dir
            r = _run_phase(phase, src=str(src_dir), dst=str(dst), **common)
            read, wrote = _dir_bytes(src_dir), _dir_bytes(dst)
            bound = r["base_rss"] + 3 * largest + ALLOWANCE
            if phase == "orbax":  # the whole tree, plus Orbax's staged copy of it
                bound += 2 * r["tree_bytes"]
            row = _row(f"{'bf16' if phase == 'fp8' else 'fp8'} -> {phase}", read, wrote, r, bound=bound)
            results[phase] = row
            ok &= row["within_bound"]
            if phase == "bf16" and "fp8" in phases:
                bf16_dir = dst
            else:
                shutil.rmtree(dst, ignore_errors=True)
            if phase == "fp8":
                shutil.rmtree(bf16_dir, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    _print_table(results)
    if args.json:
        output_files.write_text(args.json, json.dumps({"config": {"stages": args.stages, "experts": args.experts,
                                                    "with_tied": args.with_tied}, "results": results}, indent=2))
    print("memory bound: " + ("OK" if ok else "EXCEEDED"))
    return 0 if ok else 1


def _row(name: str, read: int, wrote: int, r: dict, bound: int | None = None) -> dict:
    s = max(r["seconds"], 1e-9)
    row = {"phase": name, "seconds": round(s, 2), "read_MiB": round(read / MiB, 1),
           "written_MiB": round(wrote / MiB, 1),
           "read_MiB_s": round(read / MiB / s, 1), "write_MiB_s": round(wrote / MiB / s, 1),
           "base_rss_MiB": round(r["base_rss"] / MiB), "peak_rss_MiB": round(r["peak_rss"] / MiB)}
    if "tree_bytes" in r:
        row["tree_MiB"] = round(r["tree_bytes"] / MiB)
    if bound is not None:
        row["bound_MiB"] = round(bound / MiB)
        row["within_bound"] = bool(r["peak_rss"] <= bound)
    return row


def _print_table(results: dict) -> None:
    print(f"{'phase':<22}{'s':>8}{'read MiB/s':>12}{'write MiB/s':>13}{'base RSS':>10}{'peak RSS':>10}{'bound':>8}")
    for row in results.values():
        print(f"{row['phase']:<22}{row['seconds']:>8.1f}{row['read_MiB_s']:>12.1f}{row['write_MiB_s']:>13.1f}"
              f"{row['base_rss_MiB']:>10}{row['peak_rss_MiB']:>10}{row.get('bound_MiB', '-'):>8}")


def _estimate_bytes(cfg, with_tied: bool) -> dict:
    from dspark_jax.checkpoint import v41  # noqa: PLC0415  (jax)

    fp8 = bf16 = 0
    for it in v41.expand_table(cfg):
        for _ in it.names:
            specs = v41._target_specs(v41._Out("x", it.storage, it.ckpt_shape, None), "fp8", "I8")
            fp8 += sum(s.nbytes for s in specs)
            bf16 += int(np.prod(it.ckpt_shape)) * (4 if it.storage == "f32" else 2)
    if with_tied:
        fp8 += 2 * cfg.vocab_size * cfg.dim * 2
        bf16 += 2 * cfg.vocab_size * cfg.dim * 2
    return {"fp8": fp8, "bf16": bf16}
