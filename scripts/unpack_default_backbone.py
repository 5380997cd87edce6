#!/usr/bin/env python
"""Put a shipped default's backbone back into its build folder, so the draft steps can be rerun alone.

    python scripts/unpack_default_backbone.py --family mhc     # dspark_jax/assets/default -> build/default_model
    python scripts/unpack_default_backbone.py --family qwen3   # dspark_jax/assets/default_qwen3 -> build/default_qwen3

The backbone takes an hour of the 2-core build; the drafts are what data regeneration changes. This writes
exactly what the backbone trainer would have left behind, from the committed bundle: for mhc
backbone/{backbone.json, backbone.safetensors (f32 of the stored bf16), train_state.json, log.jsonl} plus
tokenizer.json and prompts.jsonl; for qwen3 the Hugging Face folder backbone/ (config.json,
model.safetensors, train_state.json, log.jsonl). The drafts then train against the committed weights
themselves (bf16 values), the ones every benchmark serves.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def train_state(training_json: Path) -> dict:
    """The backbone trainer's train_state.json fields, from the bundle's training.json."""
    b = json.loads(training_json.read_text())["backbone"]
    return {"step": b["steps"], "tokens": b["tokens"], "loss_ema": b["train_loss_ema"],
            "elapsed_s": b["minutes"] * 60, "params": b["params"], "seq_len": b["seq_len"], "batch": b["batch"]}


def unpack_mhc(bundle: Path, build: Path) -> None:
    from dspark_jax.bundle import load_bundle
    from train_backbone import save_checkpoint

    b = load_bundle(bundle)
    out = build / "backbone"
    save_checkpoint(out, b.model.backbone.cfg, b.weights.backbone, train_state(bundle / "training.json"))
    shutil.copy(bundle / "logs" / "backbone_log.jsonl", out / "log.jsonl")
    shutil.copy(bundle / "tokenizer.json", build / "tokenizer.json")
    shutil.copy(bundle / "prompts.jsonl", build / "prompts.jsonl")


def unpack_qwen3(bundle: Path, build: Path) -> None:
    from dspark_jax.bundle import load_bundle
    from train_backbone_qwen3 import save_qwen3_hf

    b = load_bundle(bundle)
    raw = json.loads((bundle / "bundle.json").read_text())["backbone"]["config"]
    out = build / "backbone"
    params = {k: np.asarray(v) if not isinstance(v, dict) else v for k, v in b.weights.backbone.items()}
    save_qwen3_hf(out, raw, b.model.backbone.cfg, params, train_state(bundle / "training.json"))
    shutil.copy(bundle / "logs" / "backbone_log.jsonl", out / "log.jsonl")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", required=True, choices=("mhc", "qwen3"))
    ap.add_argument("--bundle", default=None, help="default: the family's embedded default")
    ap.add_argument("--build", default=None, help="default: build/default_model or build/default_qwen3")
    args = ap.parse_args(argv)
    name = {"mhc": "default", "qwen3": "default_qwen3"}[args.family]
    bundle = Path(args.bundle or ROOT / "dspark_jax" / "assets" / name)
    build = Path(args.build or ROOT / "build" / {"mhc": "default_model", "qwen3": "default_qwen3"}[args.family])
    build.mkdir(parents=True, exist_ok=True)
    (unpack_mhc if args.family == "mhc" else unpack_qwen3)(bundle, build)
    print(f"{bundle} backbone -> {build / 'backbone'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
