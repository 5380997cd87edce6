#!/usr/bin/env python
"""Train the default model's backbone: a small `mhc` (V4.1-style) LM, next-token cross-entropy, AdamW.

This is the backbone LM trainer, not the draft trainer (`dspark train`). Each batch is `batch` random
windows of `seq_len + 1` tokens from the flat token stream `train.bin` (scripts/train_tokenizer.py); the
model runs `MhcBackbone.forward` over the window with a fresh cache (so training and inference share one
code path), loss = mean CE of positions 0..seq_len-1 against the next token.

Schedule: linear warmup then cosine to 10% of the peak, driven by progress = max(step / steps,
elapsed / budget) so a wall-clock budget (`--minutes`) still ends with a decayed learning rate. A checkpoint
(`backbone.safetensors` + `backbone.json` + `train_state.json`) is written every `--ckpt-every` steps and
at the end, so a stopped run still leaves a usable model. Held-out loss is logged every `--eval-every`.

    python scripts/train_backbone.py --config configs/default_backbone.json \
        --data build/default_model/corpus --out build/default_model/backbone --minutes 50
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from dspark_jax.backbones.mhc import MhcBackbone, MhcConfig
from dspark_jax.bundle import flatten
from dspark_jax.checkpoint.safetensors_io import save_file


def load_tokens(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype=np.uint16).astype(np.int32)


def sample_windows(rng: np.random.Generator, toks: np.ndarray, batch: int, length: int) -> np.ndarray:
    starts = rng.integers(0, toks.size - length, size=batch)
    return np.stack([toks[s:s + length] for s in starts])


def lr_at(progress: float, peak: float, warmup: float, floor: float) -> float:
    if progress < warmup:
        return peak * progress / warmup
    p = min(1.0, (progress - warmup) / max(1e-9, 1.0 - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p)))


def save_checkpoint(out: Path, cfg: MhcConfig, params, state: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "backbone.safetensors.tmp"
    save_file(tmp, {k: np.asarray(v) for k, v in flatten(jax.device_get(params)).items()})
    tmp.replace(out / "backbone.safetensors")
    (out / "backbone.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    (out / "train_state.json").write_text(json.dumps(state, indent=2) + "\n")


def arg_parser(description: str, **defaults) -> argparse.ArgumentParser:
    """The LM trainer's options; `defaults` override per backbone family (scripts/train_backbone_qwen3.py)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", default="configs/default_backbone.json")
    ap.add_argument("--data", default="build/default_model/corpus", help="folder with train.bin / heldout.bin")
    ap.add_argument("--out", default="build/default_model/backbone")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20000, help="step cap (the schedule ends at whichever comes first)")
    ap.add_argument("--minutes", type=float, default=50.0, help="wall-clock budget for the training loop")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=float, default=0.03, help="warmup fraction of progress")
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.set_defaults(**defaults)
    return ap


def train_lm(bb, args, save: Callable[[Path, Any, dict], None], name: str = "backbone") -> int:
    """Train backbone `bb` (any family with init_params / init_cache / forward) as a next-token LM;
    `save(out, params, state)` writes a checkpoint in the family's own format."""
    data = Path(args.data)
    train, held = load_tokens(data / "train.bin"), load_tokens(data / "heldout.bin")
    params = bb.init_params(jax.random.key(args.seed))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"{name}: {n_params / 1e6:.2f}M params; train {train.size} tokens, held-out {held.size}", flush=True)

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
    bar = tqdm(total=args.steps, desc=name, unit="step", mininterval=5.0)
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
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.2e}", held=f"{held_loss:.3f}", refresh=False)
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
            save(out, params, {**rec, "done": progress >= 1.0, "params": n_params,
                               "seq_len": args.seq_len, "batch": args.batch})
    bar.close()
    print(f"done: {step} steps, {step * args.batch * args.seq_len} tokens, train loss(ema) {ema:.4f}, "
          f"held-out loss {held_loss:.4f} -> {out}", flush=True)
    return 0


def main(argv=None) -> int:
    args = arg_parser(__doc__.splitlines()[0]).parse_args(argv)
    cfg = MhcConfig.from_json(args.config)
    return train_lm(MhcBackbone(cfg), args, lambda out, params, state: save_checkpoint(out, cfg, params, state))


if __name__ == "__main__":
    sys.exit(main())
