"""Model selection shared by the serving subcommands."""

from __future__ import annotations

import argparse
from pathlib import Path

from dspark_jax import assets
from dspark_jax import configs
from dspark_jax import user_cache
from dspark_jax.errors import UserError


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", help="model bundle folder (bundle.json + safetensors); default: the "
                                         "embedded default model if present")
    parser.add_argument("--random-tiny", action="store_true",
                        help="use the tiny configs with RANDOM weights (plumbing checks only; no real acceptance)")
    parser.add_argument("--impl", default="auto", choices=("auto", "pallas", "xla"), help="kernel dispatch")


def add_compile_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile", default=None, choices=("eager", "background", "lazy"),
                        help="when the engine's programs compile: all before the first request (eager, the "
                             "default: no later request waits for a compile), in the background while serving "
                             "with what is compiled (background), each on first use (lazy)")


def add_compile_cache_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile-cache", default=None, metavar="DIR|off",
                        help="JAX's persistent compilation cache: a second run loads the programs instead of "
                             "compiling them (default: $XDG_CACHE_HOME/dspark/xla, else ~/.cache/dspark/xla; "
                             "$DSPARK_COMPILE_CACHE overrides; 'off' disables)")


def enable_compile_cache(args) -> None:
    """The cache --compile-cache names (dspark_jax/user_cache.py); refused now when unusable. The engine's
    own program store (serve/program_store.py) lives in its subfolder `dspark-programs`."""
    directory = user_cache.compile_cache_dir(args.compile_cache)
    user_cache.enable_compile_cache(directory)
    from dspark_jax.serve import program_store  # noqa: PLC0415  (jax: the flags parse without it)

    program_store.enable(None if directory is None else directory / program_store.FOLDER)


def compile_option(args) -> dict:
    """EngineConfig keyword for --compile (none given: the engine's default policy)."""
    return {} if args.compile is None else {"compile": args.compile}


def default_bundle_path() -> Path | None:
    return assets.default_bundle_path()


def load_model(args):
    # bundle imports jax; the serving subcommands import this module to parse their arguments
    from dspark_jax.bundle import load_bundle, random_bundle  # noqa: PLC0415  (jax)

    if args.random_tiny:
        print("NOTE: random weights on the tiny configs: acceptance and text are meaningless.")
        return random_bundle(configs.path("tiny_mhc_backbone.json"), configs.path("tiny_v41.json"))
    path = args.bundle or default_bundle_path()
    if path is None:
        raise UserError("no model: pass --bundle DIR (or --random-tiny for a plumbing check)")
    return load_bundle(path, impl=args.impl)
