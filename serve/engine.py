"""The serving engine: a device-resident decode loop that dispatches ahead and reads back a round late.

    engine = Engine(model, weights, EngineConfig(max_slots=8, max_len=512, mode="async"), cost_table=table)
    rid = engine.submit(Request(prompt=[...], max_tokens=64, temperature=0.7, seed=1))
    for event in engine.stream():          # or: events = engine.step(), until engine.idle
        ...                                # Event(id, request_id, tokens (new ones), finish_reason)
    engine.cancel(rid)
    results = engine.generate([Request(...), ...])   # a convenience on top: submit all, drain, collect

State (`serve/decode_state.py`) lives on the device: backbone cache, draft state, anchors, confidence
lag and, per slot, sampling parameters, seed, token budget, stop ids and whether it still runs. Donated
jitted programs change it: admit (prefill only the joining rows), a speculative round or a plain step
(each with the stop / max_tokens / cache-end checks on device), evict (cancel). The host writes a slot
only when a request joins or is cancelled.

Overlap: each `step()` dispatches the next program before it reads the previous one's output (copied
to the host asynchronously), so the device always has queued work while the host does its
bookkeeping; a finish is seen by the host one round late, but the device stopped the row in the round
it finished. The host frees a slot early when the row is certain to have finished (its budget or the
cache end is reached even if every in-flight round emits only one token), so plain decoding and
max_tokens finishes cost no lag round.

The verify forward's width (static) is chosen on the host from what it knows, an upper bound of each
row's cap that the device then clips exactly:
  * "off":   every draft verified;  "fixed": `num_verify` drafts;
  * "sync":  Algorithm 1 inside the round (width 1 + the largest cap: the lengths are unknown beforehand);
  * "async": capacity C from the confidences two rounds back (their survivals scaled by the accepted /
             predicted ratio of the rounds served so far: `acceptance_scale`), computed on device and
             read back with the lag (width 1 + min(K, C)); when C = 0 it probes with a one-round
             verify-all round after 8, 16, .. 128 plain steps (reset when requests join);
In every mode a round with nothing to verify (width 1) runs the plain step program instead: the same
tokens without the draft's cost. The draft still needs those positions: the plain steps keep their
backbone taps in a buffer and the draft ingests them in one batched call (catch-up) before it next
proposes, or when `max_deferred_ingest` steps have piled up.
  * "plain": plain autoregressive decoding through the same loop (the baseline).
A bad request (empty prompt, token out of range, prompt longer than the cache, bad sampling params) is
refused by `submit` with a ValueError naming what is wrong (`generate` turns it into an error Result);
nothing else is affected.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import numbers
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from dspark_jax import spec_round as sr
from dspark_jax.errors import UserError
from dspark_jax.schedule import CostTable, width_buckets
from dspark_jax.serve import compiling
from dspark_jax.serve import decode_state as ds
from dspark_jax.serve import program_store
from dspark_jax.serve.request_check import Request, RequestError, check_request  # noqa: F401 (re-exported)
from dspark_jax.validation import ConfigError

MODES = ("off", "fixed", "sync", "async", "plain")
# Plain steps between the async engine's probes when the capacity is 0: doubling from a floor to the
# last. The floor is set by the cost table (`probe_interval_floor`): a probe is a full-width round, and
# at many slots it costs several plain steps.
_MIN_PROBE_INTERVAL, _MAX_PROBE_INTERVAL = 8, 512
# What probing may cost, as a fraction of plain decoding's time.
_PROBE_OVERHEAD = 0.02


def probe_interval_floor(table: CostTable | None, slots: int, k: int) -> int:
    """Fewest plain steps between two probes so that probing costs at most _PROBE_OVERHEAD of plain
    decoding. A probe takes 1 / SPS(slots x (K+1)) seconds where the plain step it replaces takes
    1 / SPS(slots); it is counted as emitting one token per row (what its drafts add is a bonus)."""
    if table is None:
        return _MIN_PROBE_INTERVAL
    plain, probe = (float(table.sps(slots * w)) for w in (1, k + 1))
    if probe <= 0.0:
        return _MAX_PROBE_INTERVAL
    extra = plain / probe - 1.0  # the probe's cost beyond a plain step, in plain steps
    return int(np.clip(np.ceil(extra / _PROBE_OVERHEAD), _MIN_PROBE_INTERVAL, _MAX_PROBE_INTERVAL))


@dataclasses.dataclass
class Result:
    id: str | int | None
    tokens: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    rounds: int = 0
    accepted: int = 0  # accepted draft tokens


@dataclasses.dataclass
class Event:
    """What happened to one request in one `step()`: new tokens and/or its finish."""

    id: int  # the engine's id (from submit)
    request_id: Any  # Request.id
    tokens: list[int]
    finish_reason: str | None = None  # None while it runs
    error: str | None = None
    result: Result | None = None  # with the finish: the whole request's Result


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 8
    max_len: int = 512
    mode: str = "off"
    num_verify: int | None = None  # for mode "fixed"
    min_gain: float = 0.0
    min_prompt_bucket: int = 16
    max_stop_tokens: int = 8
    progress: bool = True
    profile_on_start: bool = False  # sync/async without a table: measure one at start-up (slow)
    record_rounds: bool = False  # keep calibration records (raw confidence logits per verified row-round)
    # Rounds per dispatched program: more amortise the host's per-call cost, but a request that finishes
    # mid-call holds its slot (idle) until the call ends.
    rounds_per_call: int = 4
    # Plain steps of a speculative engine whose draft ingest waits for one batched catch-up (0: ingest in
    # every step, 16-29% of a plain step at the embedded sizes). Costs slots x this x taps memory.
    max_deferred_ingest: int = 32
    # When the programs compile: "eager" (all before the first dispatch), "background" or "lazy" (on first
    # dispatch). See serve/compiling.py; the default is $DSPARK_COMPILE, else "eager".
    compile: str = dataclasses.field(default_factory=compiling.default_policy)

    def __post_init__(self):
        # Types first (a str or float count would fail later inside a compile; bools are not counts;
        # NumPy scalars are fine: this is a Python API).
        def check(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise ConfigError(f"engine '{name}': expected {expected}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        check(self.mode in MODES, "mode", f"one of {MODES}")
        check(self.compile in compiling.POLICIES, "compile", f"one of {compiling.POLICIES}")
        for name, least in (("max_slots", 1), ("max_len", 2), ("min_prompt_bucket", 1), ("max_stop_tokens", 1),
                            ("rounds_per_call", 1), ("max_deferred_ingest", 0)):
            check(is_int(getattr(self, name)) and getattr(self, name) >= least, name, f"an integer >= {least}")
        check(self.num_verify is None or is_int(self.num_verify) and self.num_verify >= 0, "num_verify",
              "None or an integer >= 0")
        check(isinstance(self.min_gain, numbers.Real) and not isinstance(self.min_gain, bool)
              and math.isfinite(self.min_gain), "min_gain", "a finite number")
        for name in ("progress", "profile_on_start", "record_rounds"):
            check(isinstance(getattr(self, name), bool), name, "True or False")
        if self.max_deferred_ingest and self.max_deferred_ingest < self.rounds_per_call:
            raise ValueError(f"engine 'max_deferred_ingest': expected 0 or >= rounds_per_call "
                             f"({self.rounds_per_call}), got {self.max_deferred_ingest}")


@dataclasses.dataclass
class Metrics:
    """tau (tokens per request-round), per-position conditional acceptance, tokens/s."""

    block_size: int
    rounds: int = 0  # jitted rounds
    spec_rounds: int = 0  # of which speculative (the rest: plain steps)
    request_rounds: int = 0
    emitted: int = 0  # tokens emitted by rounds (tau counts these)
    verified: int = 0  # drafts verified (sum of l_r)
    first_tokens: int = 0  # tokens sampled right after prefill
    wall_s: float = 0.0
    host_s: float = 0.0  # host time inside step() not spent waiting for the device
    verified_at: np.ndarray = None  # rounds that verified position k with 1..k-1 accepted
    accepted_at: np.ndarray = None

    def __post_init__(self):
        self.verified_at = np.zeros(self.block_size, np.int64)
        self.accepted_at = np.zeros(self.block_size, np.int64)

    def record(self, num_verify: np.ndarray, num_accepted: np.ndarray, num_emitted: np.ndarray, active,
               speculative: bool = True):
        self.rounds += 1
        self.spec_rounds += int(speculative)
        self.request_rounds += int(active.sum())
        self.emitted += int(num_emitted[active].sum())
        self.verified += int(num_verify[active].sum())
        k = np.arange(1, self.block_size + 1)[None, :]
        reached = active[:, None] & (num_verify[:, None] >= k) & (num_accepted[:, None] >= k - 1)
        self.verified_at += reached.sum(axis=0)
        self.accepted_at += (reached & (num_accepted[:, None] >= k)).sum(axis=0)

    @property
    def tau(self) -> float:
        return self.emitted / max(self.request_rounds, 1)

    @property
    def mean_verify(self) -> float:
        """Drafts verified per request-round."""
        return self.verified / max(self.request_rounds, 1)

    @property
    def acceptance(self) -> np.ndarray:
        return np.where(self.verified_at > 0, self.accepted_at / np.maximum(self.verified_at, 1), np.nan)

    @property
    def tokens(self) -> int:
        return self.emitted + self.first_tokens

    @property
    def tokens_per_s(self) -> float:
        """All generated tokens (prefill's first token included) over the serving wall time."""
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def summary(self) -> dict:
        return {"tau": self.tau, "acceptance": [None if np.isnan(a) else float(a) for a in self.acceptance],
                "tokens_per_s": self.tokens_per_s, "rounds": self.rounds, "spec_rounds": self.spec_rounds,
                "emitted": self.emitted, "tokens": self.tokens, "mean_verify": self.mean_verify,
                "wall_s": self.wall_s}


@dataclasses.dataclass
class _Live:
    """Host bookkeeping of a request in a slot (what the host has READ so far, plus in-flight counts)."""

    id: int
    request: Request
    result: Result
    slot: int
    length: int  # committed positions read so far (prompt + tokens - 1)
    in_flight: int = 0  # dispatched rounds whose output is not read yet (each emits >= 1 token if running)


@dataclasses.dataclass
class _Pending:
    kind: str  # "admit" | "spec" | "plain"
    delta: ds.Delta  # leaves [rounds, ...]
    owners: tuple  # engine id per slot at dispatch (None = free)
    emitting: frozenset  # engine ids counted in their _Live.in_flight
    rounds: int  # rounds in the program (each emits >= 1 token for a running row)


def check_cost_table_fits(table: CostTable, slots: int, k: int) -> None:
    """A cost table is measured for one engine size; refuse one too small to run a plain step of every
    slot, and warn when it cannot cover the largest speculative step (verification is then capped)."""
    covered, largest = int(table.max_batch_tokens), slots * (k + 1)
    hint = f"measure one for this engine with `dspark profile --slots {slots}`"
    if covered < slots:
        raise UserError(f"cost table: max_batch_tokens {covered} is below the engine's {slots} slots (one plain "
                        f"step of every slot does not fit): it was measured for a smaller engine; {hint}")
    if covered < largest:
        warnings.warn(f"cost table: max_batch_tokens {covered} < {largest} ({slots} slots x (K + 1)): the scheduler "
                      f"will verify at most {covered - slots} drafts per round; {hint}", stacklevel=4)


def scheduling_table(model: sr.SpecModel, weights: sr.Weights, config: EngineConfig,
                     cost_table: CostTable | None) -> CostTable | None:
    """The cost table the sync / async scheduler runs on: the one given, or one measured now
    (`profile_on_start`), checked against this engine's size. The other modes schedule without one."""
    if config.mode not in ("sync", "async"):
        return cost_table
    if cost_table is None and config.profile_on_start:
        from dspark_jax.serve.profile import profile_cost_table  # noqa: PLC0415  (cycle: profile imports engine)

        cost_table = profile_cost_table(model, weights, slots=config.max_slots, max_len=config.max_len,
                                        progress=config.progress)
    if cost_table is None:
        raise ValueError(f"engine mode {config.mode!r} schedules against a measured cost table; none was "
                         "given. Measure one with `dspark profile`, set EngineConfig(profile_on_start=True), "
                         "or use mode 'off'.")
    check_cost_table_fits(cost_table, config.max_slots, model.block_size)
    return cost_table


def _static_count(fn) -> int:
    """Leading static arguments of a decode program (the model), which a compiled program is called without
    (as it is without the keyword options: all static)."""
    return 0 if fn is ds.EVICT else 1


class Engine:
    def __init__(self, model: sr.SpecModel, weights: sr.Weights, config: EngineConfig = EngineConfig(),
                 cost_table: CostTable | None = None, mesh=None):
        cost_table = scheduling_table(model, weights, config, cost_table)
        if config.mode == "fixed" and not (config.num_verify is not None
                                           and 0 <= config.num_verify <= model.block_size):
            raise ValueError(f"engine mode 'fixed' needs num_verify in [0, {model.block_size}], "
                             f"got {config.num_verify}")
        self.model, self.weights, self.config, self.cost_table = model, weights, config, cost_table
        self.mesh = mesh
        if mesh is not None:  # parameters by their logical names; the decode state by slot (at allocation)
            self.weights = jax.device_put(weights, ds.weight_shardings(model, weights, mesh))
        self.k = model.block_size
        self.vocab = model.backbone.vocab_size
        self.metrics = Metrics(self.k)
        self.records = _empty_records()
        self.width_buckets = width_buckets(self.k)  # the compiled verify widths
        self._state = None  # allocated on first use (the cache can be large)
        self._ids = itertools.count()
        self._queue: collections.deque[tuple[int, Request]] = collections.deque()
        self._live: dict[int, _Live] = {}
        self._owner: list[int | None] = [None] * config.max_slots  # slot -> engine id, for admission
        self._pending: collections.deque[_Pending] = collections.deque()
        self._events: list[Event] = []  # produced outside step() (cancel), handed out by the next step()
        self._capacity: int | None = None  # async: the last capacity read back (None = none yet)
        self._capacity_rows = 0  # async: how many rows the round that gave it ran
        self._plain_run = 0  # async: plain steps since the last speculative round
        self._probe_pending = False  # async: a probe dispatched whose capacity is not read yet
        self._probe_floor = probe_interval_floor(cost_table, config.max_slots, self.k)
        self._probe_every = self._probe_floor
        self._deferred = 0  # plain steps dispatched since the draft last caught up (a bound for every row)
        self._compiled: set[tuple] = set()  # program keys compiled (ahead of time) or dispatched
        self._policy = config.compile  # "lazy" once the set cannot fit (`_start_compiling`)
        self._started = False  # the policy's work began (at the first step with work)
        self._background: compiling.BackgroundCompiler | None = None
        self._state_shapes = None  # the state's shapes and shardings: what ahead-of-time compiles read
        # Programs kept on disk under their own key (serve/program_store.py): a second process loads them
        # without tracing. Single-device only; a mesh engine relies on JAX's persistent cache.
        self._store = program_store.current() if mesh is None else None
        self._executables: dict[tuple, jax.stages.Compiled] = {}  # key -> program from / for the store

    # ---- requests -----------------------------------------------------------------------------
    def validate(self, req: Request) -> Request:
        """-> `req` checked and normalised (`serve/request_check.py`); RequestError names a bad field."""
        return check_request(req, vocab=self.vocab, max_len=self.config.max_len,
                             max_stop_tokens=self.config.max_stop_tokens)

    def submit(self, request: Request) -> int:
        """Queue a request; -> its engine id. A bad request raises RequestError (a ValueError naming the
        field); nothing is queued."""
        checked = self.validate(request)
        rid = next(self._ids)
        self._queue.append((rid, checked))
        return rid

    def cancel(self, rid: int) -> bool:
        """Stop a queued or running request; its finish event ("cancelled") comes with the next step().
        -> False when the id is unknown or already finished."""
        for i, (qid, req) in enumerate(self._queue):
            if qid == rid:
                del self._queue[i]
                self._events.append(Event(rid, req.id, [], "cancelled", result=Result(req.id, [], "cancelled")))
                return True
        live = self._live.pop(rid, None)
        if live is None:
            return False
        if self._owner[live.slot] == rid:
            rows = np.zeros(self.config.max_slots, bool)
            rows[live.slot] = True
            self._execute(("evict",), rows=rows)
            self._owner[live.slot] = None
        live.result.finish_reason = "cancelled"
        self._events.append(Event(rid, live.request.id, [], "cancelled", result=live.result))
        return True

    def cancel_all(self) -> int:
        """Cancel every queued and running request; -> how many."""
        ids = [rid for rid, _ in self._queue] + list(self._live)
        return sum(self.cancel(rid) for rid in ids)

    @property
    def queued(self) -> int:
        """Requests submitted and waiting for a slot."""
        return len(self._queue)

    @property
    def active(self) -> int:
        """Requests holding a slot."""
        return len(self._live)

    @property
    def in_flight(self) -> int:
        """Dispatched programs whose output has not been read yet."""
        return len(self._pending)

    @property
    def acceptance_scale(self) -> float:
        """Accepted over predicted-accepted drafts on the traffic served so far (decayed; 1.0 = the
        confidences were calibrated for it): the async capacity multiplies survivals by it. Reads the
        device (blocking): for monitoring, not for the loop."""
        return 1.0 if self._state is None else float(ds.acceptance_scale(self._state.feedback))

    @property
    def idle(self) -> bool:
        return not (self._queue or self._live or self._pending or self._events)

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Admit waiting requests into free slots, dispatch the next program, read the previous one.
        -> the events the read produced (token deltas and finishes)."""
        t0 = time.perf_counter()
        events, self._events = self._events, []
        with self._mesh_context():
            if self._state is None:
                self._state = self._allocate()
            if not self._started and (self._queue or self._live):
                self._start_compiling()
            self._admit_waiting()
            dispatched = self._dispatch_round()
            waited = 0.0
            while len(self._pending) > (1 if dispatched else 0):
                waited += self._read(self._pending.popleft(), events)
        self.metrics.host_s += time.perf_counter() - t0 - waited
        return events

    def warm_up(self, *, progress: bool = False) -> int:
        """Compile every program this engine can dispatch that is not compiled yet (ahead of time, in
        parallel; nothing runs), so that no request ever waits for a compile (a server is ready only
        after this). -> how many programs the engine has. Only call it while idle."""
        if not self.idle:
            raise RuntimeError("warm_up: the engine is serving requests")
        with self._mesh_context():
            if self._state is None:
                self._state = self._allocate()
            self._compile_missing(progress)
        return len(self.programs())

    # ---- the programs -------------------------------------------------------------------------
    # A program is named by a key; `_call(key)` gives the jitted function and its arguments, and both the
    # dispatcher (`_execute`) and the compilers (`_compile`) go through it, so a program compiled ahead of
    # time is exactly the one dispatched later (JAX's jit cache then serves the call without a compile).
    #   ("admit", J, P)                 J joining rows (padded), prompts padded to P
    #   ("plain", rounds, ingest_draft)
    #   ("spec", rounds, width, mode, filtering)
    #   ("catch_up", width)
    #   ("evict",)
    # With a program store, the dispatcher calls the stored executable (`_executables`) instead.
    def programs(self) -> list[tuple]:
        """Every program the dispatcher can pick, in the order a first request needs them (admits by
        size, the plain steps, catch-ups, then the speculative rounds narrow to wide)."""
        cfg = self.config
        calls = sorted({1, cfg.rounds_per_call})
        out = [("admit", j, p) for j, p in self._admit_buckets()]
        if cfg.mode == "plain":
            return out + [("plain", r, False) for r in calls] + [("evict",)]
        # A speculative engine's plain steps keep the draft's context (into the deferral buffer, or now).
        out += [("plain", r, True) for r in calls]
        if cfg.max_deferred_ingest:
            out += [("catch_up", w) for w in sorted({self._catch_up_width(n)
                                                      for n in range(1, cfg.max_deferred_ingest + 1)})]
        modes = {"off": [("fixed", calls)], "fixed": [("fixed", calls)], "sync": [("sync", calls)],
                 "async": [("fixed", [1]), ("async", calls)]}[cfg.mode]  # async probes: one fixed round
        out += [("spec", r, w, m, f) for f in (False, True) for m, rs in modes for w in self.width_buckets for r in rs]
        return out + [("evict",)]

    def _admit_buckets(self) -> list[tuple[int, int]]:
        """(joining rows J, padded prompt length P) of each admit shape."""
        cfg = self.config
        rows = sorted({ds.pow2_at_least(n) for n in range(1, cfg.max_slots + 1)})
        lengths = sorted({ds.prompt_bucket(n, cfg.max_len, cfg.min_prompt_bucket) for n in range(1, cfg.max_len - 1)})
        return [(j, p) for j in rows for p in lengths]

    def _joining(self, slots, requests) -> ds.Joining:
        cfg = self.config
        return ds.joining_rows(slots, [list(r.prompt) for r in requests], requests, cfg.max_slots, cfg.max_len,
                               cfg.max_stop_tokens, cfg.min_prompt_bucket)

    def _call(self, key: tuple, state=None, rows=None):
        """-> (jitted function, args, kwargs) of program `key` on `state` (default: the engine's); `rows`
        is an admit's Joining or an evict's bool[slots] (default: a stand-in of the right shape)."""
        cfg = self.config
        state = self._state if state is None else state
        kind = key[0]
        if kind == "admit":
            if rows is None:  # a stand-in of the bucket's shape: every row points at the padding slot
                _, j, p = key
                dummy = Request([0] * p, max_tokens=1)
                rows = self._joining([cfg.max_slots] * j, [dummy] * j)
            return ds.ADMIT, (self.model, self.weights, state, jax.device_put(rows)), {"max_len": cfg.max_len}
        if kind == "plain":
            _, rounds, ingest = key
            return ds.PLAIN_ROUNDS, (self.model, self.weights, state), dict(rounds=rounds, max_len=cfg.max_len,
                                                                            ingest_draft=ingest)
        if kind == "spec":
            _, rounds, width, mode, filtering = key
            return ds.SPEC_ROUNDS, (self.model, self.weights, state, self.cost_table), dict(
                rounds=rounds, max_len=cfg.max_len, width=width, mode=mode, num_verify=self._num_verify(mode),
                min_gain=cfg.min_gain, filtering=filtering)
        if kind == "catch_up":
            return ds.CATCH_UP, (self.model, self.weights, state), {"width": key[1]}
        if kind == "evict":
            rows = np.zeros(cfg.max_slots, bool) if rows is None else rows
            return ds.EVICT, (state, jax.device_put(rows)), {}
        raise ValueError(f"unknown program {key!r}")

    def _execute(self, key: tuple, rows=None):
        """Dispatch program `key` on the engine's state; -> its output besides the new state."""
        if self._store is not None and key not in self._executables:
            self._compile(key)  # from the store, else compiled now and stored (lazy, or needed at once)
        fn, args, kwargs = self._call(key, rows=rows)
        self._compiled.add(key)  # compiled now if it was not (lazy, or a program the dispatcher needed)
        program = self._executables.get(key)
        out = fn(*args, **kwargs) if program is None else program(*args[_static_count(fn):])
        if key[0] in ("evict", "catch_up"):
            self._state = out
            return None
        self._state, delta = out
        return delta

    def _compile(self, key: tuple) -> None:
        """Compile program `key` ahead of time (nothing runs). The state's shapes stand in for the state,
        which the dispatcher may be donating meanwhile."""
        with self._mesh_context():
            fn, args, kwargs = self._call(key, state=self._state_shapes)
            if self._store is None:
                fn.lower(*args, **kwargs).compile()  # into JAX's cache, which the jitted call then hits
            else:
                self._executables[key] = self._stored_program(fn, args, kwargs)
        self._compiled.add(key)

    def _stored_program(self, fn, args: tuple, kwargs: dict) -> jax.stages.Compiled:
        """The program of `fn` on `args` from the store (no trace, no lowering), else compiled and stored."""
        n = _static_count(fn)
        key = program_store.program_key(fn.__name__, (args[:n], sorted(kwargs.items())), args[n:])
        program = self._store.load(key)
        if program is None:
            program = fn.lower(*args, **kwargs).compile()
            self._store.save(key, program)
        return program

    def _compile_missing(self, progress: bool) -> None:
        missing = [k for k in self.programs() if k not in self._compiled]
        bar = tqdm(total=len(missing), desc="compile", unit="program", disable=not progress or not missing)
        compiling.compile_all(missing, self._compile, progress=bar.update)
        bar.close()

    def _start_compiling(self) -> None:
        """At the first dispatch: the compile policy's work (serve/compiling.py)."""
        self._started = True
        policy, programs = self._policy, self.programs()
        if policy != "lazy" and not compiling.fits_in_memory_maps(len(programs) - len(self._compiled)):
            # Several engines' full program sets in one process (benches, demos): XLA:CPU would abort.
            warnings.warn(f"compile policy {policy!r}: this engine's {len(programs)} programs would not fit "
                          "in the process's memory maps (vm.max_map_count) beside the programs compiled so far; "
                          "compiling each on first use instead (call jax.clear_caches() between engines)",
                          RuntimeWarning, stacklevel=3)
            self._policy = policy = "lazy"
        if policy == "eager":
            self._compile_missing(self.config.progress)
        elif policy == "background":
            self._background = compiling.BackgroundCompiler(programs, self._compile,
                                                            done=self._compiled.__contains__)

    def _ready(self, key: tuple) -> bool:
        """Whether dispatching `key` now costs no compile (always "yes" for the lazy policy, which accepts
        the compile)."""
        return self._policy == "lazy" or key in self._compiled

    def close(self, wait: bool = True) -> None:
        """Stop a background compiler at its next program (`wait`: until it has; the engine stays usable:
        what is missing then compiles on dispatch)."""
        if self._background is not None:
            self._background.stop(wait=wait)

    def _mesh_context(self):
        # The mesh is the context of every trace: the Pallas kernels run inside shard_map over it.
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _allocate(self) -> ds.DecodeState:
        cfg = self.config
        deferred = 0 if cfg.mode == "plain" else cfg.max_deferred_ingest
        state = ds.init(self.model, cfg.max_slots, cfg.max_len, cfg.max_stop_tokens, deferred)
        if self.mesh is not None:
            state = jax.device_put(state, ds.state_shardings(self.model, state, cfg.max_len, self.mesh))
        # What an ahead-of-time compile must match for the call to hit the same executable: the dtypes with
        # weak_type, and the sharding only when the state is placed on a mesh (committed arrays). An
        # uncommitted state's call leaves the sharding unspecified; naming it at lowering is another program.
        placed = self.mesh is not None
        self._state_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.sharding if placed else None, weak_type=x.weak_type), state)
        return state

    def stream(self) -> Iterator[Event]:
        """Events until every submitted request has finished."""
        while not self.idle:
            yield from self.step()

    def generate(self, requests: Sequence[Request],
                 on_result: Callable[[int, Result], None] | None = None,
                 on_tokens: Callable[[int, list[int]], bool] | None = None) -> list[Result]:
        """Serve `requests` to completion; results in request order (bad requests: finish_reason "error").
        `on_result(i, result)` is called as each request finishes (a bad one at once), e.g. to write it.
        `on_tokens(i, new_tokens)` sees each request's tokens as they come; True stops the request there
        (e.g. its text reached a stop string): it finishes "stop" with the tokens emitted so far."""
        results: list[Result | None] = [None] * len(requests)
        index = {}

        def done(i: int, res: Result) -> None:
            results[i] = res
            if on_result is not None:
                on_result(i, res)

        for i, req in enumerate(requests):
            try:
                index[self.submit(req)] = i
            except RequestError as err:
                done(i, Result(getattr(req, "id", None), [], "error", str(err)))
        total = sum(q.max_tokens for _, q in self._queue)
        bar = tqdm(total=total, desc=f"dspark {self.config.mode}", unit="tok", disable=not self.config.progress)
        mine = {rid: Result(requests[i].id, [], "") for rid, i in index.items()}
        stopped: set[int] = set()  # stopped by on_tokens
        t0 = time.perf_counter()
        for ev in self.stream():
            res = mine.get(ev.id)
            if res is None:
                continue
            res.tokens += ev.tokens
            bar.update(len(ev.tokens))
            if on_tokens is not None and ev.tokens and ev.id not in stopped and on_tokens(index[ev.id], ev.tokens):
                stopped.add(ev.id)
                if not ev.finish_reason:
                    self.cancel(ev.id)  # its "cancelled" event comes with the next step
            if ev.finish_reason:
                res.finish_reason, res.error = ("stop" if ev.id in stopped else ev.finish_reason), ev.error
                res.rounds, res.accepted = ev.result.rounds, ev.result.accepted
                done(index[ev.id], res)
                del mine[ev.id]  # one result per request
        bar.close()
        self.metrics.wall_s += time.perf_counter() - t0
        return results

    # ---- admission ----------------------------------------------------------------------------
    def _admit_waiting(self) -> None:
        free = [s for s in range(self.config.max_slots) if self._owner[s] is None]
        joining = []
        while free and self._queue:
            rid, req = self._queue.popleft()
            s = free.pop(0)
            self._owner[s] = rid
            # length = prompt + tokens - 1, as the device counts: admission commits the prompt, and
            # its first token (counted +1 when read) is the next round's uncommitted anchor.
            self._live[rid] = _Live(rid, req, Result(req.id, [], ""), s, len(req.prompt) - 1)
            joining.append(self._live[rid])
        if not joining:
            return
        self._probe_every = self._probe_floor  # new rows: their confidences are unknown, look again soon
        if not any(lv.id not in {j.id for j in joining} for lv in self._live.values()):
            # Nobody else runs: the last capacity described other requests, and no row has deferred
            # positions (admit resets them). A fresh start also serves the same requests the same way
            # as the previous time, so the programs it runs are the ones already compiled.
            # A capacity of 0 read on as many rows stays: at the same batch size verifying did not pay
            # (the cost table's economics are per batch size), so the new rows start on plain steps and
            # are probed after the floor of plain steps, as rows joining a running batch are. A probe at
            # once would cost a full-width round per call for nothing (batch 8 on this CPU: 3% of a call).
            keep = self._capacity == 0 and self._capacity_rows == len(joining)
            self._capacity = 0 if keep else None
            self._plain_run, self._deferred = 0, 0
        rows = self._joining([lv.slot for lv in joining], [lv.request for lv in joining])
        delta = self._execute(("admit", *rows.prompt.shape), rows=rows)  # waits for its compile if need be
        self._push("admit", delta, 1, [lv.id for lv in joining])

    # ---- rounds -------------------------------------------------------------------------------
    def _dispatch_round(self) -> bool:
        running = [lv for lv in self._live.values() if self._owner[lv.slot] == lv.id and not self._surely_done(lv)]
        if not running:
            return False
        cfg = self.config
        # A full call only when no row is certain to finish inside it (nothing then idles on a finished
        # row); else one round. Two call lengths keep the compiled programs few.
        full = min(self._rounds_left(lv) for lv in running) >= cfg.rounds_per_call
        rounds = cfg.rounds_per_call if full else 1
        if cfg.mode == "plain":
            self._dispatch_plain(rounds, ingest_draft=False)
            return True
        most = max(self._cap_bound(lv) for lv in running)
        probe = False
        if cfg.mode == "fixed":
            most = min(most, cfg.num_verify)
        elif cfg.mode == "async":
            # No capacity known yet, or 0 for a while: a one-round probe whose confidences are what the
            # next decision needs. It verifies every draft (a width fixed in advance: lossless), so it
            # emits tau tokens for its draft pass instead of one.
            # While the first probe's answer is still in flight (the loop reads a program late), the
            # capacity counts as 0: a second probe would only repeat the question.
            awaiting = self._capacity is None and self._probe_pending
            probe = not awaiting and (self._capacity is None
                                      or (self._capacity == 0 and self._plain_run >= self._probe_every))
            most = most if probe else min(most, self._capacity or 0)
            rounds = 1 if probe or awaiting else rounds  # awaiting: one plain step, then the answer is read
        key = None
        if most > 0 or probe:
            width = next(w for w in self.width_buckets if w >= 1 + most)
            mode = "fixed" if cfg.mode in ("off", "fixed") or probe else cfg.mode
            filtering = any(lv.request.top_k > 0 or lv.request.top_p < 1 for lv in running)
            key = self._compiled_spec(("spec", rounds, width, mode, filtering))
        if key is None:
            # Nothing to verify (or, compiling in the background, no compiled program that can): the
            # plain step program (a width-1 round's tokens, without the draft's cost); the draft ingests
            # the new positions later, in one catch-up.
            self._plain_run += self._dispatch_plain(rounds, ingest_draft=True)
            return True
        self._probe_pending = self._probe_pending or probe
        self._plain_run = 0
        self._catch_up()
        self._push("spec", self._execute(key), key[1])
        return True

    def _compiled_spec(self, key: tuple) -> tuple | None:
        """The speculative program to dispatch for `key` without waiting for a compile: `key`, else the same
        round at a wider compiled width (the device clips every row to its cap: the same tokens), else one
        round per call; None when none is compiled yet (then a plain step serves) or the draft's catch-up
        is not compiled. The lazy policy takes `key` as it is."""
        if self._ready(key):
            return key if self._catch_up_ready() else None
        _, rounds, width, mode, filtering = key
        for r in sorted({rounds, 1}, reverse=True):
            for w in self.width_buckets:
                alt = ("spec", r, w, mode, filtering)
                if w >= width and alt in self._compiled and self._catch_up_ready():
                    return alt
        return None

    def _catch_up_ready(self) -> bool:
        return not self._deferred or self._ready(("catch_up", self._catch_up_width(self._deferred)))

    def _num_verify(self, mode: str) -> int | None:
        """Drafts per row a "fixed" round verifies (the device clips to each row's cap and the width):
        the configured count in mode "fixed", else (mode "off", an async probe) all K."""
        if mode != "fixed":
            return None
        return self.config.num_verify if self.config.mode == "fixed" else self.k

    def _dispatch_plain(self, rounds: int, ingest_draft: bool) -> int:
        """-> the rounds dispatched."""
        if not self._ready(("plain", rounds, ingest_draft)) and self._ready(("plain", 1, ingest_draft)):
            rounds = 1  # compiling in the background: one round per call until the longer call is compiled
        if ingest_draft and self.config.max_deferred_ingest:
            if self._deferred + rounds > self.config.max_deferred_ingest:
                self._catch_up()
            self._deferred += rounds
        self._push("plain", self._execute(("plain", rounds, ingest_draft)), rounds)
        return rounds

    def _catch_up(self) -> None:
        """The draft ingests the positions plain steps deferred (before it proposes or the buffer fills)."""
        if self._deferred:
            # Read only as many buffer rows as were written (a power of two: few programs).
            self._execute(("catch_up", self._catch_up_width(self._deferred)))
            self._deferred = 0

    def _catch_up_width(self, deferred: int) -> int:
        """Buffer rows a catch-up reads: as many as were written, as a power of two (few programs)."""
        return min(ds.pow2_at_least(deferred), self.config.max_deferred_ingest)

    def _push(self, kind: str, delta: ds.Delta, rounds: int, emitting: list[int] | None = None) -> None:
        """Queue a dispatched program's output for reading; `emitting` (default: every owned slot) are
        the requests each of its `rounds` emits at least one token for while they run."""
        for x in jax.tree.leaves(delta):
            x.copy_to_host_async()
        emitting = [rid for rid in self._owner if rid is not None] if emitting is None else emitting
        for rid in emitting:
            self._live[rid].in_flight += rounds
        self._pending.append(_Pending(kind, delta, tuple(self._owner), frozenset(emitting), rounds))

    def _surely_done(self, lv: _Live) -> bool:
        """The row finished on device whatever the unread programs emitted (each emits >= 1 token)."""
        emitted = len(lv.result.tokens) + lv.in_flight
        return emitted >= lv.request.max_tokens or lv.length + lv.in_flight + 2 >= self.config.max_len

    def _rounds_left(self, lv: _Live) -> int:
        """Rounds the row surely runs before its budget or the cache end (each emits >= 1 token)."""
        left = lv.request.max_tokens - len(lv.result.tokens) - lv.in_flight
        room = self.config.max_len - 2 - (lv.length + lv.in_flight)
        return min(left, room)

    def _cap_bound(self, lv: _Live) -> int:
        """An upper bound of the drafts the row may verify next (the device clips to the exact cap)."""
        left = lv.request.max_tokens - len(lv.result.tokens) - lv.in_flight
        room = self.config.max_len - (lv.length + lv.in_flight) - 2
        return max(0, min(self.k, left - 1, room))

    # ---- read-back ----------------------------------------------------------------------------
    def _read(self, pending: _Pending, events: list[Event]) -> float:
        """Apply one program's output (each of its rounds in order); -> seconds spent waiting for the device."""
        t0 = time.perf_counter()
        deltas = jax.device_get(pending.delta)
        waited = time.perf_counter() - t0
        for r in range(pending.rounds):
            self._apply(pending, jax.tree.map(lambda x: x[r], deltas), events)
        for rid in pending.emitting:
            if rid in self._live:
                self._live[rid].in_flight -= pending.rounds
        return waited

    def _apply(self, pending: _Pending, d: ds.Delta, events: list[Event]) -> None:
        active = d.num_emitted > 0
        drafted = bool(d.drafted)  # False for an async round whose capacity was 0: a plain step on device
        if pending.kind == "admit":
            self.metrics.first_tokens += int(active.sum())
        else:
            self.metrics.record(d.num_verify, d.num_accepted, d.num_emitted, active, drafted)
        if drafted and self.config.record_rounds:
            for name, col in (("logits", d.conf_logits), ("num_verified", d.num_verify),
                              ("num_accepted", d.num_accepted)):
                self.records[name].append(col[active])
        if pending.kind == "spec" and self.config.mode == "async":
            self._update_capacity(int(d.capacity), rows=int(active.sum()))
        for s in np.flatnonzero(active | (d.finish > 0)):
            rid = pending.owners[s]
            lv = self._live.get(rid)
            if lv is None:  # a free slot, or cancelled while this program was in flight
                continue
            n = int(d.num_emitted[s])
            toks = d.tokens[s, :n].tolist()
            lv.result.tokens += toks
            lv.length += n
            if pending.kind != "admit":
                lv.result.rounds += 1
                lv.result.accepted += int(d.num_accepted[s])
            reason = ds.FINISH_REASONS.get(int(d.finish[s]))
            if reason:
                lv.result.finish_reason = reason
                del self._live[rid]
                if self._owner[lv.slot] == rid:
                    self._owner[lv.slot] = None
            events.append(Event(rid, lv.request.id, toks, reason, result=lv.result if reason else None))

    def _update_capacity(self, capacity: int, rows: int) -> None:
        """Async: the capacity read back from a round of `rows` rows; a zero after a probe doubles the
        probe interval (bounded)."""
        if capacity == 0 and self._capacity == 0:
            self._probe_every = min(2 * self._probe_every, _MAX_PROBE_INTERVAL)
        elif capacity > 0:
            self._probe_every = self._probe_floor
        self._capacity, self._capacity_rows = capacity, rows
        self._probe_pending = False

    def take_records(self) -> dict[str, np.ndarray]:
        """Calibration records kept since the last call (EngineConfig.record_rounds), one row per active
        request-round of a speculative round: "logits" f32[N, K] raw confidence logits, "num_verified"
        i32[N], "num_accepted" i32[N] (the inputs of `calibration.fit_sts`)."""
        out = {name: np.concatenate(cols) if cols else np.zeros((0, self.k) if name == "logits" else (0,))
               for name, cols in self.records.items()}
        self.records = _empty_records()
        return out


def _empty_records() -> dict[str, list]:
    return {"logits": [], "num_verified": [], "num_accepted": []}
