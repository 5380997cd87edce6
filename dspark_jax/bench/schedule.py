"""`dspark bench schedule`: simulated throughput of the verification schedulers versus concurrency.

Nothing here runs a model; it asks how many tokens per second each verify-length policy would get from
a given step-cost curve and acceptance behaviour, so the schedulers can be compared (and regressions
seen) on a laptop.

Cost model (a staircase, like real accelerators with tiled matmuls and padded shape buckets): one verify
step over B batch tokens takes `t_fixed + t_tile * ceil(B / tile)` ms. The cost table samples it at the
first token count of every stair (1, tile + 1, 2 tile + 1, ...) up to max_batch_tokens = 256 (K + 1), so
the floor lookup of `CostTable` reproduces it exactly.

Acceptance traces (seeded numpy generator; document of record for what "true acceptance" means here):
request r in round t accepts draft k, given drafts 1..k-1 were accepted, with probability
    p_{r,t,k} = sigmoid(mu + u_r + s * d_{r,t} - decay * (k - 1) + e_{r,t,k})
with a per-request ease u_r ~ N(0, sigma_u^2) (some prompts are easier), a slowly varying difficulty
d_{r,t} (AR(1) over rounds with correlation rho, stationary N(0, 1)) and per-position noise
e ~ N(0, sigma_e^2). The draft's (calibrated but imperfect) confidence is
    c_{r,t,k} = sigmoid(logit p_{r,t,k} + n_{r,t,k}),  n ~ N(0, sigma_c^2).
The async scheduler's lagged confidences are the same request's c from two rounds earlier.

Throughput Theta = sum over rounds of expected emitted tokens / sum of step times, with the expectation
over acceptance taken exactly: a round emits R + sum_r sum_{j <= l_r} prod_{i <= j} p_{r,t,i} tokens in
expectation. Policies: static l (every request verifies l drafts, l = 0..K), sync (Algorithm 1 on c),
async (capacity from the lagged c, admission by the current c) and oracle (the per-round Theta-optimal
allocation when the true p is known: the global search of `schedule_async` fed p for both arguments;
it knows probabilities, not outcomes).

All concurrencies share one compiled shape: 256 slots, the ones beyond R marked inactive with
num_drafts = -1 (which is also a test of that path).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.errors import UserError
from dspark_jax.schedule import CostTable, schedule_async, schedule_sync
from dspark_jax.validation import check_int_flags, check_number_flags, check_output_flags, int_list_flag

SLOTS = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", "-K", type=int, default=5, help="drafts per round (K)")
    parser.add_argument("--rounds", type=int, default=200, help="simulated rounds per concurrency")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256",
                        help=f"comma-separated request counts, each in [1, {SLOTS}]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-gain", type=float, default=0.0, help="async minimum relative predicted gain")
    parser.add_argument("--t-fixed-ms", type=float, default=12.0, help="step time at any size (weights, launch)")
    parser.add_argument("--t-tile-ms", type=float, default=1.5, help="extra step time per tile of tokens")
    parser.add_argument("--tile", type=int, default=64, help="tokens per stair of the cost curve")
    parser.add_argument("--plot", default="bench_schedule.png", help="PNG to write ('' to skip)")


def staircase_table(k: int, t_fixed_ms: float, t_tile_ms: float, tile: int) -> CostTable:
    max_tokens = SLOTS * (k + 1)
    starts = np.arange(1, max_tokens + 1, tile)
    step_ms = t_fixed_ms + t_tile_ms * np.ceil(starts / tile)
    return CostTable(starts, 1000.0 / step_ms, max_batch_tokens=max_tokens)


def acceptance_traces(seed: int, rounds: int, k: int, mu=1.4, sigma_u=0.6, s=1.0, rho=0.8, decay=0.1,
                      sigma_e=0.7, sigma_c=0.5):
    """(p_true, conf), both f32[rounds + 2, SLOTS, K] conditional probabilities (model: module doc)."""
    rng = np.random.default_rng(seed)
    total = rounds + 2  # two warm-up rounds feed the async scheduler's lagged confidences
    ease = rng.normal(0.0, sigma_u, size=(SLOTS,))
    d = np.empty((total, SLOTS))
    d[0] = rng.normal(size=SLOTS)
    for t in range(1, total):
        d[t] = rho * d[t - 1] + np.sqrt(1 - rho**2) * rng.normal(size=SLOTS)
    logit = (mu + ease[None, :, None] + s * d[:, :, None] - decay * np.arange(k)[None, None, :]
             + rng.normal(0.0, sigma_e, size=(total, SLOTS, k)))
    p_true = 1.0 / (1.0 + np.exp(-logit))
    conf = 1.0 / (1.0 + np.exp(-(logit + rng.normal(0.0, sigma_c, size=logit.shape))))
    return p_true.astype(np.float32), conf.astype(np.float32)


def throughput(lengths, p_true, table: CostTable, active) -> float:
    """Expected tokens/s over all rounds: lengths i32[T, S], p_true f32[T, S, K], active bool[S]."""
    k = p_true.shape[-1]
    survival = np.cumprod(p_true.astype(np.float64), axis=-1)
    lengths = np.where(active[None, :], lengths, 0)
    verified = np.arange(1, k + 1)[None, None, :] <= lengths[:, :, None]
    tokens = active.sum() + np.sum(np.where(verified, survival, 0.0), axis=(1, 2))
    batch = active.sum() + lengths.sum(axis=1)
    sps = np.asarray(table.sps(jnp.asarray(batch)), np.float64)
    if np.any(sps <= 0):
        raise ValueError("a policy exceeded max_batch_tokens")
    return float(tokens.sum() / np.sum(1.0 / sps))


def simulate(args) -> tuple[list[int], dict[str, list[float]], dict[str, list[float]], CostTable]:
    k = args.block_size
    table = staircase_table(k, args.t_fixed_ms, args.t_tile_ms, args.tile)
    p_true, conf = acceptance_traces(args.seed, args.rounds, k)
    now, lagged, truth = conf[2:], conf[:-2], p_true[2:]

    rounds_sync = jax.jit(jax.vmap(schedule_sync, in_axes=(0, None, None)))
    rounds_async = jax.jit(jax.vmap(schedule_async, in_axes=(0, 0, None, None, None)))

    levels = [int(x) for x in args.concurrency.split(",")]
    names = [f"static {l}" for l in range(k + 1)] + ["sync", "async", "oracle"]
    theta = {name: [] for name in names}
    mean_len = {name: [] for name in ("sync", "async", "oracle")}
    for r in levels:
        active = np.arange(SLOTS) < r
        num_drafts = jnp.asarray(np.where(active, k, -1), jnp.int32)
        for l in range(k + 1):
            theta[f"static {l}"].append(throughput(np.full((args.rounds, SLOTS), l), truth, table, active))
        policies = {
            "sync": rounds_sync(jnp.asarray(now), table, num_drafts),
            "async": rounds_async(jnp.asarray(now), jnp.asarray(lagged), table, args.min_gain, num_drafts),
            "oracle": rounds_async(jnp.asarray(truth), jnp.asarray(truth), table, 0.0, num_drafts),
        }
        for name, lengths in policies.items():
            lengths = np.asarray(lengths)
            theta[name].append(throughput(lengths, truth, table, active))
            mean_len[name].append(float(lengths[:, active].mean()))
    return levels, theta, mean_len, table


def plot(path: str, levels, theta, k: int) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(fig)
    ax_abs, ax_rel = fig.subplots(1, 2)
    best_static = np.max([theta[f"static {l}"] for l in range(k + 1)], axis=0)
    shades = np.linspace(0.8, 0.35, k + 1)
    for l in range(k + 1):
        for ax, y in ((ax_abs, theta[f"static {l}"]), (ax_rel, np.asarray(theta[f"static {l}"]) / best_static)):
            ax.plot(levels, y, "--", color=str(shades[l]), lw=1, label=f"static l={l}")
    for name, style in (("sync", "o-"), ("async", "s-"), ("oracle", "^:")):
        ax_abs.plot(levels, theta[name], style, ms=4, label=name)
        ax_rel.plot(levels, np.asarray(theta[name]) / best_static, style, ms=4, label=name)
    for ax in (ax_abs, ax_rel):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests per step)")
        ax.grid(alpha=0.3)
    ax_abs.set_yscale("log")
    ax_abs.set_ylabel("Theta (expected tokens / s)")
    ax_rel.set_ylabel("Theta / best static length at that concurrency")
    ax_abs.legend(fontsize=7, ncol=2)
    fig.suptitle(f"Verification schedulers, K = {k}, staircase cost table (simulation)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    k = args.block_size
    check_int_flags(args, "block_size", "rounds", "tile")
    check_int_flags(args, "seed", minimum=0)
    check_number_flags(args, "min_gain", "t_tile_ms")
    check_number_flags(args, "t_fixed_ms", above=True)  # 0 with --t-tile-ms 0 is a step of no time
    check_output_flags(args, "plot")
    if any(r > SLOTS for r in int_list_flag(args, "concurrency")):
        raise UserError(f"--concurrency: expected integers in [1, {SLOTS}], got {args.concurrency!r}")
    start = time.perf_counter()
    levels, theta, mean_len, table = simulate(args)
    elapsed = time.perf_counter() - start

    print(f"schedule simulation: K={k}, {args.rounds} rounds, seed {args.seed}; step = {args.t_fixed_ms} ms + "
          f"{args.t_tile_ms} ms per {args.tile} tokens; max_batch_tokens {int(table.max_batch_tokens)}")
    print("Theta = expected tokens/s (higher is better); mean l = average verify length of the active requests")
    cols = [f"static {l}" for l in range(k + 1)] + ["sync", "async", "oracle"]
    header = f"{'R':>4} " + " ".join(f"{c.replace('static ', 'l='):>8}" for c in cols)
    header += f" {'mean l sync/async/oracle':>26}"
    print(header)
    for i, r in enumerate(levels):
        row = f"{r:>4} " + " ".join(f"{theta[c][i]:>8.0f}" for c in cols)
        row += f" {mean_len['sync'][i]:>8.2f} {mean_len['async'][i]:>8.2f} {mean_len['oracle'][i]:>8.2f}"
        print(row)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(args.plot, levels, theta, k)
        print(f"wrote {args.plot}")
    print(f"simulated in {elapsed:.1f} s")
    return 0
