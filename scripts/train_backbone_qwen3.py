#!/usr/bin/env python
"""Train the second embedded default's target: a tiny Qwen3 LM on the stdlib corpus, saved in the Hugging
Face layout (config.json + bf16 model.safetensors, `model.*` names), the way a released Qwen3 target comes.

The training loop, data, batching and schedule are scripts/train_backbone.py's (imported: random
windows of the flat token stream `train.bin`, linear warmup then cosine to 10% of the peak driven by
max(step / steps, elapsed / budget), held-out loss every --eval-every); the model is `Qwen3Backbone` and
the checkpoint is written with `save_qwen3_hf` (the inverse of `dspark_jax.checkpoint.qwen3_hf.hf_layer_map`).
The weights are rounded to bf16 when saved, and that bf16 model is the target everything later trains
and measures against.

    python scripts/train_backbone_qwen3.py --config configs/default_qwen3_backbone.json \
        --data build/default_model/corpus --out build/default_qwen3/backbone --minutes 20
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_backbone import arg_parser, train_lm  # noqa: E402  (the mhc trainer's loop, data and schedule)

from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Config  # noqa: E402
from dspark_jax.checkpoint.qwen3_hf import hf_layer_map  # noqa: E402
from dspark_jax.checkpoint.safetensors_io import save_file  # noqa: E402


def save_qwen3_hf(out: Path, raw_config: dict, cfg: Qwen3Config, params, state: dict) -> None:
    """Our Qwen3 tree -> a Hugging Face folder (bf16 tensors), written atomically enough for a rerun."""
    out.mkdir(parents=True, exist_ok=True)
    p = jax.device_get(params)
    bf = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
    hf = {"model.embed_tokens.weight": bf(p["embed"]), "model.norm.weight": bf(p["norm"]["scale"])}
    if not cfg.tie_word_embeddings:
        hf["lm_head.weight"] = bf(p["lm_head"])
    for suffix, (mod, leaf), _, _ in hf_layer_map(cfg):
        for i in range(cfg.num_hidden_layers):
            w = np.asarray(p["layers"][mod][leaf][i])
            hf[f"model.layers.{i}.{suffix}"] = bf(w.T if w.ndim == 2 else w)
    tmp = out / "model.safetensors.tmp"
    save_file(tmp, hf, {"format": "pt"})
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({k: v for k, v in raw_config.items()
                                                 if k not in ("param_dtype", "compute_dtype")}, indent=2) + "\n")
    (out / "train_state.json").write_text(json.dumps(state, indent=2) + "\n")


def main(argv=None) -> int:
    ap = arg_parser(__doc__.splitlines()[0], config="configs/default_qwen3_backbone.json",
                    out="build/default_qwen3/backbone", seq_len=128, minutes=20.0, lr=3e-3, ckpt_every=200,
                    eval_every=100, eval_batches=4)
    args = ap.parse_args(argv)
    raw = json.loads(Path(args.config).read_text())
    cfg = Qwen3Config.from_hf_dict(raw)
    return train_lm(Qwen3Backbone(cfg), args, lambda out, params, state: save_qwen3_hf(out, raw, cfg, params, state),
                    name="qwen3 backbone")


if __name__ == "__main__":
    sys.exit(main())
