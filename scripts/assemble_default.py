#!/usr/bin/env python
"""Assemble the embedded default model from the trained parts (no calibration yet: fit_calibration.py).

    python scripts/assemble_default.py [--dest dspark_jax/assets/default] [--dtype bfloat16]

dest/ (via dspark_jax.bundle.save_bundle): bundle.json, backbone.safetensors, draft.safetensors (the
block-7 DSpark draft), tokenizer.json, prompts.jsonl (held-out evaluation prompts), training.json (the
training runs' final numbers, read from their logs); dest/variants/<name>/: draft.json (DSparkConfig)
and draft.safetensors for the comparison drafts ("parallel": markov_rank 0, "onetoken": block 1).
Weights are stored in --dtype (bf16 halves the files; loading casts back to the configs' f32), so every
later measurement (calibration, demo, benchmark) runs on exactly the committed weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def last_json_line(path: Path, key: str | None = None) -> dict | None:
    if not path.is_file():
        return None
    rec = None
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            if key is None or key in r:
                rec = r
    return rec


def cast(tree, dtype):
    return {k: cast(v, dtype) if isinstance(v, dict) else np.asarray(v, np.float32).astype(dtype)
            for k, v in tree.items()}


def main(argv=None) -> int:
    from dspark_jax import draft as draft_lib
    from dspark_jax.backbones.mhc import MhcBackbone, MhcConfig
    from dspark_jax.bundle import flatten, save_bundle, unflatten_strict
    from dspark_jax.checkpoint.safetensors_io import open_checkpoint, save_file
    from dspark_jax.config import DSparkConfig

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build/default_model")
    ap.add_argument("--dest", default="dspark_jax/assets/default")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args(argv)
    build, dest = ROOT / args.build, ROOT / args.dest
    dtype = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(np.float32)

    bb = MhcBackbone(MhcConfig.from_json(build / "backbone" / "backbone.json"))
    bparams = unflatten_strict(open_checkpoint(build / "backbone" / "backbone.safetensors"), bb.abstract_params(),
                               "backbone")
    drafts = {}
    for name in ("dspark", "parallel", "onetoken"):
        run = build / "drafts" / name
        cfg = DSparkConfig.from_json(run / "draft.json")
        drafts[name] = (cfg, unflatten_strict(open_checkpoint(run / "draft.safetensors"),
                                              draft_lib.abstract_params(cfg), f"draft {name}"))

    if dest.exists():
        shutil.rmtree(dest)
    cfg, dparams = drafts["dspark"]
    save_bundle(dest, backbone_family="mhc", backbone=bb, backbone_params=cast(bparams, dtype), draft_cfg=cfg,
                draft_params=cast(dparams, dtype), tap_mode="entry",
                tokenizer_json=(build / "tokenizer.json").read_text())
    for name in ("parallel", "onetoken"):
        cfg, dparams = drafts[name]
        vdir = dest / "variants" / name
        vdir.mkdir(parents=True)
        (vdir / "draft.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        save_file(vdir / "draft.safetensors", {k: np.asarray(v) for k, v in flatten(cast(dparams, dtype)).items()})
    shutil.copy(build / "prompts.jsonl", dest / "prompts.jsonl")

    bstate = json.loads((build / "backbone" / "train_state.json").read_text())
    held = last_json_line(build / "backbone" / "log.jsonl", "heldout_loss")
    info = {"weights_dtype": args.dtype,
            "corpus": json.loads((build / "corpus" / "manifest.json").read_text()),
            "backbone": {"params": bstate.get("params"), "steps": bstate["step"], "tokens": bstate["tokens"],
                         "train_loss_ema": bstate["loss_ema"], "heldout_loss": held and held["heldout_loss"],
                         "minutes": round(bstate["elapsed_s"] / 60, 1), "seq_len": bstate.get("seq_len"),
                         "batch": bstate.get("batch")},
            "drafts": {}}
    for name in drafts:
        last = last_json_line(build / "drafts" / name / "metrics.jsonl") or {}
        info["drafts"][name] = {k: v for k, v in last.items() if k in ("step", "loss", "ce", "l1", "conf", "tau_estimate")
                                or k.startswith("accept_rate@")}
        info["drafts"][name]["params"] = int(sum(np.prod(np.shape(x)) for x in flatten(drafts[name][1]).values()))
    (dest / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    total = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"default model -> {dest} ({total / 2 ** 20:.1f} MiB)")
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
