"""`dspark train --config configs/<run>.yaml`: train a DSpark draft against a frozen backbone.

Resumes from the run folder's latest checkpoint unless --no-resume. Multi-host: start one process per
host with --coordinator host:port --num-processes N --process-id i (or the DSPARK_* environment
variables, or distributed.auto on TPU pods / SLURM). The run-config format is documented in
`dspark_jax.train.config`.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="run config YAML (see dspark_jax.train.config)")
    parser.add_argument("--run-dir", default=None, help="override run_dir (checkpoints, metrics.jsonl)")
    parser.add_argument("--steps", type=int, default=None, help="override the total number of steps")
    parser.add_argument("--init", default=None,
                        help="override draft.init: an Orbax params checkpoint to start from (continued training)")
    parser.add_argument("--no-resume", action="store_true", help="start fresh even if run_dir has checkpoints")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    parser.add_argument("--coordinator", default=None, help="multi-host: host:port of process 0")
    parser.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    parser.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")


def run(args: argparse.Namespace) -> int:
    import dataclasses  # noqa: PLC0415

    from dspark_jax.train.config import RunConfig  # noqa: PLC0415

    # A bad config or override raises RunConfigError naming the key; the CLI boundary prints one line.
    cfg = RunConfig.from_yaml(args.config)
    changes = {}
    if args.run_dir is not None:
        changes["run_dir"] = args.run_dir
    if args.steps is not None:
        changes["steps"] = args.steps
    if args.init is not None:
        changes["draft"] = dataclasses.replace(cfg.draft, init=args.init)
    dist = {k: v for k, v in (("coordinator", args.coordinator), ("num_processes", args.num_processes),
                              ("process_id", args.process_id)) if v is not None}
    if dist:
        changes["distributed"] = dataclasses.replace(cfg.distributed, **dist)
    cfg = cfg.replace(**changes)

    from dspark_jax.train.trainer import Trainer, init_distributed  # noqa: PLC0415

    init_distributed(cfg.distributed)
    trainer = Trainer(cfg)
    if not args.no_resume:
        step = trainer.restore()
        if step is not None:
            print(f"dspark train: resumed from step {step} in {cfg.run_dir}", file=sys.stderr)
    last = trainer.fit(progress=not args.no_progress)
    if last:
        print(f"dspark train: step {last['step']} loss {last['loss']:.4f} tau_estimate {last['tau_estimate']:.3f}",
              file=sys.stderr)
    return 0
