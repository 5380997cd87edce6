#!/usr/bin/env python
"""Assemble the embedded default model from the trained parts (no calibration yet: fit_calibration.py).

    python scripts/assemble_default.py [--dest dspark_jax/assets/default] [--dtype bfloat16]

dest/ (via dspark_jax.bundle.save_bundle): bundle.json, backbone.safetensors, draft.safetensors (the
block-7 DSpark draft), tokenizer.json, prompts.jsonl (held-out evaluation prompts), training.json (the
training runs' final numbers, read from their logs), README.md and logs/; dest/variants/<name>/: draft.json (DSparkConfig)
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


README = """# The embedded default model

Built by `bash scripts/build_default.sh` (see the scripts for every step); nothing here is hand-edited
(this file is written by scripts/assemble_default.py from the configs and the training logs).

- `bundle.json`, `backbone.safetensors`, `draft.safetensors`, `calibration.json`, `tokenizer.json`: the main
  bundle (`dspark_jax.bundle.load_bundle`): an `mhc` (V4.1-style) backbone, {b_layers} layers, dim {b_dim},
  vocab {vocab}, {b_params:.1f}M parameters (configs/default_backbone.json), trained {b_minutes} min on CPU
  ({b_steps} steps, {b_tokens:.2f}M tokens; held-out CE {b_held:.2f} nats/token), and its block-{block} DSpark
  draft with the Markov head (configs/default_draft_dspark.json, {d_params:.1f}M parameters of its own), STS
  temperatures fitted on held-out rounds at T = 1.
- `variants/parallel/`: the same draft with `markov_rank 0` (pure parallel); `variants/onetoken/`: block 1.
  Each: `draft.json` (DSparkConfig), `draft.safetensors`, `calibration.json`. Same training budget as the
  main draft (`configs/default_train_draft_*.yaml`, {d_steps} steps x 8 sequences x 256 tokens), on the same
  on-policy data: 4096 prompts of 64 tokens cut from the training split, each continued for 192 tokens by
  this backbone itself (`dspark regenerate`, T = 0 and T = 1 alternating; the loss covers the
  continuations only), so the drafts learn the backbone, not the corpus.
- `tokenizer.json`: byte-level BPE, {vocab} tokens, trained on the training split; id 0 `<|endoftext|>`,
  id 1 `<|noise|>` (the drafts' noise token).
- `prompts.jsonl`: evaluation prompts cut from held-out stdlib files (used by `dspark demo` and
  `dspark bench acceptance`); the calibration prompts come from other held-out files.
- `training.json`, `logs/`: corpus manifest, final training numbers, and the raw training/metric logs.

Corpus: the `*.py` sources of the Python standard library that ships with the interpreter
(`sysconfig.get_paths()["stdlib"]`, CPython {python} here), split by file: sha256(relative path) % 100 < 5
is held out. Weights are stored as {dtype} (loading casts to the configs' f32); every measurement was taken
on these stored weights.
"""


def write_docs(build: Path, dest: Path, bcfg, drafts: dict, info: dict) -> None:
    """README.md from the configs and final numbers; logs/ with the raw training logs."""
    b, dcfg = info["backbone"], drafts["dspark"][0]
    (dest / "README.md").write_text(README.format(
        b_layers=bcfg.n_layers, b_dim=bcfg.dim, vocab=bcfg.vocab_size, b_params=b["params"] / 1e6,
        b_minutes=b["minutes"], b_steps=b["steps"], b_tokens=b["tokens"] / 1e6, b_held=b["heldout_loss"],
        block=dcfg.block_size, d_params=info["drafts"]["dspark"]["params"] / 1e6,
        d_steps=info["drafts"]["dspark"].get("step"), python=info["corpus"]["python"], dtype=info["weights_dtype"]))
    logs = dest / "logs"
    logs.mkdir(exist_ok=True)
    shutil.copy(build / "backbone" / "log.jsonl", logs / "backbone_log.jsonl")
    for name in drafts:
        src = build / "drafts" / name / "metrics.jsonl"
        if src.is_file():
            shutil.copy(src, logs / f"draft_{name}_metrics.jsonl")


def load_trained(build: Path, name: str):
    """(config, params) of a draft trained by scripts/train_drafts.py."""
    from dspark_jax import drafts
    from dspark_jax.bundle import unflatten_strict
    from dspark_jax.checkpoint.safetensors_io import open_checkpoint

    run = build / "drafts" / name
    cfg = drafts.load_config(run / "draft.json")
    return cfg, unflatten_strict(open_checkpoint(run / "draft.safetensors"), drafts.abstract_params(cfg), f"draft {name}")


def final_metrics(build: Path, name: str, dparams) -> dict:
    """The last training log line's figures and the parameter count of a trained draft."""
    from dspark_jax import drafts

    last = last_json_line(build / "drafts" / name / "metrics.jsonl") or {}
    out = {k: v for k, v in last.items() if k in ("step", "loss", "ce", "l1", "conf", "tau_estimate")
           or k.startswith("accept_rate@")}
    out["params"] = drafts.count_params(dparams)
    return out


def add_variants(build: Path, dest: Path, names: list[str], dtype) -> int:
    """Add trained drafts as variants of an assembled default (the Markov head variants, issue 19), their
    final training figures into training.json and their logs into logs/; the bundle itself is untouched."""
    from dspark_jax.evaluation import save_variant

    info = json.loads((dest / "training.json").read_text())
    for name in names:
        cfg, dparams = load_trained(build, name)
        save_variant(dest, name, cfg, dparams, dtype)
        info["drafts"][name] = final_metrics(build, name, dparams)
        shutil.copy(build / "drafts" / name / "metrics.jsonl", dest / "logs" / f"draft_{name}_metrics.jsonl")
        print(f"variant {name} ({cfg.markov_head_type} Markov head) -> {dest / 'variants' / name}")
    (dest / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    return 0


def set_aside_head_variants(dest: Path, build: Path, keep: Path) -> dict:
    """The Markov head variants (issue 19: gated, rnn) of the bundle being replaced that this build did not
    train: scripts/build_head_variants.sh adds them after an assembly, so rebuilding the three comparison
    drafts alone would otherwise delete them. Copies each variant folder and its log to `keep`
    -> {name: its training.json entry}."""
    old = json.loads((dest / "training.json").read_text())["drafts"] if (dest / "training.json").is_file() else {}
    kept = {}
    for vdir in sorted((dest / "variants").glob("*")) if (dest / "variants").is_dir() else []:
        name = vdir.name
        if name in ("parallel", "onetoken") or (build / "drafts" / name / "draft.safetensors").is_file():
            continue
        shutil.rmtree(keep / name, ignore_errors=True)
        (keep / name).mkdir(parents=True)
        shutil.copytree(vdir, keep / name / "variant", dirs_exist_ok=True)
        log = dest / "logs" / f"draft_{name}_metrics.jsonl"
        if log.is_file():
            shutil.copy(log, keep / name / log.name)
        kept[name] = old.get(name, {})
        print(f"keeping variant {name} (not in this build)")
    return kept


def put_back_head_variants(kept: dict, keep: Path, dest: Path) -> dict:
    """Put set_aside_head_variants' folders back into the new bundle -> their training.json entries."""
    (dest / "logs").mkdir(exist_ok=True)
    for name in kept:
        shutil.copytree(keep / name / "variant", dest / "variants" / name, dirs_exist_ok=True)
        for log in (keep / name).glob("draft_*_metrics.jsonl"):
            shutil.copy(log, dest / "logs" / log.name)
    return kept


def main(argv=None) -> int:
    from dspark_jax.backbones.mhc import MhcBackbone, MhcConfig
    from dspark_jax.bundle import save_bundle, unflatten_strict
    from dspark_jax.checkpoint.safetensors_io import open_checkpoint
    from dspark_jax.evaluation import save_variant

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build/default_model")
    ap.add_argument("--dest", default="dspark_jax/assets/default")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--add-variants", nargs="+", default=None, metavar="NAME",
                    help="only add these trained drafts (e.g. gated rnn) as variants of the assembled default")
    args = ap.parse_args(argv)
    build, dest = ROOT / args.build, ROOT / args.dest
    dtype = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else np.dtype(np.float32)

    if args.add_variants:
        return add_variants(build, dest, args.add_variants, dtype)
    bb = MhcBackbone(MhcConfig.from_json(build / "backbone" / "backbone.json"))
    bparams = unflatten_strict(open_checkpoint(build / "backbone" / "backbone.safetensors"), bb.abstract_params(),
                               "backbone")
    trained = {name: load_trained(build, name) for name in ("dspark", "parallel", "onetoken")}

    keep = build / "kept_variants"
    kept = set_aside_head_variants(dest, build, keep)
    if dest.exists():
        shutil.rmtree(dest)
    cfg, dparams = trained["dspark"]
    save_bundle(dest, backbone_family="mhc", backbone=bb, backbone_params=cast(bparams, dtype), draft_cfg=cfg,
                draft_params=cast(dparams, dtype), tap_mode="entry",
                tokenizer_json=(build / "tokenizer.json").read_text())
    for name in ("parallel", "onetoken"):
        save_variant(dest, name, *trained[name], dtype)
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
    for name in trained:
        info["drafts"][name] = final_metrics(build, name, trained[name][1])
    info["drafts"].update(put_back_head_variants(kept, keep, dest))
    (dest / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    write_docs(build, dest, bb.cfg, trained, info)
    total = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"default model -> {dest} ({total / 2 ** 20:.1f} MiB)")
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
