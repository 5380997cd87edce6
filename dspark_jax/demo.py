"""`dspark demo`: speculative generation with the embedded default model, measured against plain decoding.

The embedded default (dspark_jax/assets/default/) is a small V4.1-style mHC backbone trained on the
Python standard library's sources and its block-7 DSpark draft (Markov head, STS-calibrated confidence
head). The demo continues held-out functions (stdlib files neither model saw) three times with the same
requests, greedy and at T = 1, on the same engine loop:
  * plain       plain autoregressive decoding (engine mode "plain");
  * verify-all  speculative, every draft verified (mode "off"; or "fixed" with --num-verify);
  * scheduled   speculative with the DSpark async scheduler (mode "async") on a cost table measured on
                this machine once and cached beside the bundle: it verifies only what is predicted to
                pay, down to no draft at all (plain steps) when nothing does;
and prints tau, drafts verified per round and the per-position conditional acceptance, tokens/s and the
speed-up of each (timed after a compile warm-up on the same prompts), for greedy whether every run
equals plain decoding token for token (it must), and one continuation as text; it writes a PNG
(acceptance bars + tokens/s) to --plot (default ./dspark_demo.png).
The same three engines with one slot then serve the first --batch1-prompts prompts one at a time, in a
second table beside the first: batch 1 is where a speculative round pays on this CPU, and where the
scheduler keeps it on (at 8 slots a round costs about 3 plain steps and it turns speculation off).
One progress bar (stderr) covers the whole demo; the tables go to stdout, and after them one line per
engine says where its time went (compiling and warm-up, decoding: host and waiting for the device).

Without the embedded model it says so; --random-tiny runs the same plumbing on random tiny weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from dspark_jax import configs
from dspark_jax.acceptance_report import MIN_PLOT_ROUNDS, acceptance_bars, fmt_acc, fmt_counts
from dspark_jax.validation import check_int_flags, check_number_flags, check_output_flags

# bundle, evaluation and serve.* import jax: they are imported inside the functions that run the demo, so
# `dspark demo --help` and its argument errors answer without importing jax.


RUNS = 3  # timed runs per engine and temperature: this machine's speed moves by 20-40% between runs
# Prompts the 1-slot engines serve one after another (the batch-1 rows). Their compiles, not their decoding,
# are most of what they add to the demo; more prompts steady the figures but each adds runs x 0.3 s per engine.
BATCH1_PROMPTS = 2


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
    parser.add_argument("--runs", type=int, default=RUNS,
                        help=f"timed runs per engine and temperature, best kept (default {RUNS})")
    parser.add_argument("--batch1-prompts", type=int, default=BATCH1_PROMPTS,
                        help="the batch-1 rows: the first N prompts served one at a time by the same engines with "
                             f"one slot (default {BATCH1_PROMPTS}; 0: none)")
    parser.add_argument("--plot", default="dspark_demo.png", help="PNG to write (acceptance and tokens/s)")
    parser.add_argument("--impl", default="auto", choices=("auto", "pallas", "xla"))
    parser.add_argument("--no-progress", action="store_true")


def _load(args):
    from dspark_jax.bundle import load_bundle, random_bundle  # noqa: PLC0415  (jax)
    from dspark_jax.evaluation import default_dir, missing_default_message  # noqa: PLC0415  (jax)

    if args.random_tiny:
        print("NOTE: --random-tiny: random weights on the tiny configs; acceptance, speed-up and text are "
              "meaningless (a plumbing check).")
        return random_bundle(configs.path("tiny_mhc_backbone.json"), configs.path("tiny_v41.json")), None
    path = args.bundle or default_dir()
    if path is None:
        print(missing_default_message("dspark demo"), file=sys.stderr)
        return None, None
    return load_bundle(path, impl=args.impl), Path(path)


def check_args(args) -> None:
    """Every numeric flag, before the model loads: a NaN temperature or 0 tokens ran the whole demo and
    printed a table of zeros."""
    check_int_flags(args, "prompts", "max_tokens", "max_len", "runs")
    check_int_flags(args, "num_verify", "batch1_prompts", minimum=0)
    check_number_flags(args, "temperatures")
    check_output_flags(args, "plot")


def _prompts(args, bundle, path, given=None):
    from dspark_jax.evaluation import read_prompts  # noqa: PLC0415  (jax)

    if given is not None:
        return given
    if args.random_tiny:
        rng = np.random.default_rng(0)
        v = bundle.model.backbone.vocab_size
        return [{"id": i, "tokens": rng.integers(0, v, size=24).tolist()} for i in range(args.prompts)]
    return read_prompts(path / "prompts.jsonl", args.prompts)


ENGINES = ("plain", "verify-all", "scheduled")
WARM_UP_TOKENS = 16  # the longest warm-up budget (evaluation.timed_generate)
HEADER = (f"{'T':>3s} {'decoding':12s} {'tokens':>6s} {'seconds':>8s} {'tok/s':>7s} {'tau':>6s} {'verified/r':>10s} "
          f"{'spec rounds':>11s} {'speedup':>8s}")
# JAX's events for turning a program into an executable: tracing, lowering, XLA's compile (jax._src.dispatch)
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


def engine_sizes(n_prompts: int, batch1_prompts: int) -> list[tuple[int, int]]:
    """(slots, prompts) of each engine size the demo times: every prompt at once, one slot each; then the
    first `batch1_prompts` one at a time on one slot (batch 1). No second size when the first is batch 1."""
    sizes = [(n_prompts, n_prompts)]
    if batch1_prompts and n_prompts > 1:
        sizes.append((1, min(batch1_prompts, n_prompts)))
    return sizes


def slots_label(slots: int) -> str:
    return f"{slots} slot" + ("" if slots == 1 else "s")


def size_title(slots: int, prompts: int) -> str:
    """The line above one engine size's table: what its rows served, and how."""
    if slots == 1 and prompts > 1:
        return f"batch 1: 1 slot, the first {prompts} prompts one after another"
    return f"{slots_label(slots)}: {prompts} prompt{'s' if prompts > 1 else ''} served together"


def best_of_runs(names, timed_run, runs: int = RUNS) -> dict:
    """name -> (results, Metrics) of each engine's fastest of `runs` timed runs (`timed_run(name)`), taken
    round-robin over the engines: a slow spell of the machine then hits them alike."""
    best = {}
    for _ in range(runs):
        for name in names:
            res, m = timed_run(name)
            if name not in best or m.tokens_per_s > best[name][1].tokens_per_s:
                best[name] = (res, m)
    return best


def same_as_plain(out: dict) -> bool:
    """Whether every engine's results equal plain decoding's, request by request, token for token."""
    return all(a.tokens == b.tokens for res, _ in out.values() for a, b in zip(out["plain"][0], res))


def table_lines(runs: list[dict]) -> list[str]:
    """One engine size's table: a row per temperature and engine, the speed-up against plain decoding at
    the same temperature on the same engine size."""
    lines = [HEADER]
    for r in runs:
        mp = r["metrics"]["plain"]
        for name, m in r["metrics"].items():
            speed = m.tokens_per_s / mp.tokens_per_s if mp.tokens_per_s else float("nan")
            lines.append(f"{r['T']:>3g} {name:12s} {m.emitted:6d} {m.wall_s:8.2f} {m.tokens_per_s:7.1f} {m.tau:6.3f} "
                         f"{m.mean_verify:10.2f} {m.spec_rounds:5d}/{m.rounds:<5d} {speed:7.2f}x")
    return lines


class CompileClock:
    """Compiles (XLA's) and the seconds spent making executables (tracing, lowering, compiling) in the
    calling thread: a program compiles in the thread that first dispatches it, and the demo warms its
    engines up in threads of their own, side by side."""

    _instance = None

    def __init__(self):
        self._local = threading.local()

    @classmethod
    def get(cls) -> "CompileClock":
        """The process's one clock (a JAX listener cannot be taken back: registering one per demo would
        leave the old ones counting)."""
        if cls._instance is None:
            import jax  # noqa: PLC0415  (the demo's functions import jax; --help does not)

            cls._instance = cls()
            jax.monitoring.register_event_duration_secs_listener(cls._instance._listen)
        return cls._instance

    def _listen(self, name: str, duration: float, **_) -> None:
        if name in COMPILE_EVENTS:
            n, s = self.read()
            self._local.n, self._local.s = n + (name == COMPILE_EVENTS[-1]), s + duration

    def read(self) -> tuple[int, float]:
        """(compiles, seconds) in this thread so far."""
        return getattr(self._local, "n", 0), getattr(self._local, "s", 0.0)

    def since(self, before: tuple[int, float]) -> tuple[int, float]:
        n, s = self.read()
        return n - before[0], s - before[1]


@dataclasses.dataclass
class Spent:
    """Where one engine's time went over the whole demo: every call, not only the best runs. Compiles are
    counted apart wherever they fall: a program compiles (lazily) at its first dispatch, which may be in a
    timed run (the async scheduler can pick a width that its warm-up's short runs did not)."""

    compile_s: float = 0.0  # making the executables of the programs it dispatched first: tracing, lowering, XLA
    compiles: int = 0  # XLA compiles (a program another engine of its size compiled first is not one)
    warm_up_s: float = 0.0  # the rest of its warm-ups: short runs
    decode_s: float = 0.0  # serving wall time of its timed runs, less compiles inside them
    host_s: float = 0.0  # of decode_s: host time inside Engine.step() not spent waiting for the device
    tokens: int = 0  # generated by its timed runs
    runs: int = 0

    def add_warm_up(self, elapsed: float, compiled: tuple[int, float]) -> None:
        """A warm-up that took `elapsed` s, with `compiled` = (compiles, seconds) inside it."""
        self.compiles += compiled[0]
        self.compile_s += compiled[1]
        self.warm_up_s += max(elapsed - compiled[1], 0.0)

    def add_run(self, m, compiled: tuple[int, float]) -> None:
        """A timed run measured in `m` (engine Metrics); a compile inside it ran on the host, in a step."""
        self.compiles += compiled[0]
        self.compile_s += compiled[1]
        self.decode_s += max(m.wall_s - compiled[1], 0.0)
        self.host_s += max(m.host_s - compiled[1], 0.0)
        self.tokens += m.tokens
        self.runs += 1

    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0


def spent_line(label: str, s: Spent, plain: Spent) -> str:
    """`label`: its compiles, its warm-up, its decoding split into host and device time, and its tokens/s
    over all its timed runs against plain decoding's on the same engine size."""
    speed = s.tokens_per_s() / plain.tokens_per_s() if plain.tokens_per_s() else float("nan")
    programs = f"{s.compiles} program" + ("" if s.compiles == 1 else "s")
    return (f"  {label}: {s.compile_s:.1f} s compiling {programs}, {s.warm_up_s:.1f} s warm-up runs, "
            f"{s.decode_s:.2f} s decoding in {s.runs} timed runs (host {s.host_s:.2f} s, waiting for the device "
            f"{s.decode_s - s.host_s:.2f} s), {speed:.2f}x plain")


class Runner:
    """Warms up and times the demo's engines: each engine's time into its Spent, one step of the demo's one
    progress bar per warm-up and per timed run (the engines' own bars are off: they drew one per call)."""

    def __init__(self, timed_generate, bar):
        self.timed_generate, self.bar, self.clock = timed_generate, bar, CompileClock.get()
        self.spent: dict[tuple[int, str], Spent] = {}  # (slots, engine name) -> Spent
        self.warm_up_wall_s = 0.0

    def warm_up(self, slots: int, engines: dict, reqs) -> None:
        """Every engine's warm-up (what it compiles), side by side: XLA compiles outside the GIL, so a
        second core compiles another engine's programs meanwhile. The tables time none of this."""
        self.bar.set_postfix_str(f"{slots_label(slots)}, T = {reqs[0].temperature:g}: compiling and warming up")
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(engines)) as pool:
            done = list(pool.map(functools.partial(self._warm_up_one, reqs), engines.values()))
        self.warm_up_wall_s += time.perf_counter() - t0
        for name, (elapsed, compiled) in zip(engines, done):
            self.spent.setdefault((slots, name), Spent()).add_warm_up(elapsed, compiled)
        self.bar.update()

    def _warm_up_one(self, reqs, engine) -> tuple[float, tuple[int, float]]:
        # timed_generate's warm-up (short budgets that reach every verify width), on requests cut to its
        # longest budget: the short timed run that ends it is the last of the warm-up.
        short = [dataclasses.replace(r, max_tokens=min(r.max_tokens, WARM_UP_TOKENS)) for r in reqs]
        before, t0 = self.clock.read(), time.perf_counter()
        self.timed_generate(engine, short, warmup_tokens=WARM_UP_TOKENS)
        return time.perf_counter() - t0, self.clock.since(before)

    def timed_run(self, slots: int, engines: dict, reqs, name: str):
        self.bar.set_postfix_str(f"{slots_label(slots)}, T = {reqs[0].temperature:g}: {name}")
        before = self.clock.read()
        res, m = self.timed_generate(engines[name], reqs, warmup_tokens=0)
        self.spent.setdefault((slots, name), Spent()).add_run(m, self.clock.since(before))
        self.bar.update()
        return res, m


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    check_args(args)  # before jax is imported: a bad flag answers at once
    from dspark_jax.evaluation import make_requests, read_prompts, timed_generate  # noqa: PLC0415  (jax)
    from dspark_jax.serve.compiling import release_programs  # noqa: PLC0415  (jax)
    from dspark_jax.serve.engine import Engine, EngineConfig  # noqa: PLC0415  (jax)
    from dspark_jax.serve.profile import cached_cost_table  # noqa: PLC0415  (jax)

    # A --prompts-file is read (and each line checked) before the model loads; --random-tiny makes its
    # own token prompts (the tiny model has no tokenizer) and ignores it.
    given = read_prompts(args.prompts_file, args.prompts) if args.prompts_file and not args.random_tiny else None
    bundle, path = _load(args)
    if bundle is None:
        return 2
    prompts = _prompts(args, bundle, path, given)
    loaded_s = time.perf_counter() - t_start
    model, weights = bundle.model, bundle.weights
    k = model.block_size
    sizes = engine_sizes(len(prompts), args.batch1_prompts)
    where = "random tiny weights" if args.random_tiny else str(path)
    cal = "STS-calibrated" if bundle.calibration is not None else "uncalibrated"
    print(f"model: {where}\n  backbone {bundle.backbone_family} dim {model.backbone.dim}, {model.backbone.n_layers} "
          f"layers, vocab {model.backbone.vocab_size}; draft block {k}, Markov rank {model.cfg.markov_rank}, "
          f"{cal} confidence")
    print(f"{len(prompts)} held-out prompts x {args.max_tokens} tokens, {len(prompts)} slots; engines: plain, "
          f"verify-all (mode '{args.mode}'" + (f", verify {args.num_verify})" if args.mode == "fixed" else ")")
          + f", scheduled (async); each timed {args.runs} times round-robin, best kept")
    for slots, n in sizes[1:]:
        print(f"then the same engines with {slots_label(slots)} (batch 1) on the first {n} prompts, one at a time",
              flush=True)

    # One bar for the whole demo: a step per cost table, per warm-up and per timed run. Nothing else is
    # printed while it runs (on a terminal a print would break its line); what it measured comes after.
    steps = len(sizes) * (1 + len(args.temperatures) * (1 + len(ENGINES) * args.runs))
    bar = tqdm(total=steps, desc="dspark demo", unit="step", disable=args.no_progress)
    runner = Runner(timed_generate, bar)
    tables_s, tables_from, by_size = 0.0, [], []
    for slots, n in sizes:
        # Each size's programs are its own (other shapes): drop the previous size's before compiling these,
        # since on XLA:CPU each program holds ~800 memory maps of the process's 65,530.
        release_programs()
        bar.set_postfix_str(f"{slots_label(slots)}: cost table")
        t0 = time.perf_counter()
        table, where_table = cached_cost_table(bundle, slots=slots, max_len=args.max_len, progress=False)
        tables_s += time.perf_counter() - t0
        tables_from.append(f"cost table, {slots_label(slots)}: {where_table}")
        bar.update()
        # Compile policy "lazy": the three engines are timed round-robin, so all live at once, and their whole
        # program sets (~150 on XLA:CPU) would not fit in the process's memory maps. The warm-up compiles
        # what the timed runs use; each engine keeps its best of --runs runs.
        base = dict(max_slots=slots, max_len=args.max_len, progress=False, compile="lazy")
        engines = {"plain": Engine(model, weights, EngineConfig(mode="plain", **base)),
                   "verify-all": Engine(model, weights, EngineConfig(mode=args.mode, num_verify=args.num_verify,
                                                                     **base)),
                   "scheduled": Engine(model, weights, EngineConfig(mode="async", **base), cost_table=table)}
        runs, samples = [], []
        for temp in args.temperatures:
            reqs = make_requests(prompts[:n], bundle.tokenizer, max_tokens=args.max_tokens, temperature=temp)
            runner.warm_up(slots, engines, reqs)
            out = best_of_runs(ENGINES, functools.partial(runner.timed_run, slots, engines, reqs), args.runs)
            samples.append((temp, reqs[0], out["scheduled"][0][0]))
            runs.append({"T": temp, "metrics": {name: m for name, (_, m) in out.items()},
                         "same": same_as_plain(out) if temp == 0.0 else None})
        by_size.append((slots, n, runs, samples))
    bar.close()

    print("\n".join(tables_from))
    for slots, n, runs, _ in by_size:
        print(f"\n{size_title(slots, n)}")
        print("\n".join(table_lines(runs)))
    _, _, runs, samples = by_size[0]  # acceptance, sample text and plot: every prompt at once, as before
    print()
    print("per-position conditional acceptance P(accept k | 1..k-1 accepted):")
    print("      " + " ".join(f"  k={i + 1}" for i in range(k)))
    for r in runs:
        m = r["metrics"]["verify-all"]
        print(f"T={r['T']:<3g} " + fmt_acc([None if np.isnan(a) else float(a) for a in m.acceptance], k))
        print("rounds " + fmt_counts(m.verified_at, k))
    for size_slots, _, size_runs, _ in by_size:
        for r in size_runs:
            if r["same"] is not None:
                verdict = "identical" if r["same"] else "DIFFERENT (a bug: greedy speculative decoding must be lossless)"
                print(f"greedy check, {slots_label(size_slots)}: verify-all and scheduled outputs vs plain decoding, "
                      f"token for token: {verdict}")

    if samples and bundle.tokenizer is not None:
        req = samples[0][1]
        prompt_text = bundle.tokenizer.decode(list(req.prompt))
        tail = "\n".join(prompt_text.splitlines()[-6:])
        print(f"\nsample: prompt {req.id} (held-out; last lines), then the scheduled run's continuation per T\n"
              f"{'-' * 72}\n{tail}")
        for temp, _, res in samples:
            label = "greedy" if temp == 0.0 else f"T = {temp:g}"
            print(f"{'-' * 30} {label:^10s} {'-' * 30}\n{bundle.tokenizer.decode(res.tokens)}")
        print("-" * 72)

    if args.plot:
        _plot(runs, k, args.plot)
        print(f"plot: {Path(args.plot).resolve()}")
    print("\nwhere the time went, per engine (compiling: tracing, lowering and XLA, for the programs no engine of "
          "its size compiled before it, wherever they fell; decoding: all its timed runs; host: the engine's own "
          "work in its steps, the rest waits for the device):")
    for (size_slots, name), s in runner.spent.items():
        print(spent_line(f"{name}, {slots_label(size_slots)}", s, runner.spent[(size_slots, "plain")]))
    print(f"  the demo's own: {loaded_s:.1f} s loading the model, {tables_s:.1f} s cost tables; the engines of a size "
          f"warm up side by side: {runner.warm_up_wall_s:.1f} s of wall time for the warm-ups above")
    print(f"demo finished in {time.perf_counter() - t_start:.0f} s")
    return 0


def _plot(runs, k, path) -> None:
    import matplotlib  # noqa: PLC0415  (heavy; only with --plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(len(runs), 1)
    for i, r in enumerate(runs):
        m = r["metrics"]["verify-all"]
        xs = np.arange(1, k + 1) + (i - (len(runs) - 1) / 2) * width
        acceptance_bars(ax1, xs, m.acceptance, m.verified_at, width, f"T = {r['T']:g} (tau {m.tau:.2f})", f"C{i}")
    ax1.set_xticks(np.arange(1, k + 1))
    ax1.set_xlim(0.4, k + 0.6)
    ax1.set_xlabel("draft position k")
    ax1.set_ylabel("P(accept k | 1..k-1 accepted)")
    ax1.set_ylim(0, 1.4)  # room above 1 for the counts over the bars and, above them, the legend
    ax1.set_yticks(np.linspace(0, 1, 6))
    ax1.set_title(f"DSpark per-position acceptance, every draft verified (hatched: < {MIN_PLOT_ROUNDS} rounds)",
                  fontsize=9)
    ax1.legend(loc="upper left", fontsize=8)
    names = list(runs[0]["metrics"]) if runs else []
    xs = np.arange(len(runs))
    bar = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        vals = [r["metrics"][name].tokens_per_s for r in runs]
        pos = xs + (j - (len(names) - 1) / 2) * bar
        ax2.bar(pos, vals, bar, label=name)
        for x, r, v in zip(pos, runs, vals):
            ax2.text(x, v, f"{v / max(r['metrics']['plain'].tokens_per_s, 1e-9):.2f}x", ha="center", va="bottom",
                     fontsize=8)
    ax2.set_xticks(xs, [f"T = {r['T']:g}" for r in runs])
    ax2.set_ylabel("tokens / s (this machine, this run)")
    ax2.set_title("throughput, same requests")
    top = max((m.tokens_per_s for r in runs for m in r["metrics"].values()), default=1.0)
    ax2.set_ylim(0, 1.4 * top)  # the speed-up labels over the bars, the legend above them
    ax2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
