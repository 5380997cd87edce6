#!/usr/bin/env python
"""Train the second embedded default's target: a tiny Qwen3 LM on the stdlib corpus, saved in the Hugging
Face layout (config.json + bf16 model.safetensors, `model.*` names), the way a released Qwen3 target comes.

The data, batching and schedule are scripts/train_backbone.py's (imported: random windows of the flat
token stream `train.bin`, linear warmup then cosine to 10% of the peak driven by max(step / steps,
elapsed / budget), held-out loss every --eval-every); the model is `Qwen3Backbone` and the checkpoint is
written with `save_qwen3_hf` (the inverse of `dspark_jax.backbones.qwen3.hf_layer_map`). The weights are
rounded to bf16 when saved, and that bf16 model is the target everything later trains and measures against.

    python scripts/train_backbone_qwen3.py --config configs/default_qwen3_backbone.json \
        --data build/default_model/corpus --out build/default_qwen3/backbone --minutes 20
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_backbone import load_tokens, lr_at, sample_windows  # noqa: E402  (the mhc trainer's data + schedule)

from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Config, hf_layer_map  # noqa: E402
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/default_qwen3_backbone.json")
    ap.add_argument("--data", default="build/default_model/corpus", help="folder with train.bin / heldout.bin")
    ap.add_argument("--out", default="build/default_qwen3/backbone")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20000, help="step cap (the schedule ends at whichever comes first)")
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget for the training loop")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=float, default=0.03)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=4)
    args = ap.parse_args(argv)

    raw = json.loads(Path(args.config).read_text())
    cfg = Qwen3Config.from_hf_dict(raw)
    bb = Qwen3Backbone(cfg)
    data = Path(args.data)
    train, held = load_tokens(data / "train.bin"), load_tokens(data / "heldout.bin")
    params = bb.init_params(jax.random.key(args.seed))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"qwen3 backbone: {n_params / 1e6:.2f}M params; train {train.size} tokens, held-out {held.size}", flush=True)

    decay_mask = jax.tree.map(lambda x: x.ndim >= 2, params)
    opt = optax.chain(optax.clip_by_global_norm(args.clip),
                      optax.inject_hyperparams(optax.adamw)(learning_rate=args.lr, b1=0.9, b2=0.95,
                                                            weight_decay=args.weight_decay, mask=decay_mask))
    opt_state = opt.init(params)

    def loss_fn(p, window):
        x, y = window[:, :-1], window[:, 1:]
        out = bb.forward(p, bb.init_cache(x.shape[0], x.shape[1]), x)
        logp = jax.nn.log_softmax(out.logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))

    @jax.jit
    def train_step(p, s, window, lr):
        s[1].hyperparams["learning_rate"] = lr
        loss, g = jax.value_and_grad(loss_fn)(p, window)
        upd, s = opt.update(g, s, p)
        return optax.apply_updates(p, upd), s, loss, optax.global_norm(g)

    eval_loss = jax.jit(loss_fn)
    erng = np.random.default_rng(1234)
    eval_windows = [sample_windows(erng, held, args.batch, args.seq_len + 1) for _ in range(args.eval_batches)]

    def evaluate(p) -> float:
        return float(np.mean([float(eval_loss(p, jnp.asarray(w))) for w in eval_windows]))

    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.jsonl", "a")
    budget = args.minutes * 60.0
    t0 = time.time()
    step, ema, progress, held_loss = 0, None, 0.0, float("nan")
    bar = tqdm(total=args.steps, desc="qwen3 backbone", unit="step", mininterval=10.0)
    while progress < 1.0:
        lr = lr_at(progress, args.lr, args.warmup, 0.1)
        window = jnp.asarray(sample_windows(rng, train, args.batch, args.seq_len + 1))
        params, opt_state, loss, gnorm = train_step(params, opt_state, window, jnp.float32(lr))
        step += 1
        loss = float(loss)
        ema = loss if ema is None else 0.98 * ema + 0.02 * loss
        elapsed = time.time() - t0
        progress = max(step / args.steps, elapsed / budget)
        bar.update(1)
        rec = {"step": step, "loss": loss, "loss_ema": ema, "lr": lr, "grad_norm": float(gnorm),
               "elapsed_s": round(elapsed, 1), "tokens": step * args.batch * args.seq_len}
        if step % args.eval_every == 0 or progress >= 1.0:
            held_loss = evaluate(params)
            rec["heldout_loss"] = held_loss
            tqdm.write(f"step {step} loss(ema) {ema:.4f} held-out {held_loss:.4f} lr {lr:.2e} "
                       f"elapsed {elapsed / 60:.1f} min")
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if step % args.ckpt_every == 0 or progress >= 1.0:
            save_qwen3_hf(out, raw, cfg, params, {**rec, "done": progress >= 1.0, "params": n_params,
                                                  "seq_len": args.seq_len, "batch": args.batch})
    bar.close()
    print(f"done: {step} steps, {step * args.batch * args.seq_len} tokens, train loss(ema) {ema:.4f}, "
          f"held-out loss {held_loss:.4f} -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
