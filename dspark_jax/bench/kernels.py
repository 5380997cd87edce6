"""`dspark bench kernels`: the Pallas kernels against their jnp references.

On TPU it times the compiled kernels and the references (jitted, median of --iters calls after
--warmup) at the given shapes (default: V4.1-Flash, B=8), checks that they agree there, and reports
the effective HBM bandwidth of each. On GPU the kernels do not exist (they are Mosaic-TPU kernels;
impl="auto" runs the references there), so only the references are timed. On CPU nothing is timed:
it checks, at small shapes, that the kernels in Pallas interpret mode agree with the references, and
says so.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from dspark_jax.kernels.markov_sampler import markov_sample_pallas, markov_sample_reference, plan_vocab_tile
from dspark_jax.kernels.window_attention import (plan_row_block, window_attention_pallas,
                                                 window_attention_reference)
from dspark_jax.validation import check_int_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=8, help="requests B")
    parser.add_argument("--block", type=int, default=5, help="draft block size K")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=512)
    parser.add_argument("--window", type=int, default=128, help="ring slots W")
    parser.add_argument("--vocab", type=int, default=129280)
    parser.add_argument("--rank", type=int, default=256, help="Markov rank r")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="query / KV / Markov weight dtype")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", choices=["all", "attention", "sampler"], default="all")


def _attention_inputs(key, b, k, h, hd, w, dtype):
    kq, kr, kd, ks, kl = jax.random.split(key, 5)
    q = jax.random.normal(kq, (b, k, h, hd), jnp.float32).astype(dtype)
    ring = jax.random.normal(kr, (b, w, hd), jnp.float32).astype(dtype)
    draft = jax.random.normal(kd, (b, k, hd), jnp.float32).astype(dtype)
    sink = jax.random.normal(ks, (h,), jnp.float32)
    ring_len = jax.random.randint(kl, (b,), 1, 2 * w + 1, jnp.int32)  # fills below, at and past W
    return q, ring, ring_len, draft, sink


def _sampler_inputs(key, b, k, v, r, dtype):
    kb, ka, k1, k2, kn = jax.random.split(key, 5)
    base = jax.random.normal(kb, (b, k, v), jnp.float32) * 2.0
    anchor = jax.random.randint(ka, (b,), 0, v, jnp.int32)
    w1 = jax.random.normal(k1, (v, r), jnp.float32).astype(dtype)
    w2 = (jax.random.normal(k2, (v, r), jnp.float32) * 0.1).astype(dtype)
    temperature = jnp.asarray([[0.0, 0.7, 1.0, 1.3][i % 4] for i in range(b)], jnp.float32)
    noise = jax.random.gumbel(kn, (b, k, v), jnp.float32)
    return base, anchor, w1, w2, temperature, noise


def _time(fn, args, iters: int, warmup: int) -> float:
    """Median seconds per call of a jitted fn (compile excluded)."""
    for _ in range(max(1, warmup)):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _agree_attention(out, ref) -> float:
    return float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))


def _agree_sampler(out, ref) -> tuple[bool, float, float]:
    same_tokens = bool(jnp.all(out[0] == ref[0]))
    logq_err = float(jnp.max(jnp.abs(out[1] - ref[1])))
    logits_err = float(jnp.max(jnp.abs(out[3] - ref[3])))
    return same_tokens, logq_err, logits_err


def _interpret_check() -> bool:
    """Small-shape agreement of the interpreted kernels with the references."""
    ok = True
    key = jax.random.key(0)
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
        a = _attention_inputs(key, 3, 5, 4, 128, 16, dtype)
        f = jax.jit(lambda *x: window_attention_pallas(*x, scale=128 ** -0.5, interpret=True))
        err = _agree_attention(f(*a), window_attention_reference(*a, scale=128 ** -0.5))
        good = err <= tol
        ok &= good
        print(f"  window_attention  {jnp.dtype(dtype).name:8s} B=3 K=5 H=4 hd=128 W=16: "
              f"max |kernel - reference| = {err:.2e} (tolerance {tol:.0e}) {'ok' if good else 'FAIL'}")
    for dtype, v in ((jnp.float32, 384), (jnp.bfloat16, 300)):
        s = _sampler_inputs(key, 3, 5, v, 16, dtype)
        f = jax.jit(lambda *x: markov_sample_pallas(*x, vocab_tile=128, interpret=True))
        same, lq, lg = _agree_sampler(f(*s), markov_sample_reference(*s))
        good = same and lq <= 1e-5 and lg <= 1e-5
        ok &= good
        print(f"  markov_sample     {jnp.dtype(dtype).name:8s} B=3 K=5 V={v} r=16 tile=128: tokens equal={same}, "
              f"max |dlogq| = {lq:.2e}, max |dlogits| = {lg:.2e} {'ok' if good else 'FAIL'}")
    return ok


def run(args: argparse.Namespace) -> int:
    check_int_flags(args, "batch", "block", "heads", "head_dim", "window", "vocab", "rank", "iters")
    check_int_flags(args, "warmup", minimum=0)
    backend = jax.default_backend()
    print(f"dspark bench kernels: backend={backend}, devices={[d.device_kind for d in jax.devices()][:1]}")
    if backend == "cpu":
        print("No accelerator: nothing was timed. Only interpret-mode correctness was checked, at small shapes:")
        ok = _interpret_check()
        print("interpret-mode check: " + ("all agree" if ok else "MISMATCH"))
        return 0 if ok else 1

    dtype = jnp.dtype(args.dtype)
    b, k, h, hd, w, v, r = args.batch, args.block, args.heads, args.head_dim, args.window, args.vocab, args.rank
    on_tpu = backend == "tpu"
    if not on_tpu:
        print(f"The kernels are Mosaic-TPU kernels and do not run compiled on {backend}; impl='auto' uses the "
              "references here, so only the references are timed.")
    key = jax.random.key(0)
    ok = True

    if args.only in ("all", "attention"):
        a = _attention_inputs(key, b, k, h, hd, w, dtype)
        scale = hd ** -0.5
        ref_fn = jax.jit(lambda *x: window_attention_reference(*x, scale=scale))
        nbytes = sum(x.size * x.dtype.itemsize for x in a) + a[0].size * a[0].dtype.itemsize  # + o
        t_ref = _time(ref_fn, a, args.iters, args.warmup)
        print(f"window_attention B={b} K={k} H={h} hd={hd} W={w} {dtype.name}: "
              f"reference {t_ref * 1e6:9.1f} us ({nbytes / t_ref / 1e9:7.1f} GB/s effective)")
        if on_tpu:
            tq = plan_row_block(k * h, hd, w, k, dtype, dtype)
            ker_fn = jax.jit(lambda *x: window_attention_pallas(*x, scale=scale))
            t_ker = _time(ker_fn, a, args.iters, args.warmup)
            err = _agree_attention(ker_fn(*a), ref_fn(*a))
            tol = 1e-5 if dtype == jnp.float32 else 2e-2
            ok &= err <= tol
            print(f"{'':>{len('window_attention')}} kernel    {t_ker * 1e6:9.1f} us ({nbytes / t_ker / 1e9:7.1f} GB/s "
                  f"effective), row block {tq}, speedup x{t_ref / t_ker:.2f}, max |diff| {err:.2e}")

    if args.only in ("all", "sampler"):
        s = _sampler_inputs(key, b, k, v, r, dtype)
        ref_fn = jax.jit(markov_sample_reference)
        # per step: w2 once, base + noise read, logits written and read back once
        nbytes = k * (v * r * dtype.itemsize + 4 * b * v * 4)
        t_ref = _time(ref_fn, s, args.iters, args.warmup)
        print(f"markov_sample    B={b} K={k} V={v} r={r} {dtype.name}: "
              f"reference {t_ref * 1e6:9.1f} us ({nbytes / t_ref / 1e9:7.1f} GB/s effective)")
        if on_tpu:
            tile, layout = plan_vocab_tile(b, v, r, dtype, dtype)
            ker_fn = jax.jit(markov_sample_pallas)
            t_ker = _time(ker_fn, s, args.iters, args.warmup)
            same, lq, lg = _agree_sampler(ker_fn(*s), ref_fn(*s))
            ok &= same and lq <= 1e-4 and lg <= 1e-3
            print(f"{'':>{len('markov_sample   ')}} kernel    {t_ker * 1e6:9.1f} us ({nbytes / t_ker / 1e9:7.1f} GB/s "
                  f"effective), tile {tile} ({layout}), speedup x{t_ref / t_ker:.2f}, tokens equal={same}, "
                  f"max |dlogq| {lq:.2e}, max |dlogits| {lg:.2e}")
    if on_tpu:
        print("kernel vs reference: " + ("agree" if ok else "MISMATCH"))
    return 0 if ok else 1
