"""Plain numpy oracles shared by several tests: loops where loops make them obviously right."""

import math

import numpy as np


def e4m3_grid():
    vals = set()
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            vals.update([v, -v])
    return np.array(sorted(vals))


def np_round_e4m3(v, grid):
    """Nearest grid value; ties to the even mantissa (the code with an even last bit)."""
    i = np.searchsorted(grid, v)
    lo, hi = grid[max(i - 1, 0)], grid[min(i, len(grid) - 1)]
    if abs(v - lo) < abs(hi - v):
        return lo
    if abs(hi - v) < abs(v - lo):
        return hi
    # tie: pick the one whose mantissa is even, i.e. even index among same-sign magnitudes
    mags = np.array(sorted({abs(g) for g in grid}))
    return lo if int(np.searchsorted(mags, abs(lo))) % 2 == 0 else hi



def np_fp8_round_rows(x):
    """fp8 E4M3 quantize-dequantize of each row of x [..., d] in blocks of 32, numpy."""
    grid = e4m3_grid()
    flat = x.reshape(-1, x.shape[-1]).astype(np.float64)
    out = np.zeros_like(flat)
    for r in range(flat.shape[0]):
        for b0 in range(0, flat.shape[1], 32):
            blk = flat[r, b0:b0 + 32]
            scale = 2.0 ** math.ceil(math.log2(max(np.abs(blk).max(), 1e-4) / 448.0))
            out[r, b0:b0 + 32] = [np_round_e4m3(min(max(v / scale, -448), 448), grid) * scale for v in blk]
    return out.reshape(x.shape)


def np_rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_rope(x, pos, theta, rope_dim, inverse=False):
    """Interleaved pairs of the last rope_dim dims as complex numbers; x [..., d], pos broadcast to x[..., 0]."""
    x = np.array(x, np.float64)
    d = x.shape[-1]
    pos = np.broadcast_to(pos, x.shape[:-1])
    out = x.copy()
    for idx in np.ndindex(*x.shape[:-1]):
        for i in range(rope_dim // 2):
            ang = pos[idx] * theta ** (-2 * i / rope_dim) * (-1 if inverse else 1)
            z = complex(x[idx + (d - rope_dim + 2 * i,)], x[idx + (d - rope_dim + 2 * i + 1,)])
            z *= complex(math.cos(ang), math.sin(ang))
            out[idx + (d - rope_dim + 2 * i,)] = z.real
            out[idx + (d - rope_dim + 2 * i + 1,)] = z.imag
    return out


def reference_probs(logits, temperature, top_k, top_p):
    """float64 statement of the rules in process_logits' docstring."""
    z = np.asarray(logits, np.float64)
    vocab = z.shape[-1]
    if temperature == 0:
        out = np.zeros(vocab)
        out[np.argmax(z)] = 1.0
        return out
    z = z / temperature
    if 0 < top_k < vocab:
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z < kth, -np.inf, z)
    if top_p < 1:
        s = np.sort(z)[::-1]
        pr = np.exp(s - s[0])
        pr /= pr.sum()
        before = np.cumsum(pr) - pr
        z = np.where(z < s[before < top_p].min(), -np.inf, z)
    e = np.exp(z - z.max())
    return e / e.sum()


# ---------------------------------------------------------------- mHC (SPEC 2.4), loops
def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def np_sinkhorn(logits, iters, eps):
    n = logits.shape[0]
    c = np.zeros((n, n))
    for i in range(n):
        row = np.exp(logits[i] - logits[i].max())
        c[i] = row / row.sum() + eps
    for j in range(n):
        s = sum(c[i, j] for i in range(n))
        for i in range(n):
            c[i, j] /= s + eps
    for _ in range(iters - 1):
        for i in range(n):
            s = sum(c[i, j] for j in range(n))
            for j in range(n):
                c[i, j] /= s + eps
        for j in range(n):
            s = sum(c[i, j] for i in range(n))
            for i in range(n):
                c[i, j] /= s + eps
    return c


def np_hc_mixes(streams, fn, base, scale, iters, eps, norm_eps):
    hc, d = streams.shape
    x = np.concatenate([streams[i] for i in range(hc)]).astype(np.float64)  # stream-major
    rho = 1.0 / math.sqrt(np.mean(x * x) + norm_eps)
    m = [sum(x[k] * fn[r, k] for k in range(hc * d)) * rho for r in range(fn.shape[0])]
    pre = np.array([sigmoid(m[i] * scale[0] + base[i]) + eps for i in range(hc)])
    post = np.array([2 * sigmoid(m[hc + i] * scale[1] + base[hc + i]) for i in range(hc)])
    comb_logits = np.array([[m[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j] for j in range(hc)]
                            for i in range(hc)])
    return pre, post, np_sinkhorn(comb_logits, iters, eps)


def _np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_markov_step(head, w1, w2, prev, h, s, gate=None, joint=None):
    """One slot of a Markov head, float64, written from SPEC 4.1 on the checkpoint's torch layouts:
    w1, w2 [V, r]; gate = (gate_proj.weight [r, H + r], bias [r]); joint = (joint_proj.weight [3r, 2r + H],
    bias [3r]); prev the prev token, h [H] the slot's hidden, s [r] the state entering the slot.
    -> (z [r], bias [V] = W2 z, the next state). The weights are split by input columns (no concat)."""
    e = w1[prev]
    r, hdim = w1.shape[1], len(h)
    if head == "vanilla":
        return e, w2 @ e, s
    if head == "gated":
        w, b = gate
        g = _np_sigmoid(w[:, :hdim] @ h + w[:, hdim:] @ e + b)  # the first H columns act on h, the last r on e
        return g * e, w2 @ (g * e), s
    w, b = joint  # columns: state, e, h; rows: a, c, o
    pre = w[:, :r] @ s + w[:, r:2 * r] @ e + w[:, 2 * r:] @ h + b
    a, c, o = pre[:r], pre[r:2 * r], pre[2 * r:]
    u = _np_sigmoid(a)
    z = np.tanh(o)  # from the state BEFORE this slot's update
    return z, w2 @ z, u * s + (1.0 - u) * np.tanh(c)
