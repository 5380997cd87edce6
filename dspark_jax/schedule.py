"""Load-aware verification scheduling (SPEC section 6): how many drafts each request verifies.

A serving step verifies, for each of R requests, its anchor plus the first l_r of its K drafts. The
step costs 1 / SPS(B) seconds at B = R + sum_r l_r batch tokens and emits, in expectation,
tau = R + sum_r sum_{j <= l_r} a_{r,j} tokens, where a_{r,j} = prod_{i <= j} c_{r,i} is the prefix
survival built from the draft's CONDITIONAL confidences c (c_{r,k}: probability that draft k is accepted
given drafts 1..k-1 were). The schedulers pick l to make Theta = tau * SPS(B) large.

Losslessness constrains HOW they may search: c_{r,k+1} depends on the sampled draft x_k, so the decision
to verify draft k may only depend on c_{r,<=k} (and on other requests). Both schedulers here order
candidates (r, j) by survival with ties going to the smaller j, so every candidate of request r at
position >= k ranks after all of its positions < k; admitting a prefix of that order (sync) or the
top-C of it for a C fixed in advance (async) therefore never lets x_k influence its own admission.

Requests and padding (`num_drafts`, optional i32[R]):
  * num_drafts[r] = n >= 0: an active request that may verify at most min(n, K) drafts this step. It
    always costs its one backbone token (the anchor) and emits one token, even with n = 0 (e.g. a
    request one token short of its length limit).
  * num_drafts[r] < 0: an inactive slot (padding in a static-shape batch). It costs nothing, adds
    nothing to tau, and always gets l_r = 0.
  Without num_drafts every row is active with K drafts. (Only the active rows count towards B, which
  is why "padding" needs its own marker: counting empty slots as tokens would make speculation look
  cheaper than it is and count tokens that are never emitted.)

Both schedulers are pure, jittable and vmappable (static shapes; loops only over the static K axis).
"""

from __future__ import annotations

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import output_files
from dspark_jax.errors import UserError


class CostTableWarning(UserWarning):
    """A measured cost table had to be repaired (steps/sec rose with batch tokens)."""


@jax.tree_util.register_pytree_node_class
class CostTable:
    """SPS(B): backbone verify steps per second at B batch tokens, from measured samples.

    `batch_tokens` i32[M] strictly increasing sample points (>= 1); `steps_per_sec` f32[M] (> 0);
    `max_batch_tokens` the largest step the engine can run (default: the last sample).

    Lookup (`sps`) is by floor: SPS(B) = steps_per_sec[i] for the largest sample batch_tokens[i] <= B.
    So a staircase cost curve is written down by the first batch-token count of each stair. Outside the
    samples:
      * B below the first sample uses the first sample's value (fewer tokens are never slower);
      * B above the last sample and <= max_batch_tokens uses the last sample's value (floor);
      * B above max_batch_tokens has SPS = 0: the engine cannot run that step, so no schedule that
        needs it can ever look profitable.

    Monotone repair: steps/sec must be non-increasing in batch tokens. A table that rises somewhere
    (measurement noise) is replaced by its suffix maximum, steps_per_sec[i] = max_{j >= i}
    steps_per_sec[j], with a `CostTableWarning`. Why the suffix maximum and not a running minimum: a
    smaller batch can always be padded up to a larger measured shape, so it runs at least that fast;
    every repaired value is thus a speed the engine has actually demonstrated, and no real measurement is
    lowered.

    A pytree (the arrays are leaves), so a table can be passed into jitted or vmapped functions without
    recompiling when its values change.
    """

    def __init__(self, batch_tokens, steps_per_sec, max_batch_tokens: int | None = None):
        bt, sps, max_bt = _validate_table(batch_tokens, steps_per_sec, max_batch_tokens)
        repaired = np.maximum.accumulate(sps[::-1])[::-1]
        if np.any(repaired != sps):
            bad = [int(b) for b, s, r in zip(bt, sps, repaired) if s != r]
            warnings.warn(
                f"cost table: steps_per_sec must be non-increasing in batch tokens, but the samples at "
                f"batch_tokens {bad} are slower than a larger batch; repaired by raising them to the best "
                f"speed measured at a larger batch (suffix maximum)", CostTableWarning, stacklevel=2)
        self.batch_tokens = jnp.asarray(bt, jnp.int32)
        self.steps_per_sec = jnp.asarray(repaired, jnp.float32)
        self.max_batch_tokens = jnp.asarray(max_bt, jnp.int32)

    # -- pytree plumbing: rebuilding from leaves must not re-validate (leaves may be tracers) --------
    def tree_flatten(self):
        return (self.batch_tokens, self.steps_per_sec, self.max_batch_tokens), None

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        obj = object.__new__(cls)
        obj.batch_tokens, obj.steps_per_sec, obj.max_batch_tokens = leaves
        return obj

    def sps(self, batch_tokens) -> jax.Array:
        """SPS(B) for B of any integer shape (jittable): floor lookup, 0 above max_batch_tokens."""
        b = jnp.asarray(batch_tokens, jnp.int32)
        idx = jnp.searchsorted(self.batch_tokens, b, side="right") - 1
        value = self.steps_per_sec[jnp.clip(idx, 0, self.batch_tokens.shape[-1] - 1)]
        return jnp.where(b > self.max_batch_tokens, 0.0, value)

    # -- SGLang-compatible JSON -----------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "sample_batch_tokens": [int(x) for x in np.asarray(self.batch_tokens)],
            # shortest decimal that reads back as the same float32 (0.45, not 0.44999998807907104)
            "sample_steps_per_sec": [float(str(x)) for x in np.asarray(self.steps_per_sec, np.float32)],
            "max_batch_tokens": int(self.max_batch_tokens),
        }

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The table as SGLang's JSON; also written to `path` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            output_files.write_text(path, text + "\n")
        return text

    @classmethod
    def from_dict(cls, data, *, source: str = "cost table") -> "CostTable":
        if not isinstance(data, dict):
            raise UserError(f"{source}: expected a JSON object with keys 'sample_batch_tokens', "
                             f"'sample_steps_per_sec', 'max_batch_tokens', got {type(data).__name__}")
        for key in ("sample_batch_tokens", "sample_steps_per_sec"):
            if key not in data:
                raise UserError(f"{source}: missing key '{key}' (SGLang cost-table format)")
            if not isinstance(data[key], list):
                raise UserError(f"{source}: '{key}' must be a list of numbers, got {type(data[key]).__name__}")
        max_bt = data.get("max_batch_tokens")
        try:
            return cls(data["sample_batch_tokens"], data["sample_steps_per_sec"], max_bt)
        except ValueError as err:
            raise UserError(f"{source}: {err}") from None

    @classmethod
    def from_json(cls, path_or_text: str | os.PathLike) -> "CostTable":
        """Load SGLang's cost-table JSON from a file path, or parse it from a JSON string."""
        text, source = str(path_or_text), "cost table"
        if not text.lstrip().startswith("{"):
            source = f"cost table {text}"
            try:
                with open(path_or_text) as f:
                    text = f.read()
            except OSError as err:
                raise UserError(f"{source}: cannot read the file ({err.strerror})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{source}: not valid JSON ({err})") from None
        return cls.from_dict(data, source=source)

    def __repr__(self) -> str:
        d = self.to_dict()
        return (f"CostTable(batch_tokens={d['sample_batch_tokens']}, steps_per_sec={d['sample_steps_per_sec']}, "
                f"max_batch_tokens={d['max_batch_tokens']})")


def _validate_table(batch_tokens, steps_per_sec, max_batch_tokens):
    """Host-side checks; each error names the field and what was expected."""
    try:
        bt = np.asarray(batch_tokens, dtype=np.float64)
        sps = np.asarray(steps_per_sec, dtype=np.float64)
    except (TypeError, ValueError):
        raise UserError("sample_batch_tokens / sample_steps_per_sec must be lists of numbers") from None
    if bt.ndim != 1 or bt.size == 0:
        raise UserError(f"sample_batch_tokens: expected a non-empty 1-D list, got shape {bt.shape}")
    if sps.shape != bt.shape:
        raise UserError(f"sample_steps_per_sec: expected {bt.size} values (one per sample_batch_tokens "
                         f"entry), got shape {sps.shape}")
    if not np.all(np.isfinite(bt)) or np.any(bt != np.round(bt)) or np.any(bt < 1):
        raise UserError(f"sample_batch_tokens: expected integers >= 1, got {bt.tolist()}")
    if np.any(np.diff(bt) <= 0):
        raise UserError(f"sample_batch_tokens: expected strictly increasing values, got {bt.astype(int).tolist()}")
    if not np.all(np.isfinite(sps)) or np.any(sps <= 0):
        raise UserError(f"sample_steps_per_sec: expected finite numbers > 0, got {sps.tolist()}")
    if max_batch_tokens is None:
        max_bt = int(bt[-1])
    else:
        if (isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, (int, float, np.number))
                or not float(max_batch_tokens).is_integer()):
            raise UserError(f"max_batch_tokens: expected an integer, got {max_batch_tokens!r}")
        max_bt = int(max_batch_tokens)
        if max_bt < bt[-1]:
            raise UserError(f"max_batch_tokens: expected >= the largest sample ({int(bt[-1])}), got {max_bt}")
    return bt.astype(np.int64), sps, max_bt


# ---------------------------------------------------------------------------------------------------
# Candidates


def survival(conf: jax.Array) -> jax.Array:
    """Prefix survival a_{r,j} = prod_{i<=j} c_{r,i} from conditional confidences f32[R, K].

    Multiplied left to right on purpose (K is small and static): every step multiplies by c <= 1, so
    a_{r,j+1} <= a_{r,j} holds exactly in floating point, which the tie rule relies on to keep the
    admitted set a prefix. NaN confidences count as 0 (never admit on garbage).
    """
    c = jnp.clip(jnp.nan_to_num(jnp.asarray(conf, jnp.float32), nan=0.0), 0.0, 1.0)
    cols = [c[:, 0]]
    for j in range(1, c.shape[1]):
        cols.append(cols[-1] * c[:, j])
    return jnp.stack(cols, axis=1)


def _active_and_caps(num_rows: int, num_drafts, k: int):
    """(active bool[R], cap i32[R]) from the optional num_drafts (see the module docstring)."""
    if num_drafts is None:
        return jnp.ones((num_rows,), bool), jnp.full((num_rows,), k, jnp.int32)
    n = jnp.asarray(num_drafts, jnp.int32)
    return n >= 0, jnp.clip(n, 0, k)


def _check_shapes(conf, num_drafts, conf_lagged=None):
    """Shape errors at trace time, naming the argument (shapes are static, so this costs nothing)."""
    if jnp.ndim(conf) != 2:
        raise ValueError(f"conf: expected f32[R, K] conditional confidences, got shape {jnp.shape(conf)}")
    if conf_lagged is not None and jnp.shape(conf_lagged) != jnp.shape(conf):
        raise ValueError(f"conf_lagged: expected the shape of conf_now {jnp.shape(conf)}, got {jnp.shape(conf_lagged)}")
    if num_drafts is not None and jnp.shape(num_drafts) != jnp.shape(conf)[:1]:
        raise ValueError(f"num_drafts: expected i32[{jnp.shape(conf)[0]}], got shape {jnp.shape(num_drafts)}")


def _candidates(conf, num_drafts):
    """Flattened candidates in j-major order (index j * R + r) with their survival, -1 if not a candidate.

    j-major flattening plus a stable descending sort gives exactly the stated tie order: equal survival
    -> smaller j first, then smaller r.
    """
    num_rows, k = conf.shape
    a = survival(conf)
    active, cap = _active_and_caps(num_rows, num_drafts, k)
    j = jnp.arange(1, k + 1)[None, :]
    is_cand = active[:, None] & (j <= cap[:, None]) & (a > 0)
    a_flat = jnp.where(is_cand, a, -1.0).T.reshape(-1)
    base = jnp.sum(active).astype(jnp.int32)  # each active request's one backbone token
    return a_flat, base


def _lengths_from_admitted(admitted_flat, order, num_rows: int, k: int) -> jax.Array:
    """Scatter the admitted flags of the sorted candidates back and count per request."""
    flags = jnp.zeros(admitted_flat.shape, bool).at[order].set(admitted_flat)
    return jnp.sum(flags.reshape(k, num_rows), axis=0).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------------
# Schedulers


def schedule_sync(conf: jax.Array, table: CostTable, num_drafts: jax.Array | None = None) -> jax.Array:
    """Algorithm 1 (synchronous, early stop): verify lengths i32[R] from conf f32[R, K].

    Candidates (r, j) with a_{r,j} > 0 (and j <= num_drafts[r]) are taken in descending survival (ties:
    smaller j, then smaller r). Starting from B = tau = R_active and Theta_best = R_active * SPS(R_active),
    each candidate adds one batch token and a_{r,j} expected tokens; it is kept while
    Theta = tau * SPS(B) strictly improves on the best so far, and the first non-improvement STOPS the
    search. The stop is the lossless part: a search that looked further would let a draft's own sampled
    value (through the confidences after it) decide whether it is verified.
    """
    _check_shapes(conf, num_drafts)
    num_rows, k = conf.shape
    a_flat, base = _candidates(conf, num_drafts)
    order = jnp.argsort(-a_flat, stable=True)
    a_sorted = a_flat[order]
    is_cand = a_sorted > 0
    steps = jnp.arange(1, a_sorted.shape[0] + 1, dtype=jnp.int32)
    tau = base + jnp.cumsum(jnp.where(is_cand, a_sorted, 0.0))
    theta = tau * table.sps(base + steps)
    theta_before = jnp.concatenate([(base * table.sps(base))[None], theta[:-1]])
    # The kept prefix is the run of strict improvements from the start (Theta_best is always the
    # previous candidate's Theta inside that run).
    improves = is_cand & (theta > theta_before)
    num_admitted = jnp.sum(jnp.cumprod(improves.astype(jnp.int32)))
    return _lengths_from_admitted(steps <= num_admitted, order, num_rows, k)


def async_capacity(conf_lagged: jax.Array, table: CostTable, min_gain: float = 0.0,
                   num_drafts: jax.Array | None = None, budget_tokens: jax.Array | None = None,
                   acceptance_scale: jax.Array | float = 1.0) -> jax.Array:
    """Capacity C (i32 scalar): the number of draft tokens to verify, chosen without the current drafts.

    Global search (no early stop) over every budget c = 0..R*K: Theta(c) = (R_active + sum of the c
    largest lagged survivals) * SPS(B(c)); C = the smallest c with the largest Theta. Because C
    is computed from confidences of an earlier step, the search may look past stair edges of the cost
    table without leaking the current drafts into their own admission.

    B(c), the batch tokens a step verifying c drafts runs, is R_active + c for a ragged batch (the
    default). An engine with static shapes runs more: `budget_tokens` i32[R*K + 1] gives its B(c) for
    every c (see `static_budget_tokens`).

    `acceptance_scale` (a scalar from PAST steps only, e.g. realized / predicted accepted drafts on the
    traffic served so far) multiplies every survival in the search (capped at 1): confidences that
    proved over- or under-confident size the batch accordingly. It never depends on the current drafts,
    so the capacity stays lossless.

    Minimum-predicted-gain guard: C = 0 unless Theta(C) > (1 + min_gain) * Theta(0), i.e. min_gain is a
    RELATIVE predicted gain (0.05 = speculate only if it is predicted to pay at least 5%). The guard uses
    the lagged prediction only; a guard on the current drafts would leak them like a global search does.
    """
    _check_shapes(conf_lagged, num_drafts)
    a_flat, base = _candidates(conf_lagged, num_drafts)
    a_flat = jnp.minimum(a_flat * jnp.maximum(jnp.asarray(acceptance_scale, jnp.float32), 0.0), 1.0)
    gains = jnp.maximum(-jnp.sort(-a_flat), 0.0)  # descending; non-candidates (< 0) add nothing
    tau = base + jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(gains)])
    budgets = jnp.arange(a_flat.shape[0] + 1, dtype=jnp.int32)
    tokens = base + budgets if budget_tokens is None else budget_tokens
    theta = tau * table.sps(tokens)
    best = jnp.argmax(theta)  # first maximum = smallest budget among ties
    pays = theta[best] > (1.0 + min_gain) * theta[0]
    return jnp.where(pays, best, 0).astype(jnp.int32)


def width_buckets(k: int) -> list[int]:
    """Verify widths a static-shape engine compiles for block size K: powers of two up to K, and K+1
    (few programs, little padding); a step verifying at most l drafts per row runs the smallest bucket
    >= 1 + l."""
    return sorted({1 << i for i in range(k.bit_length()) if 1 << i <= k} | {k + 1})


def static_budget_tokens(slots: int, k: int) -> np.ndarray:
    """B(c) of a static-shape engine (every slot runs, at one width for all rows): budget c may give one
    row min(c, K) drafts, so the step runs slots x (the width bucket holding 1 + min(c, K)); budget 0 is
    its plain step (width 1). -> i32[slots * K + 1]."""
    buckets = np.asarray(width_buckets(k))
    width = buckets[np.searchsorted(buckets, 1 + np.minimum(np.arange(slots * k + 1), k))]
    return (slots * width).astype(np.int32)


def schedule_async(conf_now: jax.Array, conf_lagged: jax.Array, table: CostTable, min_gain: float = 0.0,
                   num_drafts: jax.Array | None = None, budget_tokens: jax.Array | None = None,
                   acceptance_scale: jax.Array | float = 1.0) -> jax.Array:
    """Asynchronous scheduler: verify lengths i32[R] from current and lagged conf f32[R, K].

    C = async_capacity(conf_lagged, ...) (confidences from two steps earlier, rows aligned with the
    current requests; for a request without history pass its current confidences' prior or zeros), then
    the top-C candidates by CURRENT survival are admitted (ties: smaller j, then smaller r). Membership of
    (r, k) in the top C depends only on a_{r,<=k} and on other requests, so it stays lossless. Since
    R_active + C never exceeds max_batch_tokens (SPS is 0 above it), neither does the admitted batch.
    """
    _check_shapes(conf_now, num_drafts, conf_lagged)
    num_rows, k = conf_now.shape
    capacity = async_capacity(conf_lagged, table, min_gain, num_drafts, budget_tokens, acceptance_scale)
    a_flat, _ = _candidates(conf_now, num_drafts)
    order = jnp.argsort(-a_flat, stable=True)
    a_sorted = a_flat[order]
    ranks = jnp.arange(a_sorted.shape[0], dtype=jnp.int32)
    return _lengths_from_admitted((ranks < capacity) & (a_sorted > 0), order, num_rows, k)


def expected_throughput(lengths: jax.Array, survival_true: jax.Array, table: CostTable,
                        num_drafts: jax.Array | None = None) -> jax.Array:
    """Theta = tau * SPS(B) (expected tokens/s) of verify lengths i32[R] under survival f32[R, K]."""
    num_rows, k = survival_true.shape
    active, _ = _active_and_caps(num_rows, num_drafts, k)
    l = jnp.where(active, lengths, 0)
    verified = jnp.arange(1, k + 1)[None, :] <= l[:, None]
    tau = jnp.sum(active) + jnp.sum(jnp.where(verified, survival_true, 0.0))
    return tau * table.sps(jnp.sum(active) + jnp.sum(l))
