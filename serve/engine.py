"""The serving engine: request slots, continuous batching, bucketed jitted rounds, metrics.

    engine = Engine(model, weights, EngineConfig(max_slots=8, max_len=512, mode="async"), cost_table=table)
    results = engine.generate([Request(prompt=[...], max_tokens=64, temperature=0.7, seed=1), ...])

Requests join free slots between rounds and leave when they hit max_tokens, a stop token or the
cache end. A bad request (empty prompt, token out of range, prompt longer than the cache, bad
sampling params) is answered with an error Result naming what is wrong; the others are served.

Compiled sizes are chosen on the host before each round: prompts are padded to a power-of-two bucket,
and the verify forward's width (1 + the most drafts any row may verify) follows the mode:
  * "off":   every draft verified (width K+1);  "fixed": `num_verify` drafts (width 1+num_verify);
  * "sync":  Algorithm 1 inside the round (width K+1: the host cannot know the lengths beforehand);
  * "async": capacity C from the confidences of two rounds ago, known on the host before the round
             (width 1 + min(K, C)), admission by current survival inside the round;
  * "plain": no draft at all, plain autoregressive decoding (the baseline).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from dspark_jax import sampling
from dspark_jax import spec_round as sr
from dspark_jax.schedule import CostTable, async_capacity

MODES = ("off", "fixed", "sync", "async", "plain")

# Module-level so every Engine over the same (hashable) SpecModel shares compiled programs.
_START = jax.jit(sr.start, static_argnums=0)
_ROUND = jax.jit(sr.spec_round, static_argnums=0, static_argnames=("width", "mode", "filtering"))
_PLAIN = jax.jit(sr.plain_step, static_argnums=0)
_CAPACITY = jax.jit(async_capacity)


@dataclasses.dataclass
class Request:
    prompt: Sequence[int]
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: Sequence[int] = ()
    id: str | int | None = None


@dataclasses.dataclass
class Result:
    id: str | int | None
    tokens: list[int]
    finish_reason: str  # "stop" | "length" | "error"
    error: str | None = None
    rounds: int = 0
    accepted: int = 0  # accepted draft tokens


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_slots: int = 8
    max_len: int = 512
    mode: str = "off"
    num_verify: int | None = None  # for mode "fixed"
    min_gain: float = 0.0
    min_prompt_bucket: int = 16
    progress: bool = True
    profile_on_start: bool = False  # sync/async without a table: measure one at start-up (slow)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"engine 'mode': expected one of {MODES}, got {self.mode!r}")
        if self.max_slots < 1 or self.max_len < 2:
            raise ValueError(f"engine needs max_slots >= 1 and max_len >= 2, got {self.max_slots}, {self.max_len}")


@dataclasses.dataclass
class Metrics:
    """tau (tokens per request-round), per-position conditional acceptance, tokens/s."""

    block_size: int
    rounds: int = 0  # jitted rounds
    request_rounds: int = 0
    emitted: int = 0  # tokens emitted by rounds (tau counts these)
    first_tokens: int = 0  # tokens sampled right after prefill
    wall_s: float = 0.0
    verified_at: np.ndarray = None  # rounds that verified position k with 1..k-1 accepted
    accepted_at: np.ndarray = None

    def __post_init__(self):
        self.verified_at = np.zeros(self.block_size, np.int64)
        self.accepted_at = np.zeros(self.block_size, np.int64)

    def record(self, num_verify: np.ndarray, num_accepted: np.ndarray, num_emitted: np.ndarray, active):
        self.rounds += 1
        self.request_rounds += int(active.sum())
        self.emitted += int(num_emitted[active].sum())
        for k in range(1, self.block_size + 1):
            reached = active & (num_verify >= k) & (num_accepted >= k - 1)
            self.verified_at[k - 1] += int(reached.sum())
            self.accepted_at[k - 1] += int((reached & (num_accepted >= k)).sum())

    @property
    def tau(self) -> float:
        return self.emitted / max(self.request_rounds, 1)

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
                "tokens_per_s": self.tokens_per_s, "rounds": self.rounds, "emitted": self.emitted,
                "tokens": self.tokens,
                "wall_s": self.wall_s}


@dataclasses.dataclass
class _Slot:
    index: int
    request: Request
    result: Result
    length: int  # committed positions (prompt + emitted - 1)
    request_index: int = -1


class Engine:
    def __init__(self, model: sr.SpecModel, weights: sr.Weights, config: EngineConfig = EngineConfig(),
                 cost_table: CostTable | None = None):
        if config.mode in ("sync", "async") and cost_table is None and config.profile_on_start:
            from dspark_jax.serve.profile import profile_cost_table

            cost_table = profile_cost_table(model, weights, slots=config.max_slots, max_len=config.max_len,
                                            progress=config.progress)
        if config.mode in ("sync", "async") and cost_table is None:
            raise ValueError(f"engine mode {config.mode!r} schedules against a measured cost table; none was "
                             "given. Measure one with `dspark profile`, set EngineConfig(profile_on_start=True), or use mode 'off'.")
        if config.mode == "fixed" and not (config.num_verify is not None
                                           and 0 <= config.num_verify <= model.block_size):
            raise ValueError(f"engine mode 'fixed' needs num_verify in [0, {model.block_size}], "
                             f"got {config.num_verify}")
        self.model, self.weights, self.config, self.cost_table = model, weights, config, cost_table
        self.k = model.block_size
        self.vocab = model.backbone.vocab_size
        self._start, self._round, self._plain, self._capacity = _START, _ROUND, _PLAIN, _CAPACITY
        self.metrics = Metrics(self.k)
        # Compiled verify widths: powers of two below K+1, and K+1 (few compiles, little padding).
        self.width_buckets = sorted({1 << i for i in range(self.k.bit_length()) if 1 << i <= self.k} | {self.k + 1})

    # ---- request validation -------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        """Raise ValueError naming the first thing wrong with `req`."""
        prompt = list(req.prompt) if req.prompt is not None else []
        if not prompt:
            raise ValueError("request 'prompt': empty; expected at least one token")
        bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or not 0 <= int(t) < self.vocab]
        if bad:
            raise ValueError(f"request 'prompt': token ids must be integers in [0, {self.vocab}), got {bad[:5]}")
        if len(prompt) + 1 >= self.config.max_len:
            raise ValueError(f"request 'prompt': {len(prompt)} tokens does not fit the cache "
                             f"(max_len={self.config.max_len} leaves room for {self.config.max_len - 2})")
        if not isinstance(req.max_tokens, (int, np.integer)) or req.max_tokens < 1:
            raise ValueError(f"request 'max_tokens': expected an integer >= 1, got {req.max_tokens!r}")
        if not isinstance(req.seed, (int, np.integer)) or not 0 <= int(req.seed) < 2 ** 32:
            raise ValueError(f"request 'seed': expected an integer in [0, 2^32), got {req.seed!r}")
        bad_stop = [t for t in req.stop_tokens if not 0 <= int(t) < self.vocab]
        if bad_stop:
            raise ValueError(f"request 'stop_tokens': ids must be in [0, {self.vocab}), got {bad_stop}")
        sampling.validate([req.temperature], [req.top_k], [req.top_p])

    # ---- the serving loop ---------------------------------------------------------------------
    def generate(self, requests: Sequence[Request]) -> list[Result]:
        cfg = self.config
        results: list[Result | None] = [None] * len(requests)
        queue = []
        for i, req in enumerate(requests):
            try:
                self.validate(req)
                queue.append(i)
            except (ValueError, TypeError) as err:
                results[i] = Result(req.id, [], "error", str(err))
        state = sr.init_state(self.model, cfg.max_slots, cfg.max_len)
        slots: list[_Slot | None] = [None] * cfg.max_slots
        conf_hist = np.zeros((2, cfg.max_slots, self.k), np.float32)
        total = sum(requests[i].max_tokens for i in queue)
        bar = tqdm(total=total, desc=f"dspark {cfg.mode}", unit="tok", disable=not cfg.progress)
        t0 = time.perf_counter()
        while queue or any(slots):
            free = [s for s in range(cfg.max_slots) if slots[s] is None]
            joining = [(s, queue.pop(0)) for s in free[:len(queue)]]
            if joining:
                state = self._admit(state, slots, joining, requests, results, bar, conf_hist)
            if not any(slots):
                continue
            state, out = self._step(state, slots, conf_hist)
            for s, slot in enumerate(slots):
                if slot is None:
                    continue
                n = int(out["num_emitted"][s])
                slot.result.rounds += 1
                slot.result.accepted += int(out["num_accepted"][s])
                slot.length += n
                self._append(slot, out["tokens"][s, :n].tolist(), bar)
                if slot.result.finish_reason:
                    results[slot.request_index] = slot.result
                    slots[s] = None
                    conf_hist[:, s] = 0.0
        bar.close()
        self.metrics.wall_s += time.perf_counter() - t0
        return results

    def _admit(self, state, slots, joining, requests, results, bar, conf_hist):
        cfg = self.config
        b = cfg.max_slots
        longest = max(len(requests[i].prompt) for _, i in joining)
        bucket = max(cfg.min_prompt_bucket, 1 << (longest - 1).bit_length())
        prompt = np.zeros((b, bucket), np.int32)
        plen = np.ones((b,), np.int32)
        mask = np.zeros((b,), bool)
        for s, i in joining:
            req = requests[i]
            prompt[s, :len(req.prompt)] = req.prompt
            plen[s] = len(req.prompt)
            mask[s] = True
            slots[s] = _Slot(s, req, Result(req.id, [], ""), len(req.prompt), i)
        params, seeds = self._slot_arrays(slots)
        state, first = self._start(self.model, self.weights, state, jnp.asarray(prompt), jnp.asarray(plen),
                                   jnp.asarray(mask), params, seeds)
        first = np.asarray(first)
        self.metrics.first_tokens += len(joining)
        for s, i in joining:
            self._append(slots[s], [int(first[s])], bar)
            if slots[s].result.finish_reason:
                results[i] = slots[s].result
                slots[s] = None
        return state

    def _slot_arrays(self, slots):
        b = self.config.max_slots
        t, k, p, seeds = np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32), np.zeros(b, np.uint32)
        for s, slot in enumerate(slots):
            if slot is not None:
                r = slot.request
                t[s], k[s], p[s], seeds[s] = r.temperature, r.top_k, r.top_p, r.seed
        return sampling.SamplingParams(jnp.asarray(t), jnp.asarray(k), jnp.asarray(p)), jnp.asarray(seeds)

    def _step(self, state, slots, conf_hist):
        cfg = self.config
        active = np.array([s is not None for s in slots])
        params, seeds = self._slot_arrays(slots)
        if cfg.mode == "plain":
            state, token = self._plain(self.model, self.weights, state, params, seeds, jnp.asarray(active))
            token = np.asarray(token)
            out = {"tokens": token[:, None], "num_emitted": active.astype(np.int32),
                   "num_accepted": np.zeros_like(token), "num_verify": np.zeros_like(token)}
            self.metrics.record(out["num_verify"], out["num_accepted"], out["num_emitted"], active)
            return state, out
        # Drafts a row may verify: not past its max_tokens, not past the cache end.
        cap = np.zeros(cfg.max_slots, np.int32)
        for s, slot in enumerate(slots):
            if slot is not None:
                left = slot.request.max_tokens - len(slot.result.tokens)
                cap[s] = max(0, min(self.k, left - 1, cfg.max_len - slot.length - 2))
        width, num_verify = self._width(active, cap, conf_hist)
        filtering = any(s is not None and (s.request.top_k > 0 or s.request.top_p < 1) for s in slots)
        mode = {"off": "fixed", "fixed": "fixed"}.get(cfg.mode, cfg.mode)
        state, out = self._round(self.model, self.weights, state, params, seeds, jnp.asarray(active), width=width,
                                 mode=mode, num_verify=num_verify, draft_cap=jnp.asarray(cap),
                                 table=self.cost_table, min_gain=cfg.min_gain, filtering=filtering)
        out = jax.device_get(out._asdict())
        conf_hist[1] = conf_hist[0]
        conf_hist[0] = np.where(active[:, None], out["conf"], 0.0)
        self.metrics.record(out["num_verify"], out["num_accepted"], out["num_emitted"], active)
        return state, out

    def _width(self, active, cap, conf_hist):
        """(compiled verify width, fixed lengths or None): the smallest bucket that holds 1 + the most
        drafts any row may verify this round."""
        cfg = self.config
        most = int(cap[active].max()) if active.any() else 0
        fixed = None
        if cfg.mode == "fixed":
            most = min(cfg.num_verify, most)
            fixed = jnp.full((cfg.max_slots,), most, jnp.int32)
        elif cfg.mode == "off":
            fixed = jnp.full((cfg.max_slots,), most, jnp.int32)
        elif cfg.mode == "async":
            num_drafts = np.where(active, cap, -1)
            c = int(self._capacity(jnp.asarray(conf_hist[1]), self.cost_table, cfg.min_gain, jnp.asarray(num_drafts)))
            most = min(most, c)
        return next(w for w in self.width_buckets if w >= 1 + most), fixed

    def _append(self, slot: _Slot, tokens: list[int], bar) -> None:
        req, res = slot.request, slot.result
        for tok in tokens:
            res.tokens.append(tok)
            bar.update(1)
            if tok in req.stop_tokens:
                res.finish_reason = "stop"
                return
            if len(res.tokens) >= req.max_tokens:
                res.finish_reason = "length"
                return
        if slot.length + 2 >= self.config.max_len and not res.finish_reason:
            res.finish_reason = "length"  # the cache is full
