"""`dspark bench decode`: plain vs speculative decoding on the serving engine, with where the time goes.

Per batch (slots = requests, all submitted at once, the same held-out prompts for every engine), after
a warm-up run of each engine on the same requests (compiles), the best of 3 timed runs of each:
  * fori     a pure `lax.fori_loop` greedy decode of the same model and batch, prefill included: one
             jitted call, no engine at all (the limit for plain decoding); `plain/fori` is our plain
             engine against it;
  * plain    the engine in mode "plain";
  * spec     the engine verifying every draft (mode "off"): tau, and the split T_draft (one jitted draft
             propose), T_verify (one backbone forward over K+1 tokens), T_round (the engine's round
             program alone, blocking); per engine round: wall ms, host ms (host work inside step()) and
             exposed ms (wall - T_round: time the device waited for the host or the prefill);
             efficiency = spec tok/s / (tau * slots / (T_draft + T_verify)); occupancy = running rows
             per slot per round (requests that finished early leave their slots idle to the batch's end:
             efficiency cannot exceed it);
  * async    the engine with the async scheduler on a cost table measured here for this batch
             (`--no-async` skips it): tokens/s and mean drafts verified per request-round;
  * peer     with `--peer transformers` (torch and transformers installed; Qwen3 bundles): the same
             backbone in transformers, eager and torch.compile, greedy, tokens checked equal to ours.
Tokens/s count every generated token (the prefill's first one included) over the wall time.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import drafts
from dspark_jax import output_files
from dspark_jax import sampling
from dspark_jax import spec_round as sr
from dspark_jax.bench import peer as peer_lib
from dspark_jax.serve import decode_state as ds
from dspark_jax.serve.cli_common import add_model_arguments, load_model
from dspark_jax.serve.compiling import count_compiles, release_programs
from dspark_jax.serve.engine import Engine, EngineConfig, Metrics, Request
from dspark_jax.serve.profile import profile_cost_table
from dspark_jax.validation import check_int_flags, check_output_flags, int_list_flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--batches", default="1,8,32", help="comma-separated slot counts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per split measurement")
    parser.add_argument("--no-async", action="store_true", help="skip the scheduled (async) engine")
    parser.add_argument("--peer", default="none", choices=("none", "transformers"),
                        help="also time the same backbone in Hugging Face transformers")
    parser.add_argument("--peer-threads", default="1,0",
                        help="torch thread counts to try for the peer (0 = torch's default); the best is reported")
    parser.add_argument("--json", default=None, help="write the rows as JSON here")


def call_seconds(fn, repeats: int, warmup: int = 1) -> np.ndarray:
    """Seconds of `repeats` calls of `fn` to completion, after `warmup` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return np.asarray(times)


def _median_time(fn, repeats):
    return float(np.median(call_seconds(fn, repeats)))


def bench_prompts(bundle, n, seed=0, max_prompt_tokens=128):
    """n prompts: the bundle's held-out prompts.jsonl (cycled), else random ids."""
    rng = np.random.default_rng(seed)
    if bundle.tokenizer is not None and bundle.path is not None and (bundle.path / "prompts.jsonl").is_file():
        lines = (bundle.path / "prompts.jsonl").read_text().splitlines()
        texts = [json.loads(x)["prompt"] for x in lines if x.strip()]
        return [bundle.tokenizer.encode(texts[i % len(texts)]).ids[-max_prompt_tokens:] for i in range(n)]
    return [rng.integers(0, bundle.model.backbone.vocab_size, 12).tolist() for _ in range(n)]


def started_state(model: sr.SpecModel, weights: sr.Weights, batch: int, sp: sampling.SamplingParams):
    """The spec-round state after 16-token prompts on every row (a 256-token cache): what the profiling
    scripts time their programs on. -> (state, seeds)."""
    state = sr.init_state(model, batch, 256)
    seeds = jnp.arange(batch, dtype=jnp.uint32)
    prompt = jnp.ones((batch, 16), jnp.int32)
    state, _ = jax.jit(sr.start, static_argnums=0)(model, weights, state, prompt, jnp.full((batch,), 16),
                                                    jnp.ones(batch, bool), sp, seeds)
    return state, seeds


def split_times(model: sr.SpecModel, weights: sr.Weights, batch: int, repeats: int):
    """(T_draft, T_verify) seconds at `batch` slots: one jitted draft propose, one K+1-token forward."""
    k = model.block_size
    sp = sampling.SamplingParams.greedy(batch)
    state, seeds = started_state(model, weights, batch, sp)
    prop = jax.jit(lambda w, s: drafts.propose(w.draft, w.tied, model.cfg, s.draft, s.anchor, sp, seeds,
                                                  impl=model.impl, filtering=False))
    toks = jnp.ones((batch, k + 1), jnp.int32)
    ver = jax.jit(lambda w, s: sr.backbone_forward(model, w.backbone, s.cache, toks))
    return _median_time(lambda: prop(weights, state), repeats), _median_time(lambda: ver(weights, state), repeats)


def round_time(model: sr.SpecModel, weights: sr.Weights, prompts, max_len: int, repeats: int) -> float:
    """Seconds of the engine's round program alone (mode "off" at full width, every slot running)."""
    b = len(prompts)
    reqs = [Request(p, max_tokens=max_len) for p in prompts]
    rows = ds.joining_rows(list(range(b)), prompts, reqs, b, max_len, 1, 16)
    state = ds.init(model, b, max_len, 1)
    state, _ = ds.ADMIT(model, weights, state, jax.device_put(rows), max_len=max_len)
    k = model.block_size
    run = functools.partial(ds.SPEC_ROUNDS, model, weights, rounds=1, max_len=max_len, width=k + 1, mode="fixed",
                            num_verify=k, filtering=False)
    times = []
    for i in range(2 + repeats):
        t0 = time.perf_counter()
        state, d = run(state, None)
        jax.block_until_ready(d)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[2:]))


def fori_greedy(model: sr.SpecModel, weights: sr.Weights, prompts, new_tokens: int, max_len: int):
    """Greedy decode as ONE jitted lax.fori_loop (prefill included): -> (tokens i32[B, new], seconds)."""
    bb = model.backbone
    b, longest = len(prompts), max(len(p) for p in prompts)
    prompt = np.zeros((b, longest), np.int32)
    for i, p in enumerate(prompts):
        prompt[i, :len(p)] = p
    plen = np.array([len(p) for p in prompts], np.int32)

    @jax.jit
    def run(params, prompt, plen):
        out = bb.forward(params, bb.init_cache(b, max_len), prompt, logits_at=plen - 1)
        cache = bb.commit(out.cache, plen)
        tok = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
        toks = jnp.zeros((b, new_tokens), jnp.int32).at[:, 0].set(tok)

        def body(i, carry):
            cache, tok, toks = carry
            o = bb.forward(params, cache, tok[:, None])
            tok = jnp.argmax(o.logits[:, 0], axis=-1).astype(jnp.int32)
            return bb.commit(o.cache, jnp.ones((b,), jnp.int32)), tok, toks.at[:, i].set(tok)

        return jax.lax.fori_loop(1, new_tokens, body, (cache, tok, toks))[2]

    args = (weights.backbone, jax.device_put(prompt), jax.device_put(plen))
    toks = jax.block_until_ready(run(*args))
    return np.asarray(toks), float(np.min(call_seconds(lambda: run(*args), 3, warmup=0)))


def timed_engine(model, weights, config: EngineConfig, requests, table=None, runs: int = 3):
    """Warm up an engine on the requests, then serve them `runs` more times: -> (results, Metrics of the
    fastest run; a shared CPU's slow spells move single runs by 20-40%)."""
    engine = Engine(model, weights, config, cost_table=table)
    engine.generate(requests)
    best = None
    with count_compiles() as compiled:
        for _ in range(runs):
            engine.metrics = Metrics(engine.k)
            results = engine.generate(requests)
            if best is None or engine.metrics.wall_s < best[1].wall_s:
                best = (results, engine.metrics)
    if compiled["n"]:
        print(f"WARNING: engine mode {config.mode!r} compiled {compiled['n']} programs during its timed runs",
              flush=True)
    del engine  # it compiled its whole program set: the next engine's must fit in the memory maps
    release_programs()
    return best


def run(args: argparse.Namespace) -> int:
    # Every flag before the model loads (a bad --batches entry used to fail after the first batch ran).
    check_int_flags(args, "max_tokens", "max_len", "repeats")
    check_output_flags(args, "json")
    batches = int_list_flag(args, "batches")
    peer_threads = int_list_flag(args, "peer_threads", minimum=0)
    bundle = load_model(args)
    model, weights = bundle.model, bundle.weights
    peer = None
    if args.peer == "transformers":
        reason = peer_lib.available()
        if reason is None and bundle.backbone_family != "qwen3":
            reason = f"the peer runs Qwen3 backbones; this bundle's is {bundle.backbone_family!r}"
        if reason:
            print(f"peer: skipped ({reason})")
        else:
            peer = peer_lib.to_transformers(model.backbone, weights.backbone)
    rows = []
    for b in batches:
        prompts = bench_prompts(bundle, b)
        reqs = [Request(p, max_tokens=args.max_tokens, seed=i, id=i) for i, p in enumerate(prompts)]
        row = {"batch": b}
        fori_tokens, fori_s = fori_greedy(model, weights, prompts, args.max_tokens, args.max_len)
        row["fori_tok_s"] = b * args.max_tokens / fori_s
        base = dict(max_slots=b, max_len=args.max_len, progress=False)
        res_p, m_p = timed_engine(model, weights, EngineConfig(mode="plain", **base), reqs)
        res_s, m_s = timed_engine(model, weights, EngineConfig(mode="off", **base), reqs)
        row["same_tokens"] = all(r.tokens == s.tokens == fori_tokens[i].tolist()
                                 for i, (r, s) in enumerate(zip(res_p, res_s)))
        t_draft, t_verify = split_times(model, weights, b, args.repeats)
        t_round = round_time(model, weights, prompts, args.max_len, args.repeats)
        wall_round = m_s.wall_s / max(m_s.rounds, 1)
        row.update(plain_tok_s=m_p.tokens_per_s, spec_tok_s=m_s.tokens_per_s, tau=m_s.tau,
                   t_draft_ms=t_draft * 1e3, t_verify_ms=t_verify * 1e3, t_round_ms=t_round * 1e3,
                   wall_round_ms=wall_round * 1e3, host_round_ms=m_s.host_s / max(m_s.rounds, 1) * 1e3,
                   exposed_round_ms=(wall_round - t_round) * 1e3,
                   efficiency=m_s.tokens_per_s / (m_s.tau * b / (t_draft + t_verify)),
                   occupancy=m_s.request_rounds / max(m_s.rounds * b, 1))
        row["plain_vs_fori"] = row["plain_tok_s"] / row["fori_tok_s"]
        if not args.no_async:
            table = profile_cost_table(model, weights, slots=b, max_len=args.max_len, progress=False)
            res_a, m_a = timed_engine(model, weights, EngineConfig(mode="async", **base), reqs, table)
            row["same_tokens"] &= all(r.tokens == a.tokens for r, a in zip(res_p, res_a))
            row.update(async_tok_s=m_a.tokens_per_s, async_mean_verify=m_a.mean_verify,
                       async_spec_rounds=m_a.spec_rounds, async_rounds=m_a.rounds)
        if peer is not None:
            for compiled in (False, True):
                name = "peer_compiled" if compiled else "peer_eager"
                for threads in peer_threads:
                    toks, secs = peer_lib.greedy_generate(peer, prompts, args.max_tokens, compiled=compiled,
                                                          threads=threads or None)
                    if b * args.max_tokens / secs > row.get(f"{name}_tok_s", 0.0):
                        row[f"{name}_tok_s"], row[f"{name}_threads"] = b * args.max_tokens / secs, threads
                    row[f"{name}_same"] = row.get(f"{name}_same", True) and all(
                        t == r.tokens for t, r in zip(toks, res_p))
        rows.append(row)
        print(f"batch {b} done: plain {row['plain_tok_s']:.0f} tok/s, spec {row['spec_tok_s']:.0f} tok/s", flush=True)
    print_table(rows, bundle, args)
    if args.json:
        output_files.write_text(args.json, json.dumps(rows, indent=1))
    return 0


def print_table(rows, bundle, args) -> None:
    k = bundle.model.block_size
    print(f"\n{'batch':>5} {'fori':>7} {'plain':>7} {'p/fori':>6} {'spec':>7} {'tau':>5} {'Tdraft':>7} {'Tverify':>7} "
          f"{'Tround':>7} {'wall/r':>7} {'host/r':>7} {'expo/r':>7} {'effic':>5} {'occ':>4} {'async':>7} {'a/plain':>7} "
          f"{'verif/r':>7} {'same':>5}")
    for r in rows:
        a = r.get("async_tok_s")
        print(f"{r['batch']:>5} {r['fori_tok_s']:>7.0f} {r['plain_tok_s']:>7.0f} {r['plain_vs_fori']:>6.2f} "
              f"{r['spec_tok_s']:>7.0f} {r['tau']:>5.2f} {r['t_draft_ms']:>7.2f} {r['t_verify_ms']:>7.2f} "
              f"{r['t_round_ms']:>7.2f} {r['wall_round_ms']:>7.2f} {r['host_round_ms']:>7.2f} "
              f"{r['exposed_round_ms']:>7.2f} {r['efficiency']:>5.2f} {r['occupancy']:>4.2f} "
              + (f"{a:>7.0f} {a / r['plain_tok_s']:>7.2f} {r['async_mean_verify']:>7.2f}" if a else f"{'-':>7} " * 3)
              + f" {str(r['same_tokens']):>5}")
    if any("peer_eager_tok_s" in r for r in rows):
        print(f"\n{'batch':>5} {'ours plain':>10} {'hf eager':>9} {'hf compiled':>11} {'plain/hf-c':>10} "
              f"{'async/hf-c':>10} {'same':>5}")
        for r in rows:
            c = r["peer_compiled_tok_s"]
            a = r.get("async_tok_s", float("nan"))
            print(f"{r['batch']:>5} {r['plain_tok_s']:>10.0f} {r['peer_eager_tok_s']:>9.0f} {c:>11.0f} "
                  f"{r['plain_tok_s'] / c:>10.2f} {a / c:>10.2f} "
                  f"{str(r['peer_eager_same'] and r['peer_compiled_same']):>5}")
    print(f"({jax.devices()[0].platform.upper()} figures; K={k}; greedy; {args.max_tokens} tokens per request; tok/s "
          f"over all requests; times in ms; host/r = host work per engine round, expo/r = round wall - Tround, occ = running rows per slot-round)")
