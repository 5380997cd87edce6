"""An independent numpy emulation of DeepSeek's official V4.1 DSpark draft forward (SPEC 2.2-2.9, 3).

numpy + ml_dtypes only; nothing from dspark_jax is imported, so it shares no code (and no bug) with
the port. It reads the OFFICIAL checkpoint tensor names (SPEC 3: `mtp.{s}.attn.wq_a.weight`, ...,
`embed.weight`, `head.weight`) from a plain dict of arrays. fp8 / fp4 checkpoints must be dequantised
first (`dequantize_official` does it from the raw E4M3 / packed-E2M1 + E8M0 tensors): the values are
exact in bf16.

    rows = context_rows(tensors, cfg, main_hidden_bf16 [T, n_taps*D], positions [T])  # -> bf16 [S, T, hd]
    logits, tokens, conf = propose_greedy(tensors, cfg, ring [S, W, hd] (slot p % W), length, anchor)

`cfg` is a dict or an object with our config field names (dim, n_layers, block_size, noise_token_id,
n_heads, head_dim, rope_head_dim, rope_theta, q_lora_rank, o_groups, o_lora_rank, window, hc_mult,
hc_sinkhorn_iters, hc_eps, norm_eps, n_routed_experts, n_activated_experts, route_scale, swiglu_limit,
kv_fp8, act_fp8; markov_rank is read from the tensors).

Numerics (`numerics=`):
  "bf16"  the official bf16-compute forward, with every rounding point of SPEC 2.9 (default);
  "bf16acc64"  the same rounding points, but every accumulation / elementwise step in float64: a second
          faithful bf16 forward whose distance to "bf16" measures accumulation-order noise;
  "f32"   the same algorithm with no bf16 rounding at all (activations stay f32);
  "f64"   the same with everything in float64 (for the self-tests).
`act_fp8` (default cfg.act_fp8) adds the activation fp8 quantisation before the fp8/fp4 GEMMs
(main_proj, wq_a, wq_b, wkv, wo_b, shared and routed w1/w3/w2); `kv_fp8` (default cfg.kv_fp8, True)
the fp8 QDQ of every KV row after RoPE. Both are independent of `numerics`.

Decisions where SPEC leaves room (each is a bf16-rounding-level choice; at fp8 one of them can move the
logits by ~0.2 on this kind of tiny config, so they matter for a bit-level comparison):
  * the order of the context keys (it fixes which keys share a 64-key softmax block): `key_layout`,
    see `ring_key_order`. Default "compact", the draft's own index list (official
    `get_dspark_topk_idxs`, SPEC 2.5): `cat(arange(min(W, p+1)), W + arange(K))`, the valid ring slots in
    SLOT order, then the K draft rows, walked by the sparse_attn kernel in blocks of 64. "chrono" is the
    main model's `get_window_topk_idxs` (a full ring oldest first; a partial one padded with -1 places up
    to W), which the draft does not use; "padded" is slot order with masked places up to W. All three give
    the same keys and differ at the bf16-rounding level only (at fp8 up to ~0.3 in the logits);
  * the online-softmax running sum adds the f32 probabilities (only the copy that multiplies V is
    rounded to bf16); the block's probabilities are exp(s - running max including this block);
  * the routing weights stay f32 (not rounded to bf16) and multiply silu(g) * u in f32;
  * the shared expert is the same SwiGLU with clamps and no weight;
  * RMSNorm is (x * rsqrt(mean(x^2) + eps)) * w in f32, then bf16; rsqrt as 1 / sqrt;
  * the activation / KV fp8 scale is the exact power of two >= f32(max(amax, 1e-4)) / f32(448);
  * softplus is log(1 + exp(x)) evaluated stably (logaddexp), no threshold switch;
  * RoPE positions enter as f32 (exact), cos/sin of the f32 angle in f32; the pair rotation is
    (a c - b s, a s + b c) in f32 (no FMA);
  * exp / sigmoid / silu / sqrt are numpy's float32 functions (1-ulp differences from torch's are
    possible; they are below every rounding point and only matter through rare bf16 flips);
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
FP8_MAX = 448.0
QBLOCK = 32  # values per activation / KV fp8 scale
ATTN_BLOCK = 64  # keys per online-softmax block

E2M1_TABLE = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


# ---------------------------------------------------------------------------------------------
# config and numerics
# ---------------------------------------------------------------------------------------------
def _get(cfg, name, default=None):
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


class Num:
    """Where the forward rounds. `ft` is the working float type, `r` the bf16 rounding (or nothing)."""

    def __init__(self, numerics: str = "bf16", act_fp8: bool = False, kv_fp8: bool = True, jitter=None):
        if numerics not in ("bf16", "bf16acc64", "f32", "f64"):
            raise ValueError(f"numerics {numerics!r}: expected 'bf16', 'bf16acc64', 'f32' or 'f64'")
        self.mode = numerics
        self.rounds = numerics in ("bf16", "bf16acc64")
        self.ft = np.float64 if numerics in ("f64", "bf16acc64") else np.float32
        self.act_fp8 = bool(act_fp8)
        self.kv_fp8 = bool(kv_fp8)
        # jitter (a np.random.Generator): before each bf16 rounding the f32 value is moved by up to
        # 2^-20 relative (8 f32 ulps), i.e. "another f32 accumulation order"; models a second faithful port.
        self.jitter = jitter

    def r(self, x):
        """An activation handed to the next op: bf16 in "bf16" mode (held as f32 values)."""
        x = np.asarray(x, self.ft)
        if self.rounds:
            if self.jitter is not None:
                x = x * (1 + self.jitter.uniform(-1, 1, x.shape) * 2.0 ** -20).astype(self.ft)
            return x.astype(np.float32).astype(BF16).astype(self.ft)
        return x

    def f(self, x):
        return np.asarray(x, self.ft) if not isinstance(x, np.ndarray) or x.dtype != self.ft else x


def _num(cfg, numerics, act_fp8, kv_fp8, jitter=None) -> Num:
    if act_fp8 is None:
        act_fp8 = bool(_get(cfg, "act_fp8", False))
    if kv_fp8 is None:
        kv_fp8 = bool(_get(cfg, "kv_fp8", True))
    return Num(numerics, act_fp8, kv_fp8, jitter)


# ---------------------------------------------------------------------------------------------
# fp8 helpers
# ---------------------------------------------------------------------------------------------
def pow2_scale(amax, ft=np.float32):
    """2^ceil(log2(max(amax, 1e-4) / 448)), the ceil taken exactly on the `ft` quotient."""
    r = np.maximum(np.asarray(amax, ft), ft(1e-4)) / ft(FP8_MAX)
    m, e = np.frexp(r)  # r = m * 2^e, m in [0.5, 1)
    e = np.where(m == 0.5, e - 1, e)
    return np.ldexp(ft(1.0), e).astype(ft)


def fp8_quant(x, ft=np.float32):
    """Per 32 values along the last axis: (E4M3 codes as `ft` [..., n], scales [..., n/32])."""
    x = np.asarray(x, ft)
    n = x.shape[-1]
    if n % QBLOCK:
        raise ValueError(f"fp8 quantisation needs a multiple of {QBLOCK} values, got {n}")
    xb = x.reshape(*x.shape[:-1], n // QBLOCK, QBLOCK)
    s = pow2_scale(np.abs(xb).max(-1), ft)
    q = np.clip(xb / s[..., None], -FP8_MAX, FP8_MAX).astype(np.float32).astype(E4M3).astype(ft)
    return q.reshape(x.shape), s


def fp8_qdq(x, ft=np.float32):
    q, s = fp8_quant(x, ft)
    n = q.shape[-1]
    return (q.reshape(*q.shape[:-1], n // QBLOCK, QBLOCK) * s[..., None]).reshape(q.shape)


# ---------------------------------------------------------------------------------------------
# the building blocks, each with its SPEC 2.9 rounding
# ---------------------------------------------------------------------------------------------
def linear(x, w, num: Num, fp8_gemm: bool = False):
    """x [..., K] @ w[N, K]^T -> [..., N] (bf16 out). `fp8_gemm`: this linear is an fp8/fp4 GEMM of the
    official forward, whose input is fp8-quantised when `num.act_fp8`."""
    x = num.f(x)
    w = num.f(w)
    if not (fp8_gemm and num.act_fp8):
        return num.r(x @ w.T)
    k = x.shape[-1]
    q, s = fp8_quant(x, num.ft)  # [..., K], [..., K/32]
    acc = np.zeros(x.shape[:-1] + (w.shape[0],), num.ft)
    for b in range(k // QBLOCK):
        sl = slice(b * QBLOCK, (b + 1) * QBLOCK)
        acc = acc + (q[..., sl] @ w[:, sl].T) * s[..., b:b + 1]  # block sum in f32, times the scales
    return num.r(acc)


def rms_norm(x, w, eps, num: Num):
    x = num.f(x)
    var = np.mean(x * x, axis=-1, keepdims=True)
    return num.r((x * (num.ft(1.0) / np.sqrt(var + num.ft(eps)))) * num.f(w))


def rope_freqs(rd, theta, ft=np.float32):
    return ft(1.0) / (ft(theta) ** (np.arange(0, rd, 2, dtype=ft) / ft(rd)))


def rope(x, positions, cfg, num: Num, inverse: bool = False):
    """Interleaved pairs (x[2i], x[2i+1]) of the last rope_head_dim dims rotated by position * freq_i.
    x [T, ..., d], positions [T]."""
    rd = int(_get(cfg, "rope_head_dim"))
    x = num.f(x).copy()
    d = x.shape[-1]
    freqs = rope_freqs(rd, float(_get(cfg, "rope_theta")), num.ft)
    ang = np.outer(np.asarray(positions, num.ft), freqs).astype(num.ft)  # [T, rd/2]
    ang = ang.reshape(ang.shape[:1] + (1,) * (x.ndim - 2) + ang.shape[1:])
    c, s = np.cos(ang).astype(num.ft), np.sin(ang).astype(num.ft)
    if inverse:
        s = -s
    a, b = x[..., d - rd::2].copy(), x[..., d - rd + 1::2].copy()
    x[..., d - rd::2] = a * c - b * s
    x[..., d - rd + 1::2] = a * s + b * c
    return num.r(x)


def kv_rows(x, pre, positions, cfg, num: Num):
    """kv = fp8qdq(rope(kv_norm(wkv(x)), positions)), bf16 [T, hd]."""
    eps = float(_get(cfg, "norm_eps"))
    kv = rms_norm(linear(x, pre["attn.wkv.weight"], num, True), pre["attn.kv_norm.weight"], eps, num)
    kv = rope(kv, positions, cfg, num)
    if num.kv_fp8:
        kv = num.r(fp8_qdq(kv, num.ft))
    return kv


def attention_core(q, keys, sink, num: Num, block: int = ATTN_BLOCK, valid=None):
    """q [Q, H, hd] (f32), keys = values [N, hd]; online softmax over blocks of `block` keys with the
    block's probabilities rounded to bf16 before they multiply V; the sink joins the final denominator.
    `valid` (bool [N], optional) masks keys out (they still occupy their place in the 64-key blocks)."""
    q = num.f(q)
    keys = num.f(keys)
    nq, h, hd = q.shape
    scale = num.ft(hd ** -0.5)
    m = np.full((nq, h), -np.inf, num.ft)
    lsum = np.zeros((nq, h), num.ft)
    acc = np.zeros((nq, h, hd), num.ft)
    for b0 in range(0, keys.shape[0], block):
        kb = keys[b0:b0 + block]
        s = (q @ kb.T) * scale  # [Q, H, n]
        if valid is not None:
            s = np.where(valid[b0:b0 + block], s, -np.inf)
        m_new = np.maximum(m, s.max(-1))
        safe = np.where(np.isneginf(m_new), num.ft(0), m_new)  # a block with no valid key so far
        alpha = np.exp(m - safe)
        p = np.exp(s - safe[..., None])
        lsum = lsum * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + num.r(p) @ kb
        m = m_new
    denom = lsum + np.exp(num.f(sink)[None, :] - m)
    return num.r(acc / denom[..., None])


def hc_mixes(X, fn, base, scale, cfg, num: Num):
    """X [T, hc, D] -> pre [T, hc], post [T, hc], comb [T, hc(i), hc(j)] (all f32), SPEC 2.4 literally."""
    hc = int(_get(cfg, "hc_mult"))
    eps = num.ft(_get(cfg, "hc_eps"))
    x = num.f(X).reshape(X.shape[0], -1)
    rho = num.ft(1.0) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + num.ft(_get(cfg, "norm_eps")))
    mix = (x @ num.f(fn).T) * rho  # [T, (2+hc)*hc]
    sc, b = num.f(scale), num.f(base)

    def sigmoid(z):
        return num.ft(1.0) / (num.ft(1.0) + np.exp(-z))

    pre = sigmoid(mix[:, :hc] * sc[0] + b[:hc]) + eps
    post = num.ft(2.0) * sigmoid(mix[:, hc:2 * hc] * sc[1] + b[hc:2 * hc])
    c = (mix[:, 2 * hc:] * sc[2] + b[2 * hc:]).reshape(-1, hc, hc)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(int(_get(cfg, "hc_sinkhorn_iters")) - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    return pre, post, c


def hc_pre(X, pre, num: Num):
    return num.r((num.f(pre)[..., None] * num.f(X)).sum(-2))


def hc_post(y, X, post, comb, num: Num):
    # Y_j = post[j] * y + sum_i comb[i, j] * X_i
    mixed = np.einsum("tij,tid->tjd", num.f(comb), num.f(X))
    return num.r(num.f(post)[..., None] * num.f(y)[:, None, :] + mixed)


def attention(x, pre, positions, ctx_keys, cfg, num: Num, ctx_valid=None):
    """x [K, D] (normed), ctx_keys [N, hd] the ring rows (all valid, or masked by ctx_valid) -> [K, D]."""
    eps = float(_get(cfg, "norm_eps"))
    h, hd = int(_get(cfg, "n_heads")), int(_get(cfg, "head_dim"))
    g, orank = int(_get(cfg, "o_groups")), int(_get(cfg, "o_lora_rank"))
    qa = rms_norm(linear(x, pre["attn.wq_a.weight"], num, True), pre["attn.q_norm.weight"], eps, num)
    q = linear(qa, pre["attn.wq_b.weight"], num, True).reshape(x.shape[0], h, hd)
    q = rope(q, positions, cfg, num)  # queries are not quantised
    kv = kv_rows(x, pre, positions, cfg, num)
    keys = np.concatenate([num.f(ctx_keys), kv], axis=0)
    valid = None if ctx_valid is None else np.concatenate([ctx_valid, np.ones(kv.shape[0], bool)])
    o = attention_core(q, keys, pre["attn.attn_sink"], num, valid=valid)
    o = rope(o, positions, cfg, num, inverse=True)  # [K, H, hd]
    og = o.reshape(x.shape[0], g, -1)  # heads grouped consecutively
    wo_a = num.f(pre["attn.wo_a.weight"]).reshape(g, orank, -1)
    oa = num.r(np.einsum("kgd,grd->kgr", og, wo_a))  # bf16 einsum per group, not an fp8 GEMM
    return linear(oa.reshape(x.shape[0], g * orank), pre["attn.wo_b.weight"], num, True)


def _expert(x, w1, w2, w3, weight, cfg, num: Num):
    lim = num.ft(_get(cfg, "swiglu_limit"))
    g = linear(x, w1, num, True)
    u = linear(x, w3, num, True)
    u = np.clip(u, -lim, lim)
    g = np.minimum(g, lim)
    hid = (g / (num.ft(1.0) + np.exp(-g))) * u
    if weight is not None:
        hid = hid * weight
    return linear(num.r(hid), w2, num, True)


def moe(x, pre, cfg, num: Num, stats: list | None = None):
    """x [K, D] (normed) -> [K, D]. `stats` gets, per token, the margin of the top-k selection
    (biased score of the k-th chosen expert minus the best unchosen one)."""
    ne, topk = int(_get(cfg, "n_routed_experts")), int(_get(cfg, "n_activated_experts"))
    logits = num.f(x) @ num.f(pre["ffn.gate.weight"]).T
    scores = np.sqrt(np.logaddexp(num.ft(0.0), logits)).astype(num.ft)  # sqrt(softplus)
    biased = scores + num.f(pre["ffn.gate.bias"])
    out = np.zeros(x.shape, num.ft)
    for t in range(x.shape[0]):
        order = np.argsort(-biased[t], kind="stable")
        sel = order[:topk]
        if stats is not None and topk < ne:
            stats.append(float(biased[t, order[topk - 1]] - biased[t, order[topk]]))
        w = scores[t, sel]
        w = w / (w.sum() + num.ft(1e-20)) * num.ft(_get(cfg, "route_scale"))
        acc = np.zeros(x.shape[-1], num.ft)
        for e in sorted(sel.tolist()):  # ascending expert index
            we = w[list(sel).index(e)]
            acc = acc + _expert(x[t:t + 1], pre[f"ffn.experts.{e}.w1.weight"], pre[f"ffn.experts.{e}.w2.weight"],
                                pre[f"ffn.experts.{e}.w3.weight"], we, cfg, num)[0]
        if "ffn.shared_experts.w1.weight" in pre:
            acc = acc + _expert(x[t:t + 1], pre["ffn.shared_experts.w1.weight"], pre["ffn.shared_experts.w2.weight"],
                                pre["ffn.shared_experts.w3.weight"], None, cfg, num)[0]
        out[t] = acc
    return num.r(out)


def block(X, pre_in, pre, positions, ctx_keys, cfg, num: Num, stats=None, ctx_valid=None):
    """Single-pass mHC block (SPEC 2.4): a sub-layer's `pre` is used by the next sub-layer."""
    eps = float(_get(cfg, "norm_eps"))
    attn_pre, attn_post, attn_comb = hc_mixes(X, pre["hc_attn_fn"], pre["hc_attn_base"], pre["hc_attn_scale"],
                                              cfg, num)
    y = attention(rms_norm(hc_pre(X, pre_in, num), pre["attn_norm.weight"], eps, num), pre, positions, ctx_keys,
                  cfg, num, ctx_valid)
    X = hc_post(y, X, attn_post, attn_comb, num)
    ffn_pre, ffn_post, ffn_comb = hc_mixes(X, pre["hc_ffn_fn"], pre["hc_ffn_base"], pre["hc_ffn_scale"], cfg, num)
    y = moe(rms_norm(hc_pre(X, attn_pre, num), pre["ffn_norm.weight"], eps, num), pre, cfg, num, stats)
    X = hc_post(y, X, ffn_post, ffn_comb, num)
    return X, ffn_pre


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------
def _stage(tensors, s):
    p = f"mtp.{s}."
    return {k[len(p):]: v for k, v in tensors.items() if k.startswith(p)}


def n_stages(tensors) -> int:
    return 1 + max(int(k.split(".")[1]) for k in tensors if k.startswith("mtp."))


def main_x(tensors, cfg, main_hidden, num: Num):
    st0 = _stage(tensors, 0)
    mx = linear(num.r(main_hidden), st0["main_proj.weight"], num, True)
    return rms_norm(mx, st0["main_norm.weight"], float(_get(cfg, "norm_eps")), num)


def context_rows(tensors, cfg, main_hidden, positions, *, numerics="bf16", act_fp8=None, kv_fp8=None,
                 jitter=None):
    """main_hidden [T, n_taps*D] at absolute positions [T] -> ring rows [S, T, head_dim]
    (bf16 in "bf16" mode, else the working float type)."""
    num = _num(cfg, numerics, act_fp8, kv_fp8, jitter)
    mx = main_x(tensors, cfg, np.asarray(main_hidden), num)
    rows = np.stack([kv_rows(mx, _stage(tensors, s), np.asarray(positions), cfg, num)
                     for s in range(n_stages(tensors))])
    return rows.astype(BF16) if num.rounds else rows


KEY_LAYOUTS = ("chrono", "padded", "compact")


def ring_key_order(window: int, length: int, key_layout: str = "compact"):
    """(ring slot of each context key, valid mask or None): the order in which the ring rows enter the key
    list (the K draft rows follow), which fixes the 64-key blocks of the online softmax.
      "compact" the valid slots in slot order, nothing else: the draft's index list `get_dspark_topk_idxs`
                (SPEC 2.5; the default);
      "chrono"  the main model's `get_window_topk_idxs`: a full ring oldest first (slots (length + i) % W), a
                partial one slots 0..length-1 then W - length masked places (-1 indices);
      "padded"  all W slots in slot order, the invalid ones masked in place.
    "compact" differs from the others while length < W, "chrono" from the others once length > W."""
    n_valid = min(window, length)
    if key_layout == "compact":
        return np.arange(n_valid), None
    if key_layout == "padded":
        return np.arange(window), np.arange(window) < n_valid
    if key_layout == "chrono":
        if length >= window:
            return (np.arange(window) + length) % window, None
        return np.arange(window), np.arange(window) < n_valid
    raise ValueError(f"key_layout {key_layout!r}: expected one of {KEY_LAYOUTS}")


def draft_hidden(tensors, cfg, ring, length, anchor, *, numerics="bf16", act_fp8=None, kv_fp8=None,
                 jitter=None, key_layout="compact", diag: dict | None = None):
    """The parallel body: -> (h [K, D] collapsed pre-norm hidden, U f32/f64 [K, V] base logits)."""
    num = _num(cfg, numerics, act_fp8, kv_fp8, jitter)
    k, hc = int(_get(cfg, "block_size")), int(_get(cfg, "hc_mult"))
    w = int(_get(cfg, "window"))
    ring = num.f(np.asarray(ring).astype(np.float64) if num.ft == np.float64 else np.asarray(ring).astype(np.float32))
    ids = np.array([int(anchor)] + [int(_get(cfg, "noise_token_id"))] * (k - 1))
    emb = num.r(np.asarray(tensors["embed.weight"])[ids].astype(num.ft))
    X = np.broadcast_to(emb[:, None, :], (k, hc, emb.shape[-1])).copy()
    pre_in = np.zeros((k, hc), num.ft)
    pre_in[:, 0] = 1.0
    positions = int(length) + np.arange(k)
    stats = []
    order, valid = ring_key_order(w, int(length), key_layout)
    for s in range(n_stages(tensors)):
        X, pre_in = block(X, pre_in, _stage(tensors, s), positions, ring[s, order], cfg, num, stats, ctx_valid=valid)
    h = hc_pre(X, pre_in, num)
    last = _stage(tensors, n_stages(tensors) - 1)
    hn = rms_norm(h, last["norm.weight"], float(_get(cfg, "norm_eps")), num)
    u = num.f(hn) @ num.f(tensors["head.weight"]).T
    if diag is not None:
        diag["route_margins"] = np.array(stats)
        diag["min_route_margin"] = float(np.min(stats)) if stats else math.inf
    return h, u


def propose_greedy(tensors, cfg, ring, length, anchor, *, numerics="bf16", act_fp8=None, kv_fp8=None,
                   jitter=None, key_layout="compact", diag: dict | None = None):
    """One draft block at T = 0 -> (biased logits [K, V], tokens i64[K], confidence logits [K]).

    ring [S, W, hd] holds the context row of position p at slot p % W; `length` = p + 1 rows written;
    the anchor sits at rope position `length`, draft row k (0-based) at `length + k`. `diag` (a dict)
    receives route_margins / min_route_margin (MoE top-k margins) and top2_margin (per draft position,
    the biased-logit gap between the chosen token and the runner-up)."""
    num = _num(cfg, numerics, act_fp8, kv_fp8)
    h, u = draft_hidden(tensors, cfg, ring, length, anchor, numerics=numerics, act_fp8=act_fp8, kv_fp8=kv_fp8,
                        jitter=jitter, key_layout=key_layout, diag=diag)
    last = _stage(tensors, n_stages(tensors) - 1)
    k = u.shape[0]
    w1 = last.get("markov_head.embed.weight")
    w2 = last.get("markov_head.head.weight")
    conf_w = num.f(last["confidence_head.proj.weight"]).reshape(-1)
    logits = np.zeros_like(u)
    tokens = np.zeros(k, np.int64)
    conf = np.zeros(k, num.ft)
    margins = np.zeros(k)
    prev = int(anchor)
    for i in range(k):
        if w1 is not None:
            e = num.f(np.asarray(w1[prev]).astype(num.ft))
            bias = e @ num.f(w2).T
            logits[i] = u[i] + bias
        else:
            e = np.zeros(0, num.ft)
            logits[i] = u[i]
        conf[i] = np.concatenate([num.f(h[i]), e]) @ conf_w
        tokens[i] = int(np.argmax(logits[i]))
        top2 = np.sort(logits[i])[-2:]
        margins[i] = float(top2[1] - top2[0])
        prev = int(tokens[i])
    if diag is not None:
        diag["top2_margin"] = margins
    return logits, tokens, conf


class Ring:
    """The oracle's own per-request context ring: write rows at slot p % W."""

    def __init__(self, tensors, cfg, key_layout="compact", **numerics):
        self.tensors, self.cfg, self.kw, self.key_layout = tensors, cfg, numerics, key_layout
        s, w, hd = n_stages(tensors), int(_get(cfg, "window")), int(_get(cfg, "head_dim"))
        dt = {"f64": np.float64, "f32": np.float32}.get(numerics.get("numerics", "bf16"), BF16)
        self.ring = np.zeros((s, w, hd), dt)
        self.length = 0

    def ingest(self, main_hidden):
        t = main_hidden.shape[0]
        pos = self.length + np.arange(t)
        rows = context_rows(self.tensors, self.cfg, main_hidden, pos, **self.kw)
        w = self.ring.shape[1]
        for j in range(t):
            self.ring[:, pos[j] % w] = rows[:, j]
        self.length += t

    def propose(self, anchor, diag=None):
        return propose_greedy(self.tensors, self.cfg, self.ring, self.length, anchor, diag=diag,
                              key_layout=self.key_layout, **self.kw)


# ---------------------------------------------------------------------------------------------
# official storage -> dequantised tensors (SPEC 3), independent of dspark_jax.checkpoint
# ---------------------------------------------------------------------------------------------
def _e8m0_exp(scale):
    b = np.asarray(scale)
    b = b.view(np.uint8) if b.dtype.itemsize == 1 else b.astype(np.uint8)
    return b.astype(np.int32) - 127


def dequantize_official(tensors: dict) -> dict:
    """{name: array} as stored (F8_E4M3 + `<linear>.scale` 32x32 E8M0 blocks, or packed E2M1 (uint8/int8
    [out, in/2], low nibble first) + [out, in/32] E8M0) -> {name: bf16 / f32 array} without scales."""
    out = {}
    for name, w in tensors.items():
        if name.endswith(".scale") and name[:-len(".scale")] + ".weight" in tensors:
            continue
        sname = name[:-len(".weight")] + ".scale" if name.endswith(".weight") else None
        if getattr(w, "dtype", None) == "F4" and hasattr(w, "data"):  # raw F4 bytes [out, in]
            w = np.frombuffer(w.data, np.uint8).reshape(w.shape[0], w.shape[1] // 2)
        w = np.asarray(w)
        if sname is None or sname not in tensors:
            out[name] = w
            continue
        ex = _e8m0_exp(tensors[sname])
        if w.dtype == E4M3:
            vals = w.astype(np.float32)
            o, i = vals.shape
            full = np.repeat(np.repeat(ex, 32, 0), 32, 1)[:o, :i]
            out[name] = np.ldexp(vals, full).astype(BF16)
        elif w.dtype == getattr(ml_dtypes, "float4_e2m1fn", None):  # unpacked fp4 values [out, in]
            vals = w.astype(np.float32)
            full = np.repeat(ex, 32, 1)[:, :vals.shape[1]]
            out[name] = np.ldexp(vals, full).astype(BF16)
        elif w.dtype.itemsize == 1:  # packed fp4 (int8 / uint8 view)
            b = w.view(np.uint8)
            codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)
            vals = E2M1_TABLE[codes]
            full = np.repeat(ex, 32, 1)[:, :vals.shape[1]]
            out[name] = np.ldexp(vals, full).astype(BF16)
        else:
            raise ValueError(f"{name}: scaled tensor of dtype {w.dtype}")
    return out
