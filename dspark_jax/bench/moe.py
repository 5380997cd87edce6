"""`dspark bench moe`: wall clock of a many-expert V4.1 draft on this machine, the all-experts MoE against
the routed one, side by side in one run (issue 38, deliverable 6).

The draft is `configs/tiny_v41.json` widened to `--dim` / `--inter` with `--experts` experts, top
`--top-k` (defaults: 512 wide, 64 experts top-3, f32: a size a 2-core CPU runs in milliseconds). Its MoE
is switched by the config's `moe_routing`: "dense" (every expert on every token, what the draft ran
before issue 38) or "routed" (only the routed pairs: gathered for a propose, expert tiles with their own
backward pass for training). Programs, the same ones `dspark bench roofline` measures at real size:
  propose/B   one `propose` for B requests (greedy)
  train       one training step (`train.trainer.draft_loss`, its gradient, clip + AdamW) on
              --train-seqs x --train-len tokens with --anchors anchors per sequence
Each program is compiled for both routings and run --warmup times; then the two are timed in turns,
--repeats calls each, and the table gives the median and best milliseconds, dense / routed, and the
number of compiles during the timed calls (expected 0: a compile would be timed as work).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Callable

from dspark_jax.validation import check_int_flags

# jax and the models are imported inside run(): `dspark bench moe --help` answers without them.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--experts", type=int, default=64, help="routed experts E")
    parser.add_argument("--top-k", type=int, default=3, help="experts per token k")
    parser.add_argument("--dim", type=int, default=512, help="model width")
    parser.add_argument("--inter", type=int, default=256, help="expert hidden width")
    parser.add_argument("--batches", default="1,8", help="comma-separated propose batch sizes")
    parser.add_argument("--train-seqs", type=int, default=4)
    parser.add_argument("--train-len", type=int, default=128)
    parser.add_argument("--anchors", type=int, default=16, help="training anchors per sequence")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per program and routing")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls after the compile")


@dataclasses.dataclass
class Timed:
    """A compiled program of one routing and the real arguments it runs on."""

    call: Callable
    args: tuple
    times: list[float] = dataclasses.field(default_factory=list)


def draft_config(args: argparse.Namespace, routing: str):
    from dspark_jax import configs  # noqa: PLC0415
    from dspark_jax.drafts.v41.config import DSparkConfig  # noqa: PLC0415

    return DSparkConfig.from_json(configs.path("tiny_v41.json")).replace(
        dim=args.dim, moe_inter_dim=args.inter, n_routed_experts=args.experts, n_activated_experts=args.top_k,
        moe_routing=routing)


def _random_like(abstract, key, scale: float = 0.05):
    """Real arrays of the abstract tree: small normals for floats, zeros for everything else."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    leaves, tree = jax.tree.flatten(abstract)
    keys = jax.random.split(key, len(leaves))
    out = [(jax.random.normal(k, x.shape, jnp.float32) * scale).astype(x.dtype)
           if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros(x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(tree, out)


def propose_args(program, cfg, rows: int, key):
    """(draft, tied, state, anchor, greedy sampling params, seeds) as arrays."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from dspark_jax import drafts, sampling  # noqa: PLC0415

    k1, k2, k3 = jax.random.split(key, 3)
    draft, tied = _random_like(program.args[0], k1), _random_like(program.args[1], k2)
    params = sampling.SamplingParams.greedy(rows)
    anchor = jax.random.randint(k3, (rows,), 0, cfg.vocab_size, jnp.int32)
    return draft, tied, drafts.init_state(cfg, rows), anchor, params, jnp.arange(rows, dtype=jnp.uint32)


def train_args(program, cfg, seqs: int, seq_len: int, anchors: int, key):
    """(params, opt_state, tied, taps, teacher logits, batch, normalizer) as arrays: every position
    supervised, anchors spread over the sequence."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    params_a, opt_a, tied_a, taps_a, teacher_a, _, _ = program.args
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    last = seq_len - cfg.block_size - 1
    batch = {"tokens": jax.random.randint(k4, (seqs, seq_len), 0, cfg.vocab_size, jnp.int32),
             "loss_mask": jnp.ones((seqs, seq_len), bool),
             "anchors": jnp.sort(jax.random.randint(k5, (seqs, anchors), 0, last, jnp.int32), axis=-1),
             "anchor_valid": jnp.ones((seqs, anchors), bool)}
    opt_state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), opt_a)
    return (_random_like(params_a, k1), opt_state, _random_like(tied_a, k2), _random_like(taps_a, k3, 1.0),
            _random_like(teacher_a, k3, 2.0), batch, jnp.float32(seqs * anchors * cfg.block_size))


def build(args: argparse.Namespace, name: str, routing: str) -> Timed:
    import jax  # noqa: PLC0415

    from dspark_jax.bench import roofline  # noqa: PLC0415

    cfg, key = draft_config(args, routing), jax.random.key(0)  # the same arrays for both routings
    if name == "train":
        program = roofline.train_program(cfg, seqs=args.train_seqs, seq_len=args.train_len, anchors=args.anchors)
        real = train_args(program, cfg, args.train_seqs, args.train_len, args.anchors, key)
    else:
        rows = int(name.split("/")[1])
        program = roofline.propose_program(rows, "bf16", cfg)
        real = propose_args(program, cfg, rows, key)
    call = jax.jit(program.fn).lower(*real).compile()  # no donation: the same arrays serve every call
    return Timed(call, real)


def _run_once(timed: Timed) -> float:
    import jax  # noqa: PLC0415

    t0 = time.perf_counter()
    jax.block_until_ready(timed.call(*timed.args))
    return (time.perf_counter() - t0) * 1e3


def measure(args: argparse.Namespace, name: str) -> dict:
    """Both routings of program `name`, warmed up, then timed in turns; compiles counted while timed."""
    from dspark_jax.serve.compiling import count_compiles  # noqa: PLC0415

    pair = {routing: build(args, name, routing) for routing in ("dense", "routed")}
    for timed in pair.values():
        for _ in range(args.warmup):
            _run_once(timed)
    with count_compiles() as compiles:
        for _ in range(args.repeats):
            for timed in pair.values():
                timed.times.append(_run_once(timed))
    row = {"program": name, "compiles": compiles["n"]}
    for routing, timed in pair.items():
        row[routing] = {"median_ms": statistics.median(timed.times), "best_ms": min(timed.times)}
    row["speedup"] = row["dense"]["median_ms"] / row["routed"]["median_ms"]
    return row


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"V4.1 draft (tiny_v41 shape), D {args.dim}, expert width {args.inter}, {args.experts} experts top-"
          f"{args.top_k}; median (best) ms of {args.repeats} calls each, taken in turns")
    print(f"{'program':<12}{'all experts':>18}{'routed':>18}{'speedup':>9}{'compiles':>10}")
    for r in rows:
        cell = lambda d: f"{d['median_ms']:.2f} ({d['best_ms']:.2f})"  # noqa: E731
        print(f"{r['program']:<12}{cell(r['dense']):>18}{cell(r['routed']):>18}{r['speedup']:>8.2f}x"
              f"{r['compiles']:>10}")


def run(args: argparse.Namespace) -> int:
    check_int_flags(args, "experts", "top_k", "dim", "inter", "train_seqs", "train_len", "anchors", "repeats",
                    minimum=1)
    check_int_flags(args, "warmup", minimum=0)
    from dspark_jax.errors import UserError  # noqa: PLC0415

    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        raise UserError(f"--batches: expected comma-separated integers, got {args.batches!r}") from None
    if not batches or min(batches) < 1:
        raise UserError(f"--batches: expected positive batch sizes, got {args.batches!r}")
    if args.top_k > args.experts:
        raise UserError(f"--top-k {args.top_k}: at most --experts ({args.experts})")
    if args.train_len <= draft_config(args, "auto").block_size + 1:
        raise UserError(f"--train-len {args.train_len}: longer than a draft block plus one")
    from tqdm.auto import tqdm  # noqa: PLC0415

    names = [f"propose/{b}" for b in batches] + ["train"]
    rows = [measure(args, name) for name in tqdm(names, desc="dspark bench moe", unit="program")]
    print_table(rows, args)
    return 0
