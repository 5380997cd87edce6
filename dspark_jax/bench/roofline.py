"""`dspark bench roofline`: at REAL sizes, how much work do our programs do against the work they need? (issue 38)

Nothing that big runs: each program is lowered from abstract shapes (`jax.ShapeDtypeStruct`) and compiled
by this host's XLA:CPU with the TPU / GPU branches of our code (`nn.platform.accelerator_branches`: bf16
dots accumulating in f32, grouped matmuls for the MoE), and the compiled HLO is measured by
`bench.hlo_cost` (matmul flops and bytes moved, every loop body times its trip count; XLA's own
`cost_analysis` counts a loop body once). Against each program's analytic minimum:
  flops: 2 x the matrix parameters each token passes through x tokens, plus attention over the FILLED
         keys (training: 6x for the trained weights, 4x for the frozen head);
  bytes: the weights that must be read at their stored precision (dense parts, the head once, at most
         min(E, tokens x k) experts per MoE block), the filled KV, the inputs read and the outputs written.
The table gives both ratios (targets: flops <= 1.5x, bytes <= 2x, 3x with packed weights) and the source
functions that hold most of the flops and bytes.

Programs (`--programs`, default all):
  moe/N/{dense,routed}   one V4.1-Flash MoE block (5120 wide, 128 experts top-3, 1 shared) on N tokens
  propose/B/{bf16,packed} the V4.1-Flash draft's `propose` for B requests, weights bf16 or at checkpoint
                          precision (fp8 dense, fp4 experts: `load_v41_draft(weights="packed")`)
  qwen3_8b/{decode,verify6} a Qwen3-8B-shaped backbone forward, B = 8 rows of 1 / 6 tokens, a cache of
                          4096 slots of which 512 are filled (the minimum reads only the filled part)
  train/flash[/dense]     one training step of the V4.1-Flash draft (the trainer's loss, gradient and AdamW
                          update) on 4 sequences x 256 tokens with 32 anchors (640 query tokens), from the
                          backbone's taps and logits (the backbone's own forward is not part of it); /dense:
                          with the all-experts MoE (the draft's `moe_routing`), as before issue 38

These are XLA:CPU compiles: bytes include what the CPU compiler adds (e.g. f32 copies where the CPU has no
bf16 kernel), which a TPU compile would not; a figure to read with the sources column beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Callable

from dspark_jax import output_files
from dspark_jax.errors import UserError
from dspark_jax.validation import check_output_flags

# jax, the models and hlo_cost's users are imported inside the functions that run the benchmark, so
# `dspark bench roofline --help` answers without importing jax.

MOE_TOKENS = (5, 40, 320)
PROPOSE_BATCHES = (1, 8, 64)
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                max_position_embeddings=40960, param_dtype="bfloat16", compute_dtype="bfloat16")
QWEN3_SLOTS, QWEN3_MAX_LEN, QWEN3_FILLED = 8, 4096, 512
TRAIN_BATCH, TRAIN_SEQ, TRAIN_ANCHORS = 4, 256, 32
# Source functions every dot or cast passes through: the work is credited to their callers.
GENERIC_HELPERS = ("dspark_jax/nn/linear.py:mixed_einsum", "dspark_jax/nn/rounding.py:", "dspark_jax/nn/platform.py:",
                   "dspark_jax/nn/packed.py:as_compute")


@dataclasses.dataclass(frozen=True)
class Program:
    """One program to compile: `fn(*args)` jitted with `donate` (what the engine donates), and its
    analytic minimum work."""

    name: str
    fn: Callable
    args: tuple
    min_flops: float
    min_bytes: float
    donate: tuple[int, ...] = ()
    packed: bool = False  # weights at checkpoint precision: the bytes target is 3x, not 2x


def default_programs() -> list[str]:
    return ([f"moe/{n}/{r}" for n in MOE_TOKENS for r in ("dense", "routed")]
            + [f"propose/{b}/{w}" for b in PROPOSE_BATCHES for w in ("bf16", "packed")]
            + ["qwen3_8b/decode", "qwen3_8b/verify6", "train/flash", "train/flash/dense"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--programs", default=",".join(default_programs()),
                        help="comma-separated program names (see the module help); default all")
    parser.add_argument("--top", type=int, default=2, help="source functions named per program")
    parser.add_argument("--json", type=Path, default=None, help="also write every row as JSON here")


# ---- analytic minima (pure arithmetic on shapes) -------------------------------------------------------

def array_bytes(tree) -> int:
    """Bytes of every array leaf (ShapeDtypeStructs and packed nodes included): `nn.packed.nbytes`,
    imported here because it imports jax."""
    from dspark_jax.nn.packed import nbytes  # noqa: PLC0415

    return nbytes(tree)


def matrix_params(tree) -> int:
    """Elements of every leaf with two or more dims (the ones a token multiplies through)."""
    import jax  # noqa: PLC0415

    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree) if len(x.shape) >= 2)


def moe_minimum(params: dict, tokens: int, top_k: int, io_bytes: int) -> tuple[float, float]:
    """(flops, bytes) of one MoE block on `tokens` tokens: the gate and the shared expert for every token,
    `top_k` routed experts per token, each expert read at most once (min(E, tokens x k) of them)."""
    experts = params["experts"]
    n_experts = _leading(experts)
    per_expert_params = matrix_params(experts) / n_experts
    other = {k: v for k, v in params.items() if k != "experts"}
    flops = 2 * tokens * (matrix_params(other) + top_k * per_expert_params)
    read = array_bytes(other) + min(n_experts, tokens * top_k) * array_bytes(experts) / n_experts
    return flops, read + io_bytes


def _leading(tree) -> int:
    import jax  # noqa: PLC0415

    return jax.tree.leaves(tree)[0].shape[0]


def propose_minimum(draft: dict, tied: dict, cfg, rows: int, io_bytes: int) -> tuple[float, float]:
    """(flops, bytes) of one propose of `rows` requests: every block position (B x K tokens) through the
    draft's blocks (their MoE at top-k), the tied head and the Markov head; attention over the ring's
    `window` keys plus the block; the head, each block's dense weights and at most min(E, tokens x k)
    experts per block read once; embedding rows only for the block's tokens."""
    tokens = rows * cfg.block_size
    flops, read = 0.0, 0.0
    for name, block in draft.items():
        if not name.startswith("blocks_"):
            continue
        moe_flops, moe_bytes = moe_minimum(block["ffn"], tokens, cfg.n_activated_experts, 0)
        rest = {k: v for k, v in block.items() if k != "ffn"}
        flops += moe_flops + 2 * tokens * matrix_params(rest)
        flops += 4 * tokens * cfg.n_heads * cfg.head_dim * (cfg.window + cfg.block_size)  # q.k and p.v
        read += moe_bytes + array_bytes(rest)
    head, markov = tied["head"], draft.get("markov", {})
    flops += 2 * tokens * (math.prod(head.shape) + (math.prod(markov["head"].shape) if markov else 0))
    read += array_bytes(head) + (array_bytes(markov["head"]) if markov else 0)
    read += array_bytes({k: v for k, v in draft.items() if not k.startswith("blocks_") and k != "markov"})
    read += tokens * (head.shape[1] * head.dtype.itemsize)  # the block's embedding rows
    return flops, read + io_bytes


def decode_minimum(cfg, rows: int, new: int, filled: int, param_bytes: int, embed_bytes: int,
                   io_bytes: int) -> tuple[float, float]:
    """(flops, bytes) of a Qwen3 forward of `new` tokens for `rows` rows over a cache holding `filled`
    positions: every matrix once per token, attention over filled + new keys, the weights read once
    (the embedding table only for the rows looked up), the filled K/V read and the new K/V written."""
    c = cfg
    layer = (c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
             + 3 * c.hidden_size * c.intermediate_size)
    tokens = rows * new
    flops = 2 * tokens * (c.num_hidden_layers * layer + c.vocab_size * c.hidden_size)
    flops += c.num_hidden_layers * 4 * tokens * c.num_attention_heads * c.head_dim * (filled + new)
    kv_row = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2  # bf16 K and V, every layer
    read = param_bytes - embed_bytes + tokens * c.hidden_size * 2 + rows * filled * kv_row + tokens * kv_row
    return flops, read + io_bytes


def train_minimum(draft: dict, tied: dict, cfg, seqs: int, seq_len: int, anchors: int, opt_bytes: int,
                  io_bytes: int) -> tuple[float, float]:
    """(flops, bytes) of one draft training step: the context rows (main_proj and each block's KV
    projection) for every position, the block body for the seqs x anchors x K query tokens (MoE at top-k),
    each 6x (forward + both backward products); the frozen tied head 4x (forward + the input's gradient),
    the trained Markov head 6x; attention over window + K keys, 3x. Bytes: every weight read once and
    written once, the optimizer state read and written once, the taps read, only the teacher-logit rows
    the loss scores, the embedding rows of the query tokens."""
    context, query = seqs * seq_len, seqs * anchors * cfg.block_size
    kv_proj = sum(matrix_params(b["attn"]["wkv"]) for n, b in draft.items() if n.startswith("blocks_"))
    flops = 6 * context * (matrix_params(draft["main_proj"]) + kv_proj)
    for name, block in draft.items():
        if name.startswith("blocks_"):
            moe_flops, _ = moe_minimum(block["ffn"], query, cfg.n_activated_experts, 0)
            rest = {k: v for k, v in block.items() if k != "ffn"}
            flops += 3 * moe_flops + 6 * query * matrix_params(rest)
            flops += 3 * 4 * query * cfg.n_heads * cfg.head_dim * (cfg.window + cfg.block_size)
    head, markov = tied["head"], draft.get("markov", {})
    flops += 4 * query * math.prod(head.shape) + (6 * query * math.prod(markov["head"].shape) if markov else 0)
    weights = array_bytes(draft)
    read = 2 * weights + 2 * opt_bytes + array_bytes(head) + query * (head.shape[1] + 1) * head.dtype.itemsize
    read += query * cfg.vocab_size * 4  # the teacher's f32 logits at the scored positions
    return flops, read + io_bytes


# ---- the programs --------------------------------------------------------------------------------------

def _sds(shape, dtype):
    import jax  # noqa: PLC0415

    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _io_bytes(fn, args, skip_args: int = 0) -> int:
    """Bytes of the non-weight inputs (args from `skip_args` on) and of the outputs."""
    import jax  # noqa: PLC0415

    return array_bytes(args[skip_args:]) + array_bytes(jax.eval_shape(fn, *args))


def moe_program(tokens: int, routing: str, cfg=None) -> Program:
    """One MoE block of `cfg` (default: the V4.1-Flash draft's) on `tokens` tokens, bf16."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from dspark_jax.lowering import flash_config  # noqa: PLC0415
    from dspark_jax.nn.moe import MoE  # noqa: PLC0415

    cfg = cfg or flash_config()
    block = MoE(dim=cfg.dim, n_experts=cfg.n_routed_experts, top_k=cfg.n_activated_experts,
                inter_dim=cfg.moe_inter_dim, n_shared=cfg.n_shared_experts, route_scale=cfg.route_scale,
                score_func=cfg.score_func, norm_topk_prob=cfg.norm_topk_prob, swiglu_limit=cfg.swiglu_limit,
                param_dtype="bfloat16", compute_dtype="bfloat16", routing=routing)
    x = _sds((tokens, cfg.dim), jnp.bfloat16)
    params = jax.eval_shape(block.init, jax.random.key(0), x)["params"]

    def fn(params, x):
        return block.apply({"params": params}, x)

    flops, nbytes = moe_minimum(params, tokens, cfg.n_activated_experts, _io_bytes(fn, (params, x), 1))
    return Program(f"moe/{tokens}/{routing}", fn, (params, x), flops, nbytes)


def propose_program(rows: int, weights: str, cfg=None) -> Program:
    """`propose` of the draft of `cfg` (default: the V4.1-Flash draft's) for `rows` requests."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from dspark_jax import drafts, lowering, sampling  # noqa: PLC0415
    from dspark_jax.checkpoint import v41  # noqa: PLC0415

    cfg = cfg or lowering.flash_config()
    draft = v41.abstract_packed_params(cfg) if weights == "packed" else None
    pair = lowering.flash_pair("xla", cfg=cfg, draft_params=draft, slots=rows)
    state = jax.eval_shape(lambda: drafts.init_state(cfg, rows))

    params = sampling.SamplingParams(_sds((rows,), jnp.float32), _sds((rows,), jnp.int32), _sds((rows,), jnp.float32),
                                     _sds((rows,), jnp.bool_))
    args = (pair.weights.draft, pair.weights.tied, state, _sds((rows,), jnp.int32), params,
            _sds((rows,), jnp.uint32))

    def fn(draft, tied, state, anchor, params, seeds):
        return drafts.propose(draft, tied, cfg, state, anchor, params, seeds, impl="xla", filtering=False)

    io = _io_bytes(fn, args, 2)
    # The flops of the matrices as used (bf16 shapes); the bytes of the weights as stored (packed or not).
    flops, _ = propose_minimum(drafts.abstract_params(cfg), pair.weights.tied, cfg, rows, io)
    _, nbytes = propose_minimum(pair.weights.draft, pair.weights.tied, cfg, rows, io)
    return Program(f"propose/{rows}/{weights}", fn, args, flops, nbytes, packed=weights == "packed")


def qwen3_program(new: int) -> Program:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from dspark_jax.backbones.qwen3 import Qwen3Backbone, Qwen3Cache, Qwen3Config  # noqa: PLC0415

    cfg = Qwen3Config(**QWEN3_8B)
    bb = Qwen3Backbone(cfg)
    params = bb.abstract_params()
    kv = _sds((cfg.num_hidden_layers, QWEN3_SLOTS, QWEN3_MAX_LEN, cfg.num_key_value_heads, cfg.head_dim),
              jnp.bfloat16)
    cache = Qwen3Cache(_sds((QWEN3_SLOTS,), jnp.int32), kv, kv)
    tokens = _sds((QWEN3_SLOTS, new), jnp.int32)

    def fn(params, cache, tokens):
        out = bb.forward(params, cache, tokens)
        return out.logits, out.cache

    logits = jax.eval_shape(fn, params, cache, tokens)[0]
    io = array_bytes(tokens) + array_bytes(logits) + QWEN3_SLOTS * 4
    flops, nbytes = decode_minimum(cfg, QWEN3_SLOTS, new, QWEN3_FILLED, array_bytes(params),
                                   array_bytes(params["embed"]), io)
    name = "qwen3_8b/decode" if new == 1 else f"qwen3_8b/verify{new}"
    return Program(name, fn, (params, cache, tokens), flops, nbytes, donate=(1,))


def train_program(cfg=None, seqs: int = TRAIN_BATCH, seq_len: int = TRAIN_SEQ, anchors: int = TRAIN_ANCHORS,
                  name: str = "train/flash") -> Program:
    """One step of `train.trainer` on the draft of `cfg` (default: the V4.1-Flash draft's) without the
    backbone's forward: `draft_loss` from given taps and teacher logits, its gradient, the trainer's
    optimizer (clip + AdamW) applied."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415

    from dspark_jax import drafts, lowering  # noqa: PLC0415
    from dspark_jax.train.config import LossConfig, OptimConfig  # noqa: PLC0415
    from dspark_jax.train.trainer import draft_loss, make_optimizer  # noqa: PLC0415

    cfg = cfg or lowering.flash_config()
    b, t, n = seqs, seq_len, anchors
    tx = make_optimizer(OptimConfig(), steps=1000)
    params = drafts.abstract_params(cfg)
    opt_state = jax.eval_shape(tx.init, params)
    tied = lowering.flash_pair("xla", cfg=cfg, slots=1).weights.tied
    taps = _sds((b, t, cfg.main_hidden_dim), jnp.bfloat16)
    teacher = _sds((b, t, cfg.vocab_size), jnp.float32)
    mb = {"tokens": _sds((b, t), jnp.int32), "loss_mask": _sds((b, t), jnp.bool_),
          "anchors": _sds((b, n), jnp.int32), "anchor_valid": _sds((b, n), jnp.bool_)}
    args = (params, opt_state, tied, taps, teacher, mb, _sds((), jnp.float32))

    def fn(params, opt_state, tied, taps, teacher, mb, normalizer):
        (loss, _), grads = jax.value_and_grad(
            lambda p: draft_loss(p, tied, cfg, LossConfig(), taps, teacher, mb, normalizer), has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_bytes = array_bytes(opt_state)
    io = array_bytes((taps, mb)) + 8  # the taps and the batch read, the loss written (teacher rows: below)
    flops, nbytes = train_minimum(params, tied, cfg, b, t, n, opt_bytes, io)
    return Program(name, fn, args, flops, nbytes, donate=(0, 1))


def build(name: str) -> Program:
    """The program `name` (see the module help)."""
    parts = name.split("/")
    try:
        if parts[0] == "moe" and len(parts) == 3 and parts[2] in ("dense", "routed"):
            return moe_program(int(parts[1]), parts[2])
        if parts[0] == "propose" and len(parts) == 3 and parts[2] in ("bf16", "packed"):
            return propose_program(int(parts[1]), parts[2])
        if name in ("train/flash", "train/flash/dense"):  # dense: the all-experts MoE, as before issue 38
            from dspark_jax.lowering import flash_config  # noqa: PLC0415

            return train_program(flash_config().replace(moe_routing="dense" if name.endswith("dense") else "auto"),
                                 name=name)
        if parts[0] == "qwen3_8b" and len(parts) == 2:
            if parts[1] == "decode":
                return qwen3_program(1)
            if parts[1].startswith("verify"):
                return qwen3_program(int(parts[1][len("verify"):]))
    except ValueError:
        pass
    raise UserError(f"--programs: unknown program {name!r}; names look like {', '.join(default_programs()[:3])}, "
                    "propose/8/packed, qwen3_8b/decode, qwen3_8b/verify6, train/flash")


# ---- measuring ----------------------------------------------------------------------------------------

def measure(program: Program, top: int = 2) -> dict[str, Any]:
    """Compile `program` for this host with the accelerator branches and measure its HLO."""
    import jax  # noqa: PLC0415

    import dspark_jax  # noqa: PLC0415
    from dspark_jax.bench import hlo_cost  # noqa: PLC0415
    from dspark_jax.nn.platform import accelerator_branches  # noqa: PLC0415

    t0 = time.perf_counter()
    fresh = lambda *args: program.fn(*args)  # noqa: E731  a new function: jit's trace cache holds no CPU-branch trace of it
    with accelerator_branches():
        compiled = jax.jit(fresh, donate_argnums=program.donate).lower(*program.args).compile()
    seconds = time.perf_counter() - t0
    root = str(Path(dspark_jax.__file__).resolve().parent.parent)
    cost = hlo_cost.analyze(compiled.as_text(), source_root=root, skip=GENERIC_HELPERS)
    xla = compiled.cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    return {
        "program": program.name, "flops": cost.flops, "min_flops": program.min_flops,
        "flops_ratio": cost.flops / program.min_flops, "bytes": cost.bytes, "min_bytes": program.min_bytes,
        "bytes_ratio": cost.bytes / program.min_bytes, "bytes_target": 3.0 if program.packed else 2.0,
        "elementwise_flops": cost.elementwise_flops, "xla_flops_loop_once": float(xla.get("flops", 0.0)),
        "unknown_trip_loops": cost.unknown_trip_loops, "compile_s": seconds,
        "flops_sources": hlo_cost.top_sources(cost, top, key="flops"),
        "bytes_sources": hlo_cost.top_sources(cost, top, key="bytes"),
    }


def _sources(pairs) -> str:
    return ", ".join(f"{label} {share:.0%}" for label, _, share in pairs)


def print_table(rows: list[dict]) -> None:
    print(f"{'program':<22}{'GFLOP':>10}{'min':>10}{'ratio':>8}{'GB':>10}{'min':>9}{'ratio':>8}  "
          "where the flops / the bytes are")
    for r in rows:
        flag = lambda ok: " " if ok else "!"  # noqa: E731  a missed target
        print(f"{r['program']:<22}{r['flops'] / 1e9:>10.1f}{r['min_flops'] / 1e9:>10.1f}"
              f"{r['flops_ratio']:>7.2f}{flag(r['flops_ratio'] <= 1.5)}"
              f"{r['bytes'] / 1e9:>10.2f}{r['min_bytes'] / 1e9:>9.2f}{r['bytes_ratio']:>7.2f}"
              f"{flag(r['bytes_ratio'] <= r['bytes_target'])}  "
              f"{_sources(r['flops_sources'])} | {_sources(r['bytes_sources'])}")
    print("ratio = compiled / analytic minimum; '!' = over the target (flops 1.5x; bytes 2x, 3x packed). "
          "XLA:CPU compiles with the TPU/GPU branches; loop bodies counted x trip count.")


def run(args: argparse.Namespace) -> int:
    check_output_flags(args, "json")
    names = [n.strip() for n in args.programs.split(",") if n.strip()]
    if not names:
        raise UserError("--programs: name at least one program")
    from tqdm.auto import tqdm  # noqa: PLC0415

    programs = [build(name) for name in names]  # every name checked before the first (slow) compile
    rows = [measure(p, args.top) for p in tqdm(programs, desc="dspark bench roofline", unit="program")]
    print_table(rows)
    if args.json:
        output_files.write_text(args.json, json.dumps(rows, indent=1))
    return 0
