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

    python scripts/train_drafts.py --skip-prepare --continue-steps 1200 [--stage1-from-bundle DIR]

continues each trained draft for N more steps, a warm restart: the YAML's schedule again (warm-up to the
same peak, cosine to zero) from the exported weights, the optimizer state fresh. The first time, stage 1's
export and metrics move to <run_dir>/stage1/ and stage 2 trains in <run_dir>/stage2/; each later call adds
a stage (stage3/, ...) starting from <run_dir>'s current export (copied to <stage>/start/), or resumes the
last stage if it was not exported yet. --stage K trains stage K only if it is not done yet (so a rerun of
the build is a no-op) and refuses it while stage K - 1 is not. <run_dir> gets the newest stage's export
and every stage's metrics in one metrics.jsonl (steps counted on, rows of stage k > 1 marked "stage": k).
--stage1-from-bundle makes stage 1 an assembled bundle's drafts (the shipped bf16 weights, widened to f32)
instead of a build's stage-1 export; it matters only when no stage was set aside yet.
"""

from __future__ import annotations

import argparse
import json
import shutil
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


def export_draft(config_yaml: Path, run_dir: Path | None = None, out_dir: Path | None = None) -> Path:
    import yaml

    from dspark_jax.bundle import flatten
    from dspark_jax.checkpoint.orbax_io import restore_params
    from dspark_jax.checkpoint.safetensors_io import save_file
    from dspark_jax import drafts

    raw = yaml.safe_load(config_yaml.read_text())
    run_dir = run_dir or ROOT / raw["run_dir"]
    out_dir = out_dir or run_dir
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    ckpt = run_dir / "checkpoints" / str(steps[-1])
    item = ckpt / "default" if (ckpt / "default").is_dir() else ckpt
    state = restore_params(item)
    params = state["params"]
    cfg = drafts.load_config(config_yaml.parent / raw["draft"]["config"])
    save_file(out_dir / "draft.safetensors", {k: np.asarray(v, np.float32) for k, v in flatten(params).items()})
    (out_dir / "draft.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    print(f"exported step {steps[-1]} of {run_dir} -> {out_dir / 'draft.safetensors'}", flush=True)
    return out_dir


def bundle_draft_files(bundle: Path, name: str) -> tuple[Path, Path]:
    """The assembled bundle's (weights, training log) of one comparison draft (scripts/assemble_default.py)."""
    weights = bundle / "draft.safetensors" if name == "dspark" else bundle / "variants" / name / "draft.safetensors"
    return weights, bundle / "logs" / f"draft_{name}_metrics.jsonl"


def stage_one(run_dir: Path, name: str, bundle: Path | None) -> Path:
    """Move (or, from a bundle, copy) stage 1's weights and metrics into <run_dir>/stage1; returns that dir."""
    stage1 = run_dir / "stage1"
    if (stage1 / "draft.safetensors").exists():  # a rerun: stage 1 is already set aside
        return stage1
    stage1.mkdir(parents=True, exist_ok=True)
    if bundle is not None:
        weights, metrics = bundle_draft_files(bundle, name)
        shutil.copy(weights, stage1 / "draft.safetensors")
        shutil.copy(metrics, stage1 / "metrics.jsonl")
    else:
        for f in ("draft.safetensors", "draft.json", "metrics.jsonl"):
            shutil.move(run_dir / f, stage1 / f)
    return stage1


def start_orbax(start: Path, config_yaml: Path) -> Path:
    """A stage's starting weights (<dir>/draft.safetensors) as the f32 Orbax params checkpoint `--init` reads."""
    import yaml

    from dspark_jax import drafts
    from dspark_jax.bundle import unflatten_strict
    from dspark_jax.checkpoint.orbax_io import save_params
    from dspark_jax.checkpoint.safetensors_io import open_checkpoint

    raw = yaml.safe_load(config_yaml.read_text())
    cfg = drafts.load_config(config_yaml.parent / raw["draft"]["config"])
    # The abstract tree is f32, so a bundle's bf16 weights are widened as they are read.
    params = unflatten_strict(open_checkpoint(start / "draft.safetensors"), drafts.abstract_params(cfg), "draft")
    return save_params(start / "orbax", params, overwrite=True)


def stage_numbers(run_dir: Path) -> list[int]:
    """The stages set aside or trained in <run_dir> (stage1, stage2, ...), in order."""
    return sorted(int(p.name[5:]) for p in run_dir.glob("stage*") if p.is_dir() and p.name[5:].isdigit())


def joined_stages(run_dir: Path) -> int:
    """The last stage whose rows <run_dir>/metrics.jsonl holds, i.e. the last stage exported to <run_dir>."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return max((r.get("stage", 1) for r in rows), default=1)


def join_metrics(run_dir: Path) -> None:
    """<run_dir>/metrics.jsonl = stage 1's rows, then each later stage's, steps counted on, rows marked "stage"."""
    joined, offset = [], 0
    for k in stage_numbers(run_dir):
        rows = [json.loads(x) for x in (run_dir / f"stage{k}" / "metrics.jsonl").read_text().splitlines() if x.strip()]
        rows = [{**r, "step": r["step"] + offset, **({"stage": k} if k > 1 else {})} for r in rows]
        offset = max((r["step"] for r in rows), default=offset)
        joined += rows
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in joined))


def run_train(label: str, cmd: list[str]) -> int:
    """Run one `dspark train` command from the repository root, logging it and its wall time -> exit code."""
    print(f"== {label}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    rc = subprocess.call(cmd, cwd=ROOT)
    print(f"== {label}: exit {rc} after {(time.time() - t0) / 60:.1f} min", flush=True)
    return rc


def continue_draft(name: str, steps: int, bundle: Path | None, stage: int | None = None) -> int:
    """Train stage `stage` of one draft (default: the one after the last exported), resuming it if begun."""
    cfg = ROOT / "configs" / f"default_train_draft_{name}.yaml"
    import yaml

    run_dir = ROOT / yaml.safe_load(cfg.read_text())["run_dir"]
    done = joined_stages(run_dir)
    stage = stage or done + 1
    if stage <= done:
        print(f"draft {name}: stage {stage} is already trained and exported", flush=True)
        return 0
    if stage > done + 1:
        print(f"draft {name}: stage {stage} starts from stage {stage - 1}, which is not trained yet", file=sys.stderr)
        return 2
    if stage == 2:  # stage 1 is set aside, stage 2 starts from it
        start = stage_one(run_dir, name, bundle)
    else:  # a later stage starts from <run_dir>'s export, the previous stage's
        start = run_dir / f"stage{stage}" / "start"
        if not (start / "draft.safetensors").exists():
            start.mkdir(parents=True, exist_ok=True)
            shutil.copy(run_dir / "draft.safetensors", start / "draft.safetensors")
    cmd = [sys.executable, "-m", "dspark_jax", "train", "--config", str(cfg), "--run-dir", str(run_dir / f"stage{stage}"),
           "--init", str(start_orbax(start, cfg)), "--steps", str(steps)]
    rc = run_train(f"draft {name}, stage {stage}", cmd)
    if rc:
        return rc
    export_draft(cfg, run_dir / f"stage{stage}", out_dir=run_dir)
    join_metrics(run_dir)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--names", nargs="+", default=list(NAMES[:3]), choices=NAMES)
    ap.add_argument("--steps", type=int, default=None, help="override the YAML's steps (same for every draft)")
    ap.add_argument("--backbone-dir", default="build/default_model/backbone")
    ap.add_argument("--prepare-only", action="store_true", help="only step 1 (backbone conversion)")
    ap.add_argument("--skip-prepare", action="store_true", help="skip step 1 (already done)")
    ap.add_argument("--export-only", action="store_true", help="only step 4 (export the latest checkpoints)")
    ap.add_argument("--continue-steps", type=int, default=None,
                    help="add a stage: continue each exported draft for this many steps (a warm restart, see above)")
    ap.add_argument("--stage", type=int, default=None,
                    help="with --continue-steps: the stage to train (default: the next); done already = nothing to do")
    ap.add_argument("--stage1-from-bundle", type=Path, default=None,
                    help="with --continue-steps: stage 1 is this assembled bundle's drafts, not the build's")
    args = ap.parse_args(argv)

    if args.continue_steps:
        for name in args.names:
            rc = continue_draft(name, args.continue_steps, args.stage1_from_bundle, args.stage)
            if rc:
                return rc
        return 0

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
            rc = run_train(f"draft {name}", cmd)
            if rc:
                return rc
        export_draft(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
