"""`dspark bench serve --http`: the closed-loop sweep over real HTTP (`dspark serve` on loopback).

For each concurrency c and each engine mode (plain, async), a server with c slots runs in this process
(uvicorn on 127.0.0.1, a free port); c client threads each stream `--requests-per-client` completions
one after another (SSE, the same seeded workload as the in-process sweep). Per request it records the
time to the first text chunk (TTFT) and the gaps between text chunks (ITL: what a reader of the stream
waits; a speculative round's chunk carries every token it accepted), and checks the response is
complete: a final chunk with `usage`, then `[DONE]`; anything else is counted as an error, with its message. A
warm-up pass (discarded) precedes the timed one. Bounded: a fixed number of requests, each with a
deadline (--http-timeout seconds).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import httpx
import jax
import numpy as np

from dspark_jax.serve.engine import Engine, EngineConfig
from dspark_jax.serve.http import ThreadedServer, create_app
from dspark_jax.serve.loop import EngineLoop
from dspark_jax.serve.metrics import ServerMetrics
from dspark_jax.serve.profile import cached_cost_table

MODES = ("plain", "async")


@dataclasses.dataclass
class Outcome:
    ok: bool
    tokens: int = 0
    ttft: float = float("nan")
    gaps: list = dataclasses.field(default_factory=list)
    error: str | None = None


def stream_one(client, url: str, body: dict) -> Outcome:
    """One streamed completion; -> its latencies, or the error it ended with."""
    t0 = time.perf_counter()
    last, first, chunks, usage, done = t0, None, 0, None, False
    gaps = []
    try:
        with client.stream("POST", url, json={**body, "stream": True}) as resp:
            if resp.status_code != 200:
                resp.read()
                return Outcome(False, error=f"HTTP {resp.status_code}: {resp.text[:200]}")
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    return Outcome(False, error=obj["error"].get("message"))
                if obj.get("usage"):
                    usage = obj["usage"]
                if obj["choices"][0].get("text"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    if chunks:
                        gaps.append(now - last)
                    chunks += 1
                    last = now
    except Exception as err:  # noqa: BLE001 (a benchmark client reports what went wrong and goes on)
        return Outcome(False, error=f"{type(err).__name__}: {err}")
    if not done or usage is None:
        return Outcome(False, error="the stream ended without a final usage chunk and [DONE]")
    # No text chunk (a bundle without a tokenizer streams no text): its latencies are not measurable.
    return Outcome(True, usage["completion_tokens"], first - t0 if first is not None else float("nan"), gaps)


def closed_loop_http(url: str, requests, concurrency: int, timeout: float) -> tuple[list[Outcome], float]:
    todo = list(enumerate(requests))
    lock = threading.Lock()
    results: list[Outcome | None] = [None] * len(todo)

    def client_thread():
        with httpx.Client(timeout=timeout) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    i, r = todo.pop(0)
                body = {"prompt": list(map(int, r.prompt)), "max_tokens": r.max_tokens,
                        "temperature": r.temperature, "seed": r.seed}
                results[i] = stream_one(client, url, body)

    threads = [threading.Thread(target=client_thread, daemon=True) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r or Outcome(False, error="never sent") for r in results], time.perf_counter() - t0


def _percentile(x: list[float], q: float) -> float:
    """The q-th percentile of the measured values; NaN when nothing was measured."""
    x = np.asarray(x, float)
    x = x[~np.isnan(x)]
    return float(np.percentile(x, q)) if x.size else float("nan")


def summarize(outcomes: list[Outcome], wall: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    gaps = [g for o in ok for g in o.gaps]
    ttft = [o.ttft for o in ok]
    return {"requests": len(outcomes), "ok": len(ok), "errors": sorted({o.error for o in outcomes if not o.ok}),
            "tok_s": sum(o.tokens for o in ok) / wall, "ttft_p50": _percentile(ttft, 50),
            "ttft_p99": _percentile(ttft, 99), "itl_p50": _percentile(gaps, 50), "itl_p99": _percentile(gaps, 99)}


def run_http(args, bundle, concurrencies, workload) -> list[dict]:
    rows = []
    for c in concurrencies:
        reqs = workload(bundle, c * args.requests_per_client, args)
        table, where = cached_cost_table(bundle, slots=c, max_len=args.max_len, progress=False)
        print(f"concurrency {c}: {len(reqs)} requests over HTTP, cost table {where}", flush=True)
        row = {"concurrency": c}
        for mode in MODES:
            cfg = EngineConfig(max_slots=c, max_len=args.max_len, mode=mode, progress=False)
            metrics = ServerMetrics()
            loop = EngineLoop(lambda cfg=cfg: Engine(bundle.model, bundle.weights, cfg, cost_table=table),
                              max_queue=len(reqs), warmup=args.warmup, on_round=metrics.observe_round)
            metrics.attach(loop)
            loop.start()
            server = ThreadedServer(create_app(loop, tokenizer=bundle.tokenizer, metrics=metrics), ready_timeout_s=900)
            url = server.url
            try:
                closed_loop_http(url + "/v1/completions", reqs, c, args.http_timeout)  # warm-up (compiles)
                outcomes, wall = closed_loop_http(url + "/v1/completions", reqs, c, args.http_timeout)
                engine_metrics = loop.engine.metrics  # both passes: what the scheduler chose
            finally:
                server.stop()
                loop.shutdown(5)
                # Free this server's programs: on CPU each holds ~500 memory maps, and a process may have
                # 65530 (vm.max_map_count); several fully warmed servers in one process would exceed it.
                jax.clear_caches()
            row[mode] = s = summarize(outcomes, wall)
            s.update(mean_verify=float(engine_metrics.mean_verify), tau=float(engine_metrics.tau))
            print(f"  {mode:6s} {s['tok_s']:8.1f} tok/s  TTFT p50/p99 {s['ttft_p50'] * 1e3:7.1f}/{s['ttft_p99'] * 1e3:7.1f} ms"
                  f"  ITL p50/p99 {s['itl_p50'] * 1e3:6.1f}/{s['itl_p99'] * 1e3:6.1f} ms  "
                  f"complete {s['ok']}/{s['requests']}  verified/round {s['mean_verify']:.2f}"
                  + (f"  errors: {s['errors']}" if s["errors"] else ""),
                  flush=True)
        rows.append(row)
    print_http_table(rows)
    return rows


def print_http_table(rows) -> None:
    print("\nover HTTP (SSE, loopback): tokens/s, time to first token and inter-token latency p50 / p99 (ms)")
    print(f"{'conc':>4} {'mode':>6} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'complete':>9} {'verify':>6}")
    for r in rows:
        for mode in MODES:
            s = r[mode]
            print(f"{r['concurrency']:>4} {mode:>6} {s['tok_s']:>8.1f} {s['ttft_p50'] * 1e3:>9.1f} "
                  f"{s['ttft_p99'] * 1e3:>9.1f} {s['itl_p50'] * 1e3:>8.1f} {s['itl_p99'] * 1e3:>8.1f} "
                  f"{s['ok']:>4}/{s['requests']:<4} {s.get('mean_verify', float('nan')):>6.2f}")
        print(f"{'':>4} {'async/plain':>15} {r['async']['tok_s'] / max(r['plain']['tok_s'], 1e-9):>8.2f}")
    print(f"({jax.devices()[0].platform.upper()} figures; closed loop over loopback HTTP, one timed pass after a warm-up; "
          "verify: drafts verified per request-round, both passes)")
