"""`dspark bench compile`: does the engine ever wait on XLA once it is serving? (issue 42)

Part 1, steady state (one process, the policy of `--policy`, default the engine's default "eager"): for
each batch (slots) and mode (plain, async), ONE engine serves the same `--requests` requests with
`engine.generate` `--calls` times in a row, greedy and then at T = 1. Per call: wall seconds, XLA
compiles inside it, tokens/s. The table gives call 1 (it compiles, unless an earlier engine of the
same shape already did), the median of the later calls, their worst / median (target <= 1.3) and the
compiles after call 1 (target 0), and async vs plain on the later calls' median tokens/s.

Part 1b, side by side: the same ratio with a plain and an async engine alive at once and their calls
alternated (lazy policy, after a warm-up call each), so that a slow spell of the machine hits both alike.

Part 2, first run per policy (`--policies`; each in a fresh process, so nothing is compiled yet): one
engine (async, `--first-run-slots` slots, T = 1) serves the same requests `--calls` times: time to the first
token, time until every program is compiled ("ready": eager before its first token, background when
its thread is done, lazy never), and the calls' wall times and compiles. "eager+cache" runs eager twice
in two processes sharing a fresh persistent compilation cache folder and reports the second: what a
restart costs with `dspark serve --compile-cache`.

Compiles are counted with `dspark_jax.serve.compiling.count_compiles` (XLA backend compiles; loads from
the persistent cache are not compiles). CPU figures on this machine are what BENCHMARKS.md records.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from dspark_jax import output_files
from dspark_jax.errors import UserError
from dspark_jax.serve.cli_common import add_model_arguments
from dspark_jax.validation import check_int_flags, check_output_flags, int_list_flag

POLICIES = ("eager", "background", "lazy", "eager+cache")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--batches", default="1,8", help="comma-separated slot counts")
    parser.add_argument("--requests", type=int, default=8, help="requests per call (the same ones every call)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--calls", type=int, default=6, help="successive generate calls per engine")
    parser.add_argument("--policy", default=None, choices=("eager", "background", "lazy"),
                        help="part 1's compile policy (default: the engine's default)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"part 2: comma-separated, from {POLICIES}; 'none' skips part 2")
    parser.add_argument("--first-run-slots", type=int, default=1, help="part 2's slots (= requests)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="comma-separated parts to run: steady (part 1), side (part 1b), first (part 2)")
    parser.add_argument("--json", default=None, help="write every row as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # part 2's per-process run
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)


def _requests(bundle, n: int, max_tokens: int, temperature: float):
    from dspark_jax import assets  # noqa: PLC0415
    from dspark_jax.evaluation import make_requests, read_prompts  # noqa: PLC0415

    path = bundle.path or assets.default_bundle_path()
    records = read_prompts(os.path.join(path, "prompts.jsonl"), n)
    return make_requests(records, bundle.tokenizer, max_tokens=max_tokens, temperature=temperature)[:n]


def _engine(bundle, slots: int, mode: str, max_len: int, policy: str | None):
    from dspark_jax.serve.engine import Engine, EngineConfig  # noqa: PLC0415
    from dspark_jax.serve.profile import cached_cost_table  # noqa: PLC0415

    table = cached_cost_table(bundle, slots=slots, max_len=max_len, progress=False)[0] if mode == "async" else None
    extra = {} if policy is None else {"compile": policy}
    cfg = EngineConfig(max_slots=slots, max_len=max_len, mode=mode, progress=False, **extra)
    return Engine(bundle.model, bundle.weights, cfg, cost_table=table)


def timed_call(engine, requests) -> dict:
    """One generate-like call through submit/step: wall s, first-token s, tokens, compiles inside."""
    from dspark_jax.serve.compiling import count_compiles  # noqa: PLC0415

    t0 = time.perf_counter()
    first, tokens = None, 0
    with count_compiles() as c:
        for r in requests:
            engine.submit(r)
        while not engine.idle:
            for ev in engine.step():
                tokens += len(ev.tokens)
                if first is None and ev.tokens:
                    first = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "first_token_s": first, "tokens": tokens, "compiles": c["n"],
            "tok_per_s": tokens / wall if wall else 0.0}


def steady_rows(bundle, args) -> list[dict]:
    from dspark_jax.serve.compiling import release_programs  # noqa: PLC0415  (jax)

    rows = []
    for slots in int_list_flag(args, "batches"):
        for mode in ("plain", "async"):
            engine = _engine(bundle, slots, mode, args.max_len, args.policy)
            for temp in (0.0, 1.0):
                reqs = _requests(bundle, args.requests, args.max_tokens, temp)
                calls = [timed_call(engine, reqs) for _ in range(args.calls)]
                later = [c["wall_s"] for c in calls[1:]]
                med = statistics.median(later)
                row = {"batch": slots, "mode": mode, "temperature": temp, "policy": engine.config.compile,
                       "first_call_s": calls[0]["wall_s"], "first_call_compiles": calls[0]["compiles"],
                       "median_s": med, "worst_over_median": max(later) / med,
                       "compiles_after_first": sum(c["compiles"] for c in calls[1:]),
                       "tok_per_s": statistics.median(c["tok_per_s"] for c in calls[1:]),
                       "calls_s": [round(c["wall_s"], 3) for c in calls]}
                rows.append(row)
                print(_steady_line(row), flush=True)
            del engine  # four engines' whole program sets would not fit in XLA:CPU's memory maps
            release_programs()
    for r in rows:
        if r["mode"] == "async":
            plain = next(p for p in rows if p["mode"] == "plain" and p["batch"] == r["batch"]
                         and p["temperature"] == r["temperature"])
            r["async_over_plain"] = r["tok_per_s"] / plain["tok_per_s"]
    return rows


def side_by_side_rows(bundle, args) -> list[dict]:
    """Async / plain tokens/s with the two engines' calls alternated, so that a slow spell of this shared
    machine hits both alike (part 1 times one engine after the other, minutes apart). Both engines live at
    once, so they compile lazily: their whole eager program sets would not fit in XLA:CPU's memory maps
    together. A warm-up call per engine and temperature compiles what these requests use (the same
    executables the eager policy compiles: a program is its key); the timed calls then compile nothing."""
    from dspark_jax.serve.compiling import release_programs  # noqa: PLC0415  (jax)

    rows = []
    for slots in int_list_flag(args, "batches"):
        engines = {mode: _engine(bundle, slots, mode, args.max_len, "lazy") for mode in ("plain", "async")}
        for temp in (0.0, 1.0):
            reqs = _requests(bundle, args.requests, args.max_tokens, temp)
            for engine in engines.values():
                timed_call(engine, reqs)
            calls = {mode: [] for mode in engines}
            for _ in range(args.calls):
                for mode, engine in engines.items():
                    calls[mode].append(timed_call(engine, reqs))
            speed = {mode: statistics.median(c["tok_per_s"] for c in cs) for mode, cs in calls.items()}
            row = {"batch": slots, "temperature": temp, "plain_tok_per_s": speed["plain"],
                   "async_tok_per_s": speed["async"], "async_over_plain": speed["async"] / speed["plain"],
                   "compiles": sum(c["compiles"] for cs in calls.values() for c in cs)}
            rows.append(row)
            print(f"batch {slots:>2} T={temp:.0f}: async / plain tokens/s, {args.calls} calls each alternated: "
                  f"{row['async_over_plain']:.2f}x ({speed['async']:.0f} / {speed['plain']:.0f} tok/s, "
                  f"{row['compiles']} compiles)", flush=True)
        del engines
        release_programs()
    return rows


def _steady_line(r: dict) -> str:
    return (f"batch {r['batch']:>2} {r['mode']:<5} T={r['temperature']:.0f}  call 1 {r['first_call_s']:7.2f} s "
            f"({r['first_call_compiles']:>2} compiles)  later median {r['median_s']:.3f} s, worst/median "
            f"{r['worst_over_median']:.2f}, compiles after call 1: {r['compiles_after_first']}  "
            f"{r['tok_per_s']:.0f} tok/s")


def child(bundle, args) -> dict:
    """Part 2 in this (fresh) process: async, --first-run-slots requests at T = 1."""
    from dspark_jax.serve.compiling import compiles_so_far  # noqa: PLC0415

    from dspark_jax import user_cache  # noqa: PLC0415

    user_cache.enable_compile_cache(args.cache_dir)  # None: off (a first run compiles everything)
    compiles_so_far()  # start counting
    slots = args.first_run_slots
    engine = _engine(bundle, slots, "async", args.max_len, args.child)
    reqs = _requests(bundle, args.requests, args.max_tokens, 1.0)
    t0 = time.perf_counter()
    calls = [timed_call(engine, reqs) for _ in range(args.calls)]
    if args.child == "background" and engine._background is not None:
        engine._background.finished.wait()
        ready = time.perf_counter() - t0
    elif args.child == "eager":
        ready = calls[0]["first_token_s"]
    else:
        ready = None
    engine.close()
    return {"policy": args.child, "slots": slots, "first_token_s": calls[0]["first_token_s"], "ready_s": ready,
            "calls_s": [round(c["wall_s"], 3) for c in calls], "compiles": [c["compiles"] for c in calls],
            "programs": len(engine.programs())}


def policies_flag(args) -> list[str]:
    policies = [] if args.policies == "none" else [p.strip() for p in args.policies.split(",")]
    for p in policies:
        if p not in POLICIES:
            raise UserError(f"--policies: unknown policy {p!r}; expected a comma-separated list from {POLICIES}")
    return policies


def first_run_rows(args) -> list[dict]:
    policies = policies_flag(args)
    rows = []
    base = [sys.executable, "-m", "dspark_jax.cli", "bench", "compile", "--batches", args.batches, "--requests", str(args.requests), "--max-tokens",
            str(args.max_tokens), "--max-len", str(args.max_len), "--calls", str(args.calls),
            "--first-run-slots", str(args.first_run_slots)]
    if args.bundle:
        base += ["--bundle", args.bundle]
    env = {**os.environ}
    env.pop("DSPARK_COMPILE", None)
    env["DSPARK_COMPILE_CACHE"] = "off"  # a first run compiles: the user's cache would load programs
    for policy in policies:
        with tempfile.TemporaryDirectory() as cache:
            runs = 2 if policy == "eager+cache" else 1
            for i in range(runs):
                cmd = base + ["--child", policy.split("+")[0]] + (["--cache-dir", cache] if runs == 2 else [])
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if out.returncode:
                    raise RuntimeError(f"dspark bench compile: the {policy} run failed:\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["policy"] = policy
            rows.append(row)
            print(_first_run_line(row), flush=True)
    return rows


def _first_run_line(r: dict) -> str:
    ready = "never (compiles on use)" if r["ready_s"] is None else f"{r['ready_s']:.1f} s"
    return (f"{r['policy']:<12} first token {r['first_token_s']:7.2f} s  ready {ready}  calls "
            f"{r['calls_s']} s, compiles {r['compiles']} ({r['programs']} programs)")


PARTS = ("steady", "side", "first")


def parts_flag(args) -> list[str]:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    for p in parts:
        if p not in PARTS:
            raise UserError(f"--parts: unknown part {p!r}; expected a comma-separated list from {PARTS}")
    return parts


def run(args: argparse.Namespace) -> int:
    # Every flag before the model loads: a typo answers at once, not after half an hour of compiles.
    check_int_flags(args, "requests", "max_tokens", "max_len", "calls", "first_run_slots")
    check_output_flags(args, "json")
    int_list_flag(args, "batches")
    policies_flag(args)
    parts = parts_flag(args)
    if args.calls < 2:
        raise UserError(f"--calls: expected >= 2 (call 1 compiles; the later ones are timed), got {args.calls}")
    from dspark_jax.serve.cli_common import load_model  # noqa: PLC0415  (jax)

    bundle = load_model(args)
    if args.child:
        print(json.dumps(child(bundle, args)), flush=True)
        return 0
    rows = {}
    if "steady" in parts:
        print(f"part 1: steady state, {args.calls} generate calls per engine, each {args.requests} requests x "
              f"{args.max_tokens} tokens")
        rows["steady"] = steady_rows(bundle, args)
        for r in rows["steady"]:
            if "async_over_plain" in r:
                print(f"batch {r['batch']:>2} T={r['temperature']:.0f}: async / plain tokens/s on the later calls "
                      f"{r['async_over_plain']:.2f}x")
    if "side" in parts:
        print(f"part 1b: async / plain side by side (both engines live, compile policy lazy, a warm-up call each, "
              f"then {args.calls} calls each, alternated)")
        rows["side_by_side"] = side_by_side_rows(bundle, args)
    if "first" in parts:
        print(f"part 2: the first run of each policy (fresh process; async, {args.first_run_slots} slots, T = 1)")
        rows["first_run"] = first_run_rows(args)
    if args.json:
        output_files.write_text(args.json, json.dumps(rows, indent=1))
    return 0
