"""The `dspark` console script.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`;
this table is the only place that knows them, and modules are imported lazily so `dspark --help`
stays fast and one broken subcommand cannot take the others down.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from dspark_jax.errors import debug_requested, is_user_error, one_line

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("dspark_jax.serve.generate_cli", "speculative generation: prompts JSONL in, outputs JSONL out"),
    "serve": ("dspark_jax.serve.serve_cli", "OpenAI-compatible HTTP server (completions, chat, streaming, metrics)"),
    "train": ("dspark_jax.train.cli", "train a DSpark draft against a frozen backbone"),
    "regenerate": ("dspark_jax.train.regenerate_cli", "on-policy draft training data: the backbone continues "
                                                      "training prompts"),
    "calibrate": ("dspark_jax.calibration_cli", "fit STS confidence temperatures from round records"),
    "profile": ("dspark_jax.serve.profile_cli", "measure the verify cost table of the engine's jitted step"),
    "convert": ("dspark_jax.checkpoint.convert_cli", "convert checkpoints (safetensors <-> ours)"),
    "bench": ("dspark_jax.bench.cli", "benchmarks (schedule, verify, kernels, acceptance, ...)"),
    "demo": ("dspark_jax.demo", "run the demo on the embedded default model"),
}


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """--debug; also on parsers nested under a subcommand (`dspark bench NAME --debug`), which set
    the top-level args.debug that main() reads."""
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a user error too (also DSPARK_DEBUG=1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    add_debug_flag(common)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, parents=[common])
        p.set_defaults(_module=module_name)
        if name in _requested(sys.argv):
            _load(module_name).add_arguments(p)
    return parser


def _requested(argv: list[str]) -> set[str]:
    return {a for a in argv[1:] if a in SUBCOMMANDS}


def _load(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name == module_name:
            raise SystemExit(f"dspark: this subcommand is not available yet ({module_name} is missing)")
        raise


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = ["dspark", *argv]
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:])
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    try:
        return int(_load(args._module).run(args) or 0)
    except Exception as err:  # noqa: BLE001 (the one place a user error becomes one line and exit 2)
        if args.debug or debug_requested() or not is_user_error(err):
            raise
        print(f"dspark {args.command}: {one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
