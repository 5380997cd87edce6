"""Confidence calibration: Sequential Temperature Scaling (STS, SPEC section 6).

The draft's confidence head returns logits z_1..z_K; the calibrated conditional confidence of draft k is
c_k = sigmoid(z_k / T_k) and the prefix survival a_k = prod_{i<=k} c_i is what the scheduler spends
batch tokens on. STS fits T_1..T_K left to right on held-out rounds so that a_k matches the observed
prefix-survival frequency.

Records, one per proposal: the raw logits z f32[K], num_verified m (the l_r the scheduler chose) and
num_accepted n <= m. Labels: label_k = 1 iff drafts 1..k were all accepted (n >= k). Position k is
OBSERVED only when k <= m: m was fixed before any outcome was drawn, so selecting on it keeps the
labels unbiased given z. (Selecting on outcomes, e.g. "verified up to the first rejection", keeps
position k only where 1..k-1 survived and would fit a_k to the conditional rate c_k instead.)

Fitting is host-side numpy in float64 (an offline tool); `Calibration.apply` is the jittable part.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax import output_files
from dspark_jax.errors import UserError


def default_grid() -> np.ndarray:
    """Log grid of temperatures over [0.05, 20] with ratio 10^(1/60) (~3.9%) between neighbours.

    Built as powers of 10^(1/60) so 1.0 (no change) is exactly on the grid; the fine step keeps the
    grid's own error well below the 10% a fit should be trusted to.
    """
    powers = 10.0 ** (np.arange(-78, 79) / 60.0)  # 0.0501 .. 19.95
    return np.unique(np.concatenate([[0.05], powers, [20.0]]))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow for large |x|


def ece(pred, labels, bins: int = 20) -> float:
    """Expected calibration error with `bins` equal-width bins on [0, 1]: sum_b (n_b / N) |mean pred_b -
    mean label_b| = sum_b |sum_{i in b} (pred_i - label_i)| / N. 0 for an empty input."""
    pred = np.asarray(pred, np.float64).reshape(-1)
    if pred.size == 0:
        return 0.0
    gap = np.bincount(_bin_index(pred, bins), pred - np.asarray(labels, np.float64).reshape(-1), bins)
    return float(np.sum(np.abs(gap)) / pred.size)


def reliability(pred, labels, bins: int = 20):
    """Reliability-diagram data per equal-width bin: (mean prediction, observed frequency, count);
    empty bins give NaN means."""
    conf_sum, label_sum, count = _binned(pred, labels, bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        return conf_sum / count, label_sum / count, count


def _binned(pred, labels, bins):
    pred = np.asarray(pred, np.float64).reshape(-1)
    labels = np.asarray(labels, np.float64).reshape(-1)
    idx = _bin_index(pred, bins)
    return (np.bincount(idx, pred, bins), np.bincount(idx, labels, bins),
            np.bincount(idx, minlength=bins).astype(np.float64))


def _bin_index(pred: np.ndarray, bins: int) -> np.ndarray:
    return np.clip((pred * bins).astype(np.int64), 0, bins - 1)  # a prediction of exactly 1 -> last bin


def survival_labels(num_accepted, num_verified, num_positions: int):
    """(label bool[N, K], observed bool[N, K]): label_k = drafts 1..k accepted, observed = k <= m."""
    k = np.arange(1, num_positions + 1)[None, :]
    n = np.asarray(num_accepted)[:, None]
    m = np.asarray(num_verified)[:, None]
    return n >= k, k <= m


def cumulative_survival(conf_logits, temperatures) -> np.ndarray:
    """a f64[N, K] = cumprod sigmoid(z / T) (host-side twin of Calibration.apply + cumprod)."""
    z = np.asarray(conf_logits, np.float64)
    return np.cumprod(_sigmoid(z / np.asarray(temperatures, np.float64)), axis=-1)


def ece_per_position(conf_logits, num_accepted, num_verified, temperatures=None, *, bins: int = 20):
    """(ece f64[K], observed count i64[K]) of the cumulative survival at each position against
    label_k, over the rows where position k was observed. temperatures None = raw (all 1)."""
    z = _check_records(conf_logits, num_accepted, num_verified)
    k = z.shape[1]
    temps = np.ones(k) if temperatures is None else np.asarray(temperatures, np.float64)
    a = cumulative_survival(z, temps)
    label, observed = survival_labels(num_accepted, num_verified, k)
    eces = np.array([ece(a[observed[:, j], j], label[observed[:, j], j], bins) for j in range(k)])
    return eces, observed.sum(axis=0)


def summary_ece(eces, counts) -> float:
    """One number for a whole calibration: per-position ECEs weighted by their observed counts.

    Per position first (rather than pooling every (row, k) pair into one histogram) so that position 1
    being over-confident cannot hide position 3 being under-confident in the same bin.
    """
    counts = np.asarray(counts, np.float64)
    return float(np.sum(np.asarray(eces) * counts) / counts.sum()) if counts.sum() > 0 else 0.0


def _check_records(conf_logits, num_accepted, num_verified) -> np.ndarray:
    """Validate fit inputs host-side; errors name the field and the first bad row."""
    z = np.asarray(conf_logits, np.float64)
    if z.ndim != 2 or z.shape[1] == 0:
        raise ValueError(f"conf_logits: expected shape [N, K] with K >= 1, got {z.shape}")
    n_rows, k = z.shape
    bad = np.flatnonzero(~np.all(np.isfinite(z), axis=1))
    if bad.size:
        raise ValueError(f"conf_logits: row {bad[0]} has a non-finite value: {z[bad[0]].tolist()}")
    out = {}
    for name, value in (("num_accepted", num_accepted), ("num_verified", num_verified)):
        v = np.asarray(value)
        if v.shape != (n_rows,):
            raise ValueError(f"{name}: expected shape [{n_rows}] (one per conf_logits row), got {v.shape}")
        if not (np.issubdtype(v.dtype, np.integer) or np.all(v == np.round(v))):
            raise ValueError(f"{name}: expected integers, got dtype {v.dtype}")
        out[name] = v.astype(np.int64)
    n, m = out["num_accepted"], out["num_verified"]
    for name, v, lo, hi in (("num_verified", m, 0, np.full_like(m, k)), ("num_accepted", n, 0, m)):
        bad = np.flatnonzero((v < lo) | (v > hi))
        if bad.size:
            i = bad[0]
            raise ValueError(f"{name}: row {i} is {v[i]}, expected an integer in [{lo}, {hi[i]}]"
                             + (" (num_verified)" if name == "num_accepted" else " (K)"))
    return z


@dataclasses.dataclass(frozen=True, eq=False)
class Calibration:
    """STS temperatures f32[K] plus how well they fit (None when loaded from a file without metadata).

    A pytree whose only leaf is `temperatures`, so it can be passed into jitted functions.
    """

    temperatures: np.ndarray | jax.Array  # f32[K], > 0
    ece_before: float | None = None  # summary ECE of the raw (T = 1) cumulative survival
    ece_after: float | None = None  # summary ECE with the fitted temperatures
    num_samples: int = 0  # records (proposals) the fit used

    @classmethod
    def identity(cls, num_positions: int) -> "Calibration":
        return cls(np.ones(num_positions, np.float32))

    @property
    def num_positions(self) -> int:
        return int(np.shape(self.temperatures)[-1])

    def apply(self, conf_logits: jax.Array) -> jax.Array:
        """Conditional confidences c = sigmoid(z / T), f32[..., K] (jittable)."""
        z = jnp.asarray(conf_logits, jnp.float32)
        if z.shape[-1] != self.num_positions:
            raise ValueError(f"conf_logits: expected a last axis of {self.num_positions} positions (the "
                             f"calibration's K), got shape {z.shape}")
        return jax.nn.sigmoid(z / jnp.asarray(self.temperatures, jnp.float32))

    def to_dict(self) -> dict:
        # shortest decimal that reads back as the same float32
        temps = [float(str(t)) for t in np.asarray(self.temperatures, np.float32)]
        return {"temperatures": temps, "ece_before": self.ece_before, "ece_after": self.ece_after,
                "num_samples": int(self.num_samples)}

    def save(self, path: str | os.PathLike) -> None:
        """JSON with key `temperatures` (the key SGLang and TensorRT-LLM read) plus the metadata."""
        output_files.write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        """Read a calibration JSON; only `temperatures` is required (files from other engines may carry
        nothing else)."""
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as err:
            raise UserError(f"calibration {path}: cannot read the file ({err.strerror})") from None
        except json.JSONDecodeError as err:
            raise UserError(f"calibration {path}: not valid JSON ({err})") from None
        return cls.from_dict(data, source=f"calibration {path}")

    @classmethod
    def from_dict(cls, data, *, source: str = "calibration") -> "Calibration":
        if not isinstance(data, dict) or "temperatures" not in data:
            raise UserError(f"{source}: expected a JSON object with key 'temperatures'")
        temps = data["temperatures"]
        if (not isinstance(temps, list) or not temps
                or not all(_is_number(t) and math.isfinite(t) and t > 0 for t in temps)):
            raise UserError(f"{source}: 'temperatures' must be a non-empty list of finite numbers > 0, "
                             f"got {temps!r}")
        meta = {}
        for key in ("ece_before", "ece_after"):
            v = data.get(key)
            if v is not None and not (_is_number(v) and v >= 0):
                raise UserError(f"{source}: '{key}' must be a number >= 0 or null, got {v!r}")
            meta[key] = None if v is None else float(v)
        n = data.get("num_samples", 0)
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
            raise UserError(f"{source}: 'num_samples' must be an integer >= 0, got {n!r}")
        return cls(np.asarray(temps, np.float32), num_samples=n, **meta)

    def __repr__(self) -> str:
        d = self.to_dict()
        return (f"Calibration(temperatures={d['temperatures']}, ece_before={d['ece_before']}, "
                f"ece_after={d['ece_after']}, num_samples={d['num_samples']})")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


jax.tree_util.register_dataclass(
    Calibration, data_fields=["temperatures"], meta_fields=["ece_before", "ece_after", "num_samples"])


def fit_sts(conf_logits, num_accepted, num_verified, *, bins: int = 20, grid=None) -> Calibration:
    """Fit one temperature per position, left to right, against prefix-survival labels.

    For k = 1..K: over the rows that observed position k (k <= num_verified), pick the T on the grid
    minimising the ECE of prod_{i<k} sigmoid(z_i / T_i) * sigmoid(z_k / T) against label_k, with
    T_1..T_{k-1} already fixed. Exact ties go to the T closest to 1 (in log), and a position nobody
    observed keeps T = 1: without evidence, change nothing.

    conf_logits f32[N, K]; num_accepted, num_verified i32[N] with 0 <= num_accepted <= num_verified <= K;
    grid: positive temperatures (default `default_grid()`, 0.05..20 with 1.0 included).
    """
    z = _check_records(conf_logits, num_accepted, num_verified)
    if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)) or bins < 1:
        raise ValueError(f"bins: expected an integer >= 1, got {bins!r}")
    grid = default_grid() if grid is None else np.asarray(grid, np.float64).reshape(-1)
    if grid.size == 0 or not np.all(np.isfinite(grid)) or np.any(grid <= 0):
        raise ValueError(f"grid: expected a non-empty list of finite temperatures > 0, got {grid.tolist()}")
    # candidates ordered by closeness to T = 1 so that argmin's first-minimum rule breaks ties that way
    grid = grid[np.argsort(np.abs(np.log(grid)), kind="stable")]

    n_rows, k = z.shape
    label, observed = survival_labels(num_accepted, num_verified, k)
    temps = np.ones(k)
    prefix = np.ones(n_rows)  # prod_{i<k} sigmoid(z_i / T_i) with the temperatures fitted so far
    for j in range(k):
        rows = observed[:, j]
        if rows.any():
            p_rows, z_rows, y_rows = prefix[rows], z[rows, j], label[rows, j]
            errors = [ece(p_rows * _sigmoid(z_rows / t), y_rows, bins) for t in grid]
            temps[j] = grid[int(np.argmin(errors))]
        prefix = prefix * _sigmoid(z[:, j] / temps[j])

    before, counts = ece_per_position(z, num_accepted, num_verified, None, bins=bins)
    after, _ = ece_per_position(z, num_accepted, num_verified, temps, bins=bins)
    return Calibration(temperatures=temps.astype(np.float32), ece_before=summary_ece(before, counts),
                       ece_after=summary_ece(after, counts), num_samples=int(n_rows))
