#!/usr/bin/env python
"""Assemble the second embedded default (dspark_jax/assets/default_qwen3): a tiny Qwen3 target and its
DeepSpec-family DSpark draft, going through the SAME path a user takes with a released Qwen3 DSpark draft.

1. the trained draft (latest `dspark train` checkpoint of build/default_qwen3/draft) is exported in the
   DeepSpec checkpoint layout (config.json + bf16 model.safetensors, `Qwen3DSparkModel` names) to
   build/default_qwen3/draft_deepspec/, with the target's embedding / head as embed_tokens / lm_head;
2. `dspark convert build/default_qwen3/draft_deepspec DEST --to bundle --backbone build/default_qwen3/backbone`
   builds the serving bundle from that folder and the target's Hugging Face folder (the target's
   tokenizer.json is the shared BPE tokenizer, copied in first);
3. the bundle's safetensors are rewritten in bf16 (lossless: every value came from a bf16 file; the
   configs keep f32 compute), prompts.jsonl (held-out evaluation prompts), training.json, README.md and
   logs/ (training logs; after calibration and the benchmark, `--docs-only` adds their summaries).

    python scripts/assemble_default_qwen3.py [--build build/default_qwen3] [--dest dspark_jax/assets/default_qwen3]
    python scripts/assemble_default_qwen3.py --docs-only      # refresh README.md and logs/ only
    python scripts/assemble_default_qwen3.py --add-variants parallel onetoken   # only add the comparison drafts

The comparison drafts (build/default_qwen3/draft_<name>, trained on the DSpark draft's data with its budget:
configs/default_qwen3_train_draft_<name>.yaml) go to DEST/variants/<name>/ (draft.json + bf16
draft.safetensors, what `dspark bench acceptance --variants` reads); a full assembly adds those present.
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
    rec = None
    if path.is_file():
        for line in open(path):
            if line.strip() and (key is None or key in json.loads(line)):
                rec = json.loads(line)
    return rec


def latest_params(run_dir: Path):
    from dspark_jax.checkpoint.orbax_io import restore_params

    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    ckpt = run_dir / "checkpoints" / str(steps[-1])
    item = ckpt / "default" if (ckpt / "default").is_dir() else ckpt
    return steps[-1], restore_params(item)["params"]


def to_bf16_in_place(path: Path) -> None:
    from dspark_jax.checkpoint.safetensors_io import open_checkpoint, save_file

    r = open_checkpoint(path)
    out = {}
    for n in r.names:
        a = np.asarray(r.view(n), np.float32)
        b = a.astype(ml_dtypes.bfloat16)
        if not np.array_equal(b.astype(np.float32), a):
            raise SystemExit(f"{path}: tensor {n} is not bf16-exact; refusing a lossy rewrite")
        out[n] = b
    del r
    save_file(path, out)


VARIANTS = ("parallel", "onetoken")  # the comparison drafts: pure parallel (rank 0) and block 1


def add_variants(build: Path, dest: Path, names) -> dict:
    """DEST/variants/<name>/ from each trained comparison draft, their logs into logs/ -> {name: final
    figures}. The f32 training weights are rounded to bf16, the rounding the bundle's draft gets in its
    DeepSpec export, so the three drafts are measured at the same precision."""
    from dspark_jax import drafts
    from dspark_jax.evaluation import save_variant

    figures = {}
    for name in names:
        step, params = latest_params(build / f"draft_{name}")
        cfg = drafts.load_config(ROOT / "configs" / f"default_qwen3_draft_{name}.json")
        save_variant(dest, name, cfg, params, ml_dtypes.bfloat16)
        last = last_json_line(build / f"draft_{name}" / "metrics.jsonl") or {}
        figures[name] = {"steps": step, **final_figures(last), "params": drafts.count_params(params)}
        (dest / "logs").mkdir(exist_ok=True)
        shutil.copy(build / f"draft_{name}" / "metrics.jsonl", dest / "logs" / f"draft_{name}_metrics.jsonl")
        print(f"variant {name} (step {step}) -> {dest / 'variants' / name}", flush=True)
    return figures


def final_figures(last_log_line: dict) -> dict:
    """The figures of a draft's last training log line that training.json records."""
    return {k: v for k, v in last_log_line.items() if k in ("loss", "ce", "l1", "conf", "tau_estimate")
            or k.startswith("accept_rate@")}


def main(argv=None) -> int:
    from dspark_jax.backbones.qwen3 import Qwen3Backbone
    from dspark_jax.checkpoint.deepspec import export_deepspec_draft
    from dspark_jax.checkpoint.qwen3_hf import load_qwen3_hf
    from dspark_jax.cli import main as dspark
    from dspark_jax import drafts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build/default_qwen3")
    ap.add_argument("--shared", default="build/default_model", help="the first default's corpus/tokenizer/prompts")
    ap.add_argument("--draft-config", default="configs/default_qwen3_draft.json")
    ap.add_argument("--dest", default="dspark_jax/assets/default_qwen3")
    ap.add_argument("--docs-only", action="store_true", help="only (re)write README.md and logs/")
    ap.add_argument("--add-variants", nargs="+", default=None, choices=VARIANTS, metavar="NAME",
                    help="only add these trained comparison drafts (parallel, onetoken) to the assembled default")
    args = ap.parse_args(argv)
    build, shared, dest = ROOT / args.build, ROOT / args.shared, ROOT / args.dest
    if args.docs_only:
        write_docs(build, dest)
        return 0
    if args.add_variants:
        info = json.loads((dest / "training.json").read_text())
        info.setdefault("variants", {}).update(add_variants(build, dest, args.add_variants))
        (dest / "training.json").write_text(json.dumps(info, indent=2) + "\n")
        return 0

    step, params = latest_params(build / "draft")
    cfg = drafts.load_config(ROOT / args.draft_config)
    bcfg, bparams = load_qwen3_hf(build / "backbone")
    tied = {k: np.asarray(v) for k, v in Qwen3Backbone(bcfg).tied(bparams).items()}
    export_deepspec_draft(params, tied, cfg, build / "draft_deepspec", dtype="BF16")
    shutil.copy(shared / "tokenizer.json", build / "backbone" / "tokenizer.json")
    print(f"draft step {step} -> DeepSpec layout {build / 'draft_deepspec'}", flush=True)

    if dest.exists():
        shutil.rmtree(dest)
    rc = dspark(["convert", str(build / "draft_deepspec"), str(dest), "--to", "bundle", "--backbone",
                 str(build / "backbone"), "--dtype", "float32", "--quiet"])
    if rc:
        return rc
    for name in ("backbone.safetensors", "draft.safetensors"):
        to_bf16_in_place(dest / name)
    shutil.copy(shared / "prompts.jsonl", dest / "prompts.jsonl")

    bstate = json.loads((build / "backbone" / "train_state.json").read_text())
    held = last_json_line(build / "backbone" / "log.jsonl", "heldout_loss")
    last = last_json_line(build / "draft" / "metrics.jsonl") or {}
    info = {"weights_dtype": "bfloat16 (f32 compute)",
            "corpus": json.loads((shared / "corpus" / "manifest.json").read_text()),
            "backbone": {"family": "qwen3", "params": bstate.get("params"), "steps": bstate["step"],
                         "tokens": bstate["tokens"], "train_loss_ema": bstate["loss_ema"],
                         "heldout_loss": held and held["heldout_loss"], "minutes": round(bstate["elapsed_s"] / 60, 1),
                         "seq_len": bstate.get("seq_len"), "batch": bstate.get("batch")},
            "draft": {"family": "qwen3 (DeepSpec)", "steps": step, **final_figures(last),
                      "params": drafts.count_params(params)},
            "variants": add_variants(build, dest, [n for n in VARIANTS if (build / f"draft_{n}").is_dir()])}
    (dest / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    write_docs(build, dest)
    total = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"default_qwen3 -> {dest} ({total / 2 ** 20:.1f} MiB)")
    print(json.dumps(info, indent=2))
    return 0


README = """# The second embedded default model: a Qwen3 target with a DeepSpec-family DSpark draft

Built by `bash scripts/build_default_qwen3.sh` (see the scripts for every step); nothing here is hand-edited.

- `bundle.json`, `backbone.safetensors`, `draft.safetensors`, `calibration.json`, `tokenizer.json`: the bundle
  (`dspark_jax.bundle.load_bundle`, `dspark generate --bundle dspark_jax/assets/default_qwen3`): a tiny Qwen3
  target (configs/default_qwen3_backbone.json: 4 layers, width 128, 4 heads / 2 KV heads, vocab 4096, tied
  embeddings, 1.3M parameters) and its DeepSpec-family ("qwen3") DSpark draft (configs/default_qwen3_draft.json:
  2 Qwen3 layers at width 128, block 7, taps = OUTPUTS of target layers 0, 1, 2, mask token 1 `<|noise|>`,
  Markov rank 32, confidence head with bias), STS temperatures fitted on held-out rounds at T = 1.
- The bundle was made the way a released Qwen3 DSpark draft is served: the trained draft was exported in the
  DeepSpec checkpoint layout (`Qwen3DSparkModel` config.json + bf16 model.safetensors), the target saved as
  a Hugging Face Qwen3 folder, and `dspark convert DRAFT DEST --to bundle --backbone TARGET` joined them.
- `variants/parallel/`, `variants/onetoken/`: the comparison drafts, trained on the same data with the same
  budget (seed, steps, optimiser): the same draft with `markov_rank 0` (pure parallel; its confidence head
  reads no Markov input) and with block 1 (a one-token draft); `dspark bench acceptance --bundle
  dspark_jax/assets/default_qwen3` measures all three.
- `tokenizer.json`, `prompts.jsonl`, the corpus: shared with `dspark_jax/assets/default` (stdlib sources,
  split by file; the evaluation prompts and the calibration prompts come from different held-out files).
- The draft's training data is on-policy: 4096 prompts of 64 tokens cut from the training split, each
  continued for 192 tokens by this target itself (`dspark regenerate`, T = 0 and T = 1 alternating; the
  loss covers the continuations only), so the draft learns the target, not the corpus.
- `training.json`, `logs/`: final training numbers, the raw training logs, the calibration summary and
  the `dspark bench acceptance` numbers (`acceptance.json`).

Weights are stored as bf16 (loading casts to the configs' f32); every measurement was taken on these
stored weights.
"""


def write_docs(build: Path, dest: Path) -> None:
    (dest / "README.md").write_text(README)
    logs = dest / "logs"
    logs.mkdir(exist_ok=True)
    for src, name in ((build / "backbone" / "log.jsonl", "backbone_log.jsonl"),
                      (build / "draft" / "metrics.jsonl", "draft_dspark_metrics.jsonl"),
                      (build / "calibration_summary.json", "calibration_summary.json"),
                      (build / "acceptance.json", "acceptance.json")):
        if src.is_file():
            shutil.copy(src, logs / name)


if __name__ == "__main__":
    sys.exit(main())
