"""`dspark bench coupling` (issue 44): what the drafter-invariant coupling costs against the optimal one.

    dspark bench coupling [--bundle DIR] [--prompts 16] [--max-tokens 64] [--batches 1,8] [--temperatures 1,0.7]

On the bundle's held-out prompts (the same requests, seeds 0..n-1, for every engine): the engine verifying
every draft (mode "off") with every request under the optimal coupling, the same engine with every request
under the invariant coupling, and the plain engine (mode "plain"). Per temperature and batch (slots): tau
(tokens per request-round), tokens/s (best of `--repeats` timed runs after a warm-up that compiles every
program), the compiles during the timed runs (0 expected), and whether each invariant request's tokens equal
plain decoding's (the coupling's promise: "same" must read yes). Targets: invariant tau >= 0.90 x optimal tau at
T = 1; the invariant path at least as fast as plain wherever the optimal one is. CPU figures on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from dspark_jax import output_files
from dspark_jax.serve.cli_common import add_model_arguments, load_model
from dspark_jax.validation import check_int_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts (the bundle's prompts.jsonl)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--batches", default="1,8", help="comma-separated slot counts")
    parser.add_argument("--temperatures", default="1,0.7", help="comma-separated sampling temperatures")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per cell; the best is reported")
    parser.add_argument("--json", default=None, help="write the rows as JSON here")


def _floats(text: str, flag: str) -> list[float]:
    from dspark_jax.errors import UserError  # noqa: PLC0415

    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not out:
        raise UserError(f"{flag}: expected at least one value, got {text!r}")
    return out


def timed(engine, reqs, repeats: int):
    """-> (results of the last run, best wall seconds, tau of the last run, compiles during the timed runs)."""
    from dspark_jax.serve.compiling import count_compiles  # noqa: PLC0415
    from dspark_jax.serve.engine import Metrics  # noqa: PLC0415

    best, results = float("inf"), None
    with count_compiles() as c:
        for _ in range(repeats):
            engine.metrics = Metrics(engine.k)
            t0 = time.perf_counter()
            results = engine.generate(reqs)
            best = min(best, time.perf_counter() - t0)
    return results, best, engine.metrics.tau, c["n"]


def measure(bundle, prompts, args, slots: int, temps: list[float]) -> list[dict]:
    from dspark_jax.evaluation import make_requests  # noqa: PLC0415
    from dspark_jax.serve.compiling import release_programs  # noqa: PLC0415
    from dspark_jax.serve.engine import Engine, EngineConfig  # noqa: PLC0415

    engines = {mode: Engine(bundle.model, bundle.weights, EngineConfig(max_slots=slots, max_len=args.max_len,
                                                                       mode=mode, progress=False))
               for mode in ("plain", "off")}
    rows = []
    for temp in temps:
        base = make_requests(prompts, bundle.tokenizer, max_tokens=args.max_tokens, temperature=temp)
        runs = {"plain": (engines["plain"], base)}
        for coupling in ("optimal", "invariant"):
            runs[coupling] = (engines["off"], [dataclasses.replace(r, coupling=coupling) for r in base])
        for engine, reqs in runs.values():  # warm-up: every width bucket and prompt bucket compiles here
            for b in sorted({2, 3, 5, 9, args.max_tokens}):
                engine.generate([dataclasses.replace(r, max_tokens=min(b, r.max_tokens)) for r in reqs])
        out = {name: timed(engine, reqs, args.repeats) for name, (engine, reqs) in runs.items()}
        tokens = sum(len(r.tokens) for r in out["plain"][0])
        same = all(a.tokens == b.tokens for a, b in zip(out["invariant"][0], out["plain"][0]))
        row = {"batch": slots, "temperature": temp, "tokens": tokens, "invariant_equals_plain": same}
        for name, (results, wall, tau, compiles) in out.items():
            row[name] = {"tau": tau, "tokens_per_s": sum(len(r.tokens) for r in results) / wall,
                         "compiles": compiles}
        rows.append(row)
    del engines
    release_programs()  # each engine's program set holds XLA:CPU memory maps
    return rows


def print_table(rows: list[dict], title: str) -> None:
    print(title)
    print(f"{'batch':>5} {'T':>4} | {'tau opt':>7} {'tau inv':>7} {'inv/opt':>7} | {'tok/s plain':>11} {'opt':>7} "
          f"{'inv':>7} {'inv/plain':>9} | {'same as plain':>13} {'compiles':>8}")
    for r in rows:
        o, i, p = r["optimal"], r["invariant"], r["plain"]
        compiles = o["compiles"] + i["compiles"] + p["compiles"]
        print(f"{r['batch']:>5} {r['temperature']:>4g} | {o['tau']:>7.3f} {i['tau']:>7.3f} "
              f"{i['tau'] / o['tau']:>7.3f} | {p['tokens_per_s']:>11.1f} {o['tokens_per_s']:>7.1f} "
              f"{i['tokens_per_s']:>7.1f} {i['tokens_per_s'] / p['tokens_per_s']:>8.2f}x | "
              f"{'yes' if r['invariant_equals_plain'] else 'NO':>13} {compiles:>8}")
    print("tau = tokens per request-round (mode off: every draft verified); tok/s: best of the timed runs; "
          "same as plain: every invariant request's tokens equal the plain engine's")


def run(args: argparse.Namespace) -> int:
    check_int_flags(args, "prompts", "max_tokens", "max_len", "repeats")
    from dspark_jax.errors import UserError  # noqa: PLC0415

    temps = _floats(args.temperatures, "--temperatures")
    batches = [int(b) for b in _floats(args.batches, "--batches")]
    if min(batches) < 1 or min(temps) < 0:
        raise UserError("--batches must be >= 1 and --temperatures >= 0")
    from pathlib import Path  # noqa: PLC0415

    from tqdm.auto import tqdm  # noqa: PLC0415

    from dspark_jax.assets import default_bundle_path  # noqa: PLC0415
    from dspark_jax.evaluation import read_prompts  # noqa: PLC0415

    if args.random_tiny:
        raise UserError("dspark bench coupling measures a trained draft on held-out prompts: give --bundle DIR "
                        "or use the embedded default (--random-tiny accepts nothing)")
    bundle = load_model(args)
    path = Path(args.bundle or default_bundle_path())
    prompts = read_prompts(path / "prompts.jsonl", args.prompts)
    rows = [row for slots in tqdm(batches, desc="dspark bench coupling", unit="batch")
            for row in measure(bundle, prompts, args, slots, temps)]
    print_table(rows, f"bundle {path.name}: {len(prompts)} held-out prompts x {args.max_tokens} tokens, "
                      f"max_len {args.max_len}")
    if args.json:
        output_files.write_text(args.json, json.dumps({"bundle": str(path), "rows": rows}, indent=1))
    return 0
