#!/usr/bin/env python
"""Train the default model's three comparison drafts with `dspark train`, one after another, same budget.

    python scripts/train_drafts.py [--names dspark parallel onetoken] [--steps N]

1. converts the trained backbone (build/default_model/backbone/backbone.safetensors, written by
   scripts/train_backbone.py) into the Orbax params checkpoint the draft trainer reads;
2. (the data, build/default_model/regen.jsonl, is the backbone's own continuations of training-split
   prompts, written before this script by `dspark regenerate`: see scripts/build_default.sh);
3. runs `dspark train --config configs/default_train_draft_<name>.yaml` for each draft (block 7 with the
   Markov head, the same with markov_rank 0, and block 1); each run resumes from its own checkpoints;
4. exports each run's final draft parameters to <run_dir>/draft.safetensors + draft.json (DSparkConfig).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# The three comparison drafts of the default, then the Markov head variants of the DSpark draft (issue 19).
NAMES = ("dspark", "parallel", "onetoken", "gated", "rnn")


def convert_backbone(bdir: Path) -> Path:
    from dspark_jax.backbones.mhc import MhcBackbone, MhcConfig
    from dspark_jax.bundle import unflatten_strict
    from dspark_jax.checkpoint.orbax_io import save_params
    from dspark_jax.checkpoint.safetensors_io import open_checkpoint

    bb = MhcBackbone(MhcConfig.from_json(bdir / "backbone.json"))
    params = unflatten_strict(open_checkpoint(bdir / "backbone.safetensors"), bb.abstract_params(), "backbone")
    out = save_params(bdir / "orbax", params, overwrite=True)
    print(f"backbone -> Orbax params {out}", flush=True)
    return out


def export_draft(config_yaml: Path) -> Path:
    import yaml

    from dspark_jax.bundle import flatten
    from dspark_jax.checkpoint.orbax_io import restore_params
    from dspark_jax.checkpoint.safetensors_io import save_file
    from dspark_jax import drafts

    raw = yaml.safe_load(config_yaml.read_text())
    run_dir = ROOT / raw["run_dir"]
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    ckpt = run_dir / "checkpoints" / str(steps[-1])
    item = ckpt / "default" if (ckpt / "default").is_dir() else ckpt
    state = restore_params(item)
    params = state["params"]
    cfg = drafts.load_config(config_yaml.parent / raw["draft"]["config"])
    save_file(run_dir / "draft.safetensors", {k: np.asarray(v, np.float32) for k, v in flatten(params).items()})
    (run_dir / "draft.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    print(f"exported step {steps[-1]} -> {run_dir / 'draft.safetensors'}", flush=True)
    return run_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--names", nargs="+", default=list(NAMES[:3]), choices=NAMES)
    ap.add_argument("--steps", type=int, default=None, help="override the YAML's steps (same for every draft)")
    ap.add_argument("--backbone-dir", default="build/default_model/backbone")
    ap.add_argument("--prepare-only", action="store_true", help="only step 1 (backbone conversion)")
    ap.add_argument("--skip-prepare", action="store_true", help="skip step 1 (already done)")
    ap.add_argument("--export-only", action="store_true", help="only step 4 (export the latest checkpoints)")
    args = ap.parse_args(argv)

    if not (args.export_only or args.skip_prepare):
        convert_backbone(ROOT / args.backbone_dir)
        if args.prepare_only:
            return 0
    for name in args.names:
        cfg = ROOT / "configs" / f"default_train_draft_{name}.yaml"
        if not args.export_only:
            cmd = [sys.executable, "-m", "dspark_jax", "train", "--config", str(cfg)]
            if args.steps:
                cmd += ["--steps", str(args.steps)]
            print(f"== draft {name}: {' '.join(cmd)}", flush=True)
            t0 = time.time()
            rc = subprocess.call(cmd, cwd=ROOT)
            print(f"== draft {name}: exit {rc} after {(time.time() - t0) / 60:.1f} min", flush=True)
            if rc:
                return rc
        export_draft(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
