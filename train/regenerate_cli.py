"""`dspark regenerate`: on-policy draft training data from a bundle's backbone (see train/regenerate.py).

    dspark regenerate --bundle DIR --data corpus/train.jsonl --out regen.jsonl \
        --num-prompts 4096 --prompt-len 64 --max-tokens 192 --temperatures 0,1

    dspark regenerate --train-config configs/<run>.yaml --data ... --out ...   # the run's frozen backbone

The backbone comes from a bundle (--bundle, default the embedded model) or from a `dspark train` run
config (--train-config: its backbone family, config and parameters, so data can be made before any draft
exists; the draft is never used in mode plain). Interrupt it at any time: the same command resumes where
it stopped.
"""

from __future__ import annotations

import argparse
import json
import sys

from dspark_jax.serve.cli_common import add_model_arguments, load_model
from dspark_jax.output_files import check_not_an_input
from dspark_jax.train.data import expand_paths
from dspark_jax.validation import check_output_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--train-config", default=None,
                        help="take the backbone from this `dspark train` run config instead of a bundle")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer JSON for 'text' records (default: the bundle's, or the run config's)")
    parser.add_argument("--data", nargs="+", required=True,
                        help="training-split JSONL files or globs ('text' records need the bundle's tokenizer)")
    parser.add_argument("--out", required=True, help="output training JSONL (appended to, resumable)")
    parser.add_argument("--num-prompts", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens cut from a training record")
    parser.add_argument("--max-tokens", type=int, default=192, help="continuation tokens per prompt")
    parser.add_argument("--temperatures", default="0,1",
                        help="comma-separated; prompt i uses the (i mod n)-th (default 0,1)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slots", type=int, default=32, help="engine batch slots")
    parser.add_argument("--mode", default="plain", choices=("plain", "off", "fixed", "async"),
                        help="engine mode (all lossless; async needs the bundle's cost table)")
    parser.add_argument("--no-progress", action="store_true")


def _temperatures(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--temperatures: expected comma-separated numbers, got {text!r}") from None


def _backbone(args):
    """-> (tokenizer, vocab size, build) from --train-config or the bundle arguments; build() -> (SpecModel,
    Weights, cost table). Split so the data are checked against the vocabulary before build() (for
    --train-config, a training step's compile)."""
    if args.train_config is None:
        bundle = load_model(args)
        return (bundle.tokenizer, bundle.model.backbone.vocab_size,
                lambda: (bundle.model, bundle.weights, bundle.cost_table))
    import dataclasses

    from dspark_jax.train.config import RunConfig
    from dspark_jax.train.data import load_tokenizer
    from dspark_jax.train.trainer import Trainer, build_backbone

    cfg = RunConfig.from_yaml(args.train_config)
    # The run's data.train is usually the file this command is about to write (the build script's order:
    # regenerate, then train), so the trainer that builds the backbone reads the prompts' data instead.
    cfg = cfg.replace(data=dataclasses.replace(cfg.data, train=tuple(args.data)))
    vocab_size = build_backbone(cfg.backbone).vocab_size  # the config alone: no parameters, no compile
    return load_tokenizer(cfg.data.tokenizer), vocab_size, lambda: (*Trainer(cfg).spec_pair(impl=args.impl), None)


def run(args: argparse.Namespace) -> int:
    from dspark_jax.train.data import load_tokenizer
    from dspark_jax.train.regenerate import RegenConfig, load_documents, prompt_windows, regenerate

    # Bad arguments and files raise UserError (DataError, RunConfigError, ...) naming them; the CLI
    # boundary prints one line and exits 2.
    check_output_flags(args, "out")  # before the model is built: a typo in the folder would lose the work
    check_not_an_input(args.out, [("--data", p) for p in expand_paths(tuple(args.data))])
    cfg = RegenConfig(num_prompts=args.num_prompts, prompt_len=args.prompt_len, max_new_tokens=args.max_tokens,
                      temperatures=_temperatures(args.temperatures), top_k=args.top_k, top_p=args.top_p,
                      seed=args.seed, slots=args.slots, mode=args.mode)
    tokenizer, vocab_size, build = _backbone(args)
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    prompts = prompt_windows(load_documents(args.data, tokenizer, vocab_size), cfg)
    model, weights, table = build()
    stats = regenerate(model, weights, prompts, args.out, cfg, cost_table=table, progress=not args.no_progress)
    print(json.dumps(stats), file=sys.stderr)
    return 0
