"""`dspark profile`: measure the engine's cost table and save it as JSON (SGLang keys)."""

from __future__ import annotations

import argparse

from dspark_jax.serve.cli_common import add_model_arguments, load_model
from dspark_jax.validation import check_int_flags, check_output_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--slots", type=int, default=8, help="request slots (batch) to profile")
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True, help="cost table JSON to write")


def run(args: argparse.Namespace) -> int:
    # Before the model loads: `--repeats 0` profiled for a minute, then failed on the empty measurement.
    check_int_flags(args, "slots", "max_len", "repeats")
    check_output_flags(args, "out")
    from dspark_jax.serve.profile import profile_cost_table

    bundle = load_model(args)
    table = profile_cost_table(bundle.model, bundle.weights, slots=args.slots, max_len=args.max_len,
                               repeats=args.repeats)
    table.to_json(args.out)
    print(f"{'batch tokens':>13} {'steps/s':>10}")
    for b, s in zip(table.batch_tokens.tolist(), table.steps_per_sec.tolist()):
        print(f"{b:>13} {s:>10.2f}")
    print(f"wrote {args.out}")
    return 0
