"""`dspark bench serve`: a closed-loop concurrency sweep on the real engine.

For each concurrency c (default 1, 4, 16, 64), c clients keep one request each in flight: when a
request finishes its client submits the next, until `--requests-per-client` x c requests are served.
Prompts are the bundle's held-out prompts cut to mixed lengths, output lengths are mixed too (the
same workload, seeded, for every engine). The engine has c slots and runs, in turn:
  * plain        no draft (mode "plain");
  * static l     every round verifies l drafts (mode "fixed", l in --static, default 1..K);
  * sync, async  the DSpark schedulers on this machine's cost table for c slots (measured once and
                 cached beside the bundle, `serve.profile.cached_cost_table`).
Each engine serves the workload once to compile, then `--repeats` timed runs go round-robin over the
engines (so a slow spell of a shared machine hits them all alike) and each engine keeps its best run. Printed: tokens/s
and mean drafts verified per request-round per concurrency, async / best static, async / plain; a
plot with tokens/s against concurrency goes to --plot. `--http` runs the sweep through `dspark serve` on
loopback instead (plain vs async; throughput, time to first token, inter-token latency: bench/serve_http.py).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from dspark_jax import output_files
from dspark_jax.errors import UserError
from dspark_jax.serve.cli_common import add_model_arguments, load_model
from dspark_jax.validation import check_int_flags, check_number_flags, check_output_flags, int_list_flag

# The engine modules import jax: they are imported inside the functions that run the benchmark, so
# `dspark bench serve --help` and its argument errors answer without importing jax.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-tokens", type=int, default=16, help="shortest output (tokens)")
    parser.add_argument("--max-tokens", type=int, default=96, help="longest output (tokens)")
    parser.add_argument("--max-prompt", type=int, default=128, help="longest prompt (tokens)")
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--static", default=None, help="static verify lengths to run (default 1..K)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per engine (best kept)")
    parser.add_argument("--plot", default="bench_serve.png")
    parser.add_argument("--json", default=None)
    parser.add_argument("--http", action="store_true",
                        help="through `dspark serve` on loopback: plain vs async, throughput, TTFT and ITL p50/p99")
    parser.add_argument("--warmup", default="full", choices=("full", "quick", "none"),
                        help="with --http: the server's warm-up before it is ready (see dspark serve)")
    parser.add_argument("--http-timeout", type=float, default=600.0, help="per-request deadline with --http (s)")


def workload(bundle, n: int, args, seed: int = 0):
    """n requests with mixed prompt and output lengths (seeded: every engine gets the same ones)."""
    from dspark_jax.bench.decode import bench_prompts  # noqa: PLC0415  (jax)
    from dspark_jax.serve.engine import Request  # noqa: PLC0415  (jax)

    rng = np.random.default_rng(seed)
    prompts = bench_prompts(bundle, n, max_prompt_tokens=args.max_prompt)
    reqs = []
    for i, p in enumerate(prompts):
        keep = int(rng.integers(max(1, len(p) // 4), len(p) + 1))
        reqs.append(Request(p[-keep:], max_tokens=int(rng.integers(args.min_tokens, args.max_tokens + 1)),
                            temperature=args.temperature, seed=i, id=i))
    return reqs


def closed_loop(engine, requests, concurrency: int) -> float:
    """Serve `requests` keeping `concurrency` in flight (a finish submits the next); -> wall seconds."""
    from dspark_jax.serve.engine import Metrics  # noqa: PLC0415  (jax)

    engine.metrics = Metrics(engine.k)
    queue = list(requests)
    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(queue))):
        engine.submit(queue.pop(0))
    while not engine.idle:
        for ev in engine.step():
            if ev.finish_reason and queue:
                engine.submit(queue.pop(0))
    wall = time.perf_counter() - t0
    engine.metrics.wall_s = wall
    return wall


def check_args(args) -> tuple[list[int], list[int] | None]:
    """Every flag before the model loads -> (the concurrency levels, the --static counts or None)."""
    check_int_flags(args, "requests_per_client", "min_tokens", "max_tokens", "max_prompt", "max_len", "repeats")
    if args.min_tokens > args.max_tokens:
        raise UserError(f"--min-tokens: expected at most --max-tokens ({args.max_tokens}), got {args.min_tokens}")
    check_number_flags(args, "temperature")
    check_number_flags(args, "http_timeout", above=True)
    check_output_flags(args, "plot", "json")
    statics = int_list_flag(args, "static", minimum=0) if args.static else None
    return int_list_flag(args, "concurrency"), statics


def run(args: argparse.Namespace) -> int:
    levels, statics = check_args(args)  # before jax is imported: a bad flag answers at once
    from dspark_jax.serve.compiling import count_compiles  # noqa: PLC0415  (jax)
    from dspark_jax.serve.engine import Engine, EngineConfig  # noqa: PLC0415  (jax)
    from dspark_jax.serve.profile import cached_cost_table  # noqa: PLC0415  (jax)

    bundle = load_model(args)
    if args.http:
        from dspark_jax.bench.serve_http import run_http  # noqa: PLC0415  (jax, fastapi; only with --http)

        rows = run_http(args, bundle, levels, workload)
        if args.json:
            output_files.write_text(args.json, json.dumps(rows, indent=1))
        return 0
    model, weights = bundle.model, bundle.weights
    k = model.block_size
    statics = statics or list(range(1, k + 1))
    rows = []
    for c in levels:
        reqs = workload(bundle, c * args.requests_per_client, args)
        table, where = cached_cost_table(bundle, slots=c, max_len=args.max_len, progress=False)
        print(f"concurrency {c}: {len(reqs)} requests, cost table {where}", flush=True)
        # "lazy": ten engines live at once (timed round-robin); their whole program sets would not fit in
        # XLA:CPU's memory maps. The compile run covers what the timed runs use, and any compile inside a
        # timed run is counted and reported below.
        base = dict(max_slots=c, max_len=args.max_len, progress=False, compile="lazy")
        engines = {"plain": (EngineConfig(mode="plain", **base), None)}
        engines.update({f"static {n}": (EngineConfig(mode="fixed", num_verify=n, **base), None) for n in statics})
        engines["sync"] = (EngineConfig(mode="sync", **base), table)
        engines["async"] = (EngineConfig(mode="async", **base), table)
        row = {"concurrency": c, "tok_s": {}, "mean_verify": {}}
        built = {name: Engine(model, weights, cfg, cost_table=tab) for name, (cfg, tab) in engines.items()}
        for engine in built.values():
            closed_loop(engine, reqs, c)  # compiles
        best = {}
        with count_compiles() as compiled:
            for _ in range(args.repeats):
                for name, engine in built.items():
                    closed_loop(engine, reqs, c)
                    if engine.metrics.tokens_per_s > getattr(best.get(name), "tokens_per_s", 0.0):
                        best[name] = engine.metrics
        if compiled["n"]:
            print(f"  WARNING: {compiled['n']} programs compiled during the timed runs "
                  "(their compile time is in the figures)", flush=True)
        for name, m in best.items():
            row["tok_s"][name], row["mean_verify"][name] = m.tokens_per_s, m.mean_verify
            scale = f"  acceptance scale {built[name].acceptance_scale:.2f}" if name == "async" else ""
            print(f"  {name:9s} {m.tokens_per_s:8.1f} tok/s  verify/round {m.mean_verify:5.2f}  tau {m.tau:5.2f}"
                  + scale, flush=True)
        rows.append(row)
    print_table(rows, statics)
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        output_files.write_text(args.json, json.dumps(rows, indent=1))
    return 0


def print_table(rows, statics) -> None:
    names = ["plain"] + [f"static {n}" for n in statics] + ["sync", "async"]
    print("\ntokens/s (mean drafts verified per request-round)")
    print(f"{'conc':>4} " + " ".join(f"{n:>13}" for n in names) + f" {'async/best-static':>17} {'async/plain':>11}")
    for r in rows:
        best = max(r["tok_s"][f"static {n}"] for n in statics)
        cells = " ".join(f"{r['tok_s'][n]:>7.0f} ({r['mean_verify'][n]:>3.1f})" for n in names)
        print(f"{r['concurrency']:>4} {cells} {r['tok_s']['async'] / best:>17.2f} "
              f"{r['tok_s']['async'] / r['tok_s']['plain']:>11.2f}")
    import jax  # noqa: PLC0415

    print(f"({jax.devices()[0].platform.upper()} figures; closed loop; each engine's best of the timed runs after a compile run)")


def plot(rows, path) -> None:
    import matplotlib  # noqa: PLC0415  (heavy; only with --plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    conc = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in rows[0]["tok_s"]:
        style = dict(lw=2.5) if name in ("async", "plain", "sync") else dict(lw=1, alpha=0.6, ls="--")
        ax.plot(conc, [r["tok_s"][name] for r in rows], marker="o", label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(conc, [str(c) for c in conc])
    ax.set_xlabel("concurrent requests (closed loop)")
    ax.set_ylabel("tokens / s")
    ax.set_title("serving throughput by verify policy")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
