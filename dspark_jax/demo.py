"""`dspark demo`: speculative generation with the embedded default model, measured against plain decoding.

The embedded default (dspark_jax/assets/default/) is a small V4.1-style mHC backbone trained on the
Python standard library's sources and its block-7 DSpark draft (Markov head, STS-calibrated confidence
head). The demo continues held-out functions (stdlib files neither model saw) twice with the same
requests, once with plain autoregressive decoding (engine mode "plain") and once speculatively (mode
"off": every draft verified, or "fixed" with --num-verify), greedy and at T = 1, and prints:
  * tau (tokens per round) and the per-position conditional acceptance of the speculative run;
  * tokens/s of both runs and the speedup (each timed after a compile warm-up on the same prompts);
  * for greedy, whether the speculative output equals plain decoding token for token (it must);
  * one generated continuation as text;
and writes a PNG (acceptance bars + tokens/s) to --plot (default ./dspark_demo.png).

Without the embedded model it says so; --random-tiny runs the same plumbing on random tiny weights.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", default=None, help="bundle folder (default: the embedded default model)")
    parser.add_argument("--random-tiny", action="store_true",
                        help="random weights on the tiny configs (plumbing only: acceptance and text are meaningless)")
    parser.add_argument("--prompts-file", default=None, help="prompts JSONL (default: the bundle's prompts.jsonl)")
    parser.add_argument("--prompts", type=int, default=8, help="how many prompts (= engine slots)")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens generated per prompt")
    parser.add_argument("--max-len", type=int, default=384, help="cache length per slot")
    parser.add_argument("--mode", default="off", choices=("off", "fixed"),
                        help="speculative mode: off = verify every draft, fixed = verify --num-verify")
    parser.add_argument("--num-verify", type=int, default=None)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--plot", default="dspark_demo.png", help="PNG to write (acceptance and tokens/s)")
    parser.add_argument("--impl", default="auto", choices=("auto", "pallas", "xla"))
    parser.add_argument("--no-progress", action="store_true")


def _load(args):
    from dspark_jax.bench.acceptance import default_dir, missing_default_message
    from dspark_jax.bundle import load_bundle, random_bundle

    if args.random_tiny:
        configs = Path(__file__).resolve().parents[1] / "configs"
        print("NOTE: --random-tiny: random weights on the tiny configs; acceptance, speed-up and text are "
              "meaningless (a plumbing check).")
        return random_bundle(configs / "tiny_mhc_backbone.json", configs / "tiny_v41.json"), None
    path = args.bundle or default_dir()
    if path is None:
        print(missing_default_message("dspark demo"), file=sys.stderr)
        return None, None
    return load_bundle(path, impl=args.impl), Path(path)


def _prompts(args, bundle, path):
    from dspark_jax.bench.acceptance import read_prompts

    if args.random_tiny:
        rng = np.random.default_rng(0)
        v = bundle.model.backbone.vocab_size
        return [{"id": i, "tokens": rng.integers(0, v, size=24).tolist()} for i in range(args.prompts)]
    file = Path(args.prompts_file) if args.prompts_file else path / "prompts.jsonl"
    return read_prompts(file, args.prompts)


def run(args: argparse.Namespace) -> int:
    from dspark_jax.bench.acceptance import fmt_acc, make_requests, timed_generate
    from dspark_jax.serve.engine import Engine, EngineConfig

    t_start = time.perf_counter()
    bundle, path = _load(args)
    if bundle is None:
        return 1
    prompts = _prompts(args, bundle, path)
    model, weights = bundle.model, bundle.weights
    k = model.block_size
    slots = len(prompts)
    where = "random tiny weights" if args.random_tiny else str(path)
    cal = "STS-calibrated" if bundle.calibration is not None else "uncalibrated"
    print(f"model: {where}\n  backbone {bundle.backbone_family} dim {model.backbone.dim}, {model.backbone.n_layers} "
          f"layers, vocab {model.backbone.vocab_size}; draft block {k}, Markov rank {model.cfg.markov_rank}, "
          f"{cal} confidence")
    print(f"{len(prompts)} held-out prompts x {args.max_tokens} tokens, {slots} slots; speculative mode "
          f"'{args.mode}'" + (f" (verify {args.num_verify})" if args.mode == "fixed" else " (every draft verified)"),
          flush=True)

    progress = not args.no_progress
    spec = Engine(model, weights, EngineConfig(max_slots=slots, max_len=args.max_len, mode=args.mode,
                                               num_verify=args.num_verify, progress=progress))
    plain = Engine(model, weights, EngineConfig(max_slots=slots, max_len=args.max_len, mode="plain",
                                                progress=progress))
    runs = []
    samples = []
    for temp in args.temperatures:
        reqs = make_requests(prompts, bundle.tokenizer, max_tokens=args.max_tokens, temperature=temp)
        res_p, m_p = timed_generate(plain, reqs)
        res_s, m_s = timed_generate(spec, reqs)
        same = None
        if temp == 0.0:
            same = all(a.tokens == b.tokens for a, b in zip(res_p, res_s))
        samples.append((temp, reqs[0], res_s[0]))
        runs.append({"T": temp, "plain": m_p, "spec": m_s, "same": same})

    print()
    print(f"{'T':>3s} {'decoding':12s} {'tokens':>6s} {'seconds':>8s} {'tok/s':>7s} {'tau':>6s} {'speedup':>8s}")
    for r in runs:
        mp, ms = r["plain"], r["spec"]
        speed = ms.tokens_per_s / mp.tokens_per_s if mp.tokens_per_s else float("nan")
        print(f"{r['T']:>3g} {'plain':12s} {mp.emitted:6d} {mp.wall_s:8.2f} {mp.tokens_per_s:7.1f} {1.0:6.3f} "
              f"{'1.00x':>8s}")
        print(f"{r['T']:>3g} {'speculative':12s} {ms.emitted:6d} {ms.wall_s:8.2f} {ms.tokens_per_s:7.1f} "
              f"{ms.tau:6.3f} {speed:7.2f}x")
    print()
    print("per-position conditional acceptance P(accept k | 1..k-1 accepted):")
    print("      " + " ".join(f"  k={i + 1}" for i in range(k)))
    for r in runs:
        print(f"T={r['T']:<3g} " + fmt_acc([None if np.isnan(a) else float(a) for a in r["spec"].acceptance], k))
    for r in runs:
        if r["same"] is not None:
            verdict = "identical" if r["same"] else "DIFFERENT (a bug: greedy speculative decoding must be lossless)"
            print(f"greedy check: speculative output vs plain decoding, token for token: {verdict}")

    if samples and bundle.tokenizer is not None:
        req = samples[0][1]
        prompt_text = bundle.tokenizer.decode(list(req.prompt))
        tail = "\n".join(prompt_text.splitlines()[-6:])
        print(f"\nsample: prompt {req.id} (held-out; last lines), then each run's speculative continuation\n"
              f"{'-' * 72}\n{tail}")
        for temp, _, res in samples:
            label = "greedy" if temp == 0.0 else f"T = {temp:g}"
            print(f"{'-' * 30} {label:^10s} {'-' * 30}\n{bundle.tokenizer.decode(res.tokens)}")
        print("-" * 72)

    if args.plot:
        _plot(runs, k, args.plot)
        print(f"plot: {Path(args.plot).resolve()}")
    print(f"demo finished in {time.perf_counter() - t_start:.0f} s")
    return 0


def _plot(runs, k, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(runs), 1)
    for i, r in enumerate(runs):
        xs = np.arange(1, k + 1) + (i - (len(runs) - 1) / 2) * width
        ax1.bar(xs, r["spec"].acceptance, width, label=f"T = {r['T']:g} (tau {r['spec'].tau:.2f})")
    ax1.set_xticks(np.arange(1, k + 1))
    ax1.set_xlim(0.4, k + 0.6)
    ax1.set_xlabel("draft position k")
    ax1.set_ylabel("P(accept k | 1..k-1 accepted)")
    ax1.set_ylim(0, 1)
    ax1.set_title("DSpark per-position acceptance")
    ax1.legend()
    labels = [f"T = {r['T']:g}" for r in runs]
    xs = np.arange(len(runs))
    ax2.bar(xs - 0.2, [r["plain"].tokens_per_s for r in runs], 0.4, label="plain decoding")
    ax2.bar(xs + 0.2, [r["spec"].tokens_per_s for r in runs], 0.4, label="DSpark speculative")
    for x, r in zip(xs, runs):
        sp = r["spec"].tokens_per_s / max(r["plain"].tokens_per_s, 1e-9)
        ax2.text(x + 0.2, r["spec"].tokens_per_s, f"{sp:.2f}x", ha="center", va="bottom")
    ax2.set_xticks(xs, labels)
    ax2.set_ylabel("tokens / s (this machine, this run)")
    ax2.set_title("throughput, same requests")
    ax2.set_ylim(0, 1.25 * max(max(r["plain"].tokens_per_s, r["spec"].tokens_per_s) for r in runs))
    ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
