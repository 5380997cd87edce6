"""`dspark bench NAME`: each benchmark is a module in dspark_jax.bench with add_arguments/run."""

from __future__ import annotations

import argparse
import importlib

from dspark_jax.cli import add_debug_flag

BENCHMARKS: dict[str, tuple[str, str]] = {
    "verify": ("dspark_jax.bench.verify", "verify_and_accept time per call"),
    "schedule": ("dspark_jax.bench.schedule", "scheduler throughput simulation vs concurrency"),
    "kernels": ("dspark_jax.bench.kernels", "Pallas kernels vs their jnp references"),
    "convert": ("dspark_jax.bench.convert", "checkpoint conversion MB/s and peak RSS"),
    "decode": ("dspark_jax.bench.decode", "speculative vs plain decoding tokens/s, engine efficiency, peers"),
    "serve": ("dspark_jax.bench.serve", "closed-loop concurrency sweep: plain, static verify lengths, sync, async"),
    "acceptance": ("dspark_jax.bench.acceptance", "tau and per-position acceptance of the embedded drafts"),
    "roofline": ("dspark_jax.bench.roofline", "compiled flops and bytes of real-size programs against their "
                                              "analytic minimum"),
    "moe": ("dspark_jax.bench.moe", "wall clock of a many-expert draft's propose and training step, all-experts "
                                    "MoE against routed, side by side"),
    "memory": ("dspark_jax.bench.memory", "device memory per chip of the serving programs on a TPU pod mesh"),
    "coupling": ("dspark_jax.bench.coupling", "tau and tokens/s of the invariant coupling against the optimal one "
                                              "and plain decoding; invariant tokens checked equal to plain"),
    "compile": ("dspark_jax.bench.compile", "per-call wall time and compiles of successive generate calls; "
                                            "first token and ready per compile policy"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for that benchmark")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHMARKS[args.name][0])
    sub = argparse.ArgumentParser(prog=f"dspark bench {args.name}", description=BENCHMARKS[args.name][1])
    module.add_arguments(sub)
    add_debug_flag(sub)  # `dspark bench NAME --debug` as well as `dspark bench --debug NAME`
    bench_args = sub.parse_args(args.bench_args)
    # main() reads args.debug when an error comes up, and prefixes its one line with args.command: the
    # benchmark's own parse sets the first, and the line names the benchmark ("dspark bench acceptance: ...").
    args.debug = args.debug or bench_args.debug
    args.command = f"bench {args.name}"
    return int(module.run(bench_args) or 0)
