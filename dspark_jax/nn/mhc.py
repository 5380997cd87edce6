"""Single-pass manifold-constrained hyper-connections (mHC), V4.1 flavour (SPEC 2.4).

The residual stream is `hc` parallel copies X [.., hc, D]. Before each sub-layer, one linear map of the
flattened streams gives 24 mixing numbers (for hc = 4): `pre` (how to collapse the streams into the
sub-layer input), `post` (how much of the sub-layer output each stream receives) and `comb` (a
near-doubly-stochastic stream-mixing matrix, made so by Sinkhorn iterations).

"Single pass": the `pre` computed before a sub-layer is used to collapse the input of the NEXT
sub-layer; the sub-layer itself uses the previous one's `pre` (the draft's first one is one-hot on
stream 0). `MhcBlock` is that block (SPEC 2.4), shared by the V4.1 draft and the mHC backbone, which
differ only in what the attention reads (a window ring, a causal cache) and the FFN (MoE, dense).
"""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.nn.norm import RMSNorm
from dspark_jax.nn.params import param
from dspark_jax.nn.rounding import to_dtype


def sinkhorn(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """[.., n, n] raw logits -> near-doubly-stochastic matrix; V4.1's exact sequence of normalisations.

    Row softmax (+eps), one column normalisation, then (iters - 1) row-then-column rounds, so the
    result ends on a column normalisation.
    """
    c = jax.nn.softmax(logits, axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
    return c


def hc_mixes(streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, iters: int,
             eps: float, norm_eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """streams [.., hc, D] -> (pre [.., hc], post [.., hc], comb [.., hc, hc]), all f32.

    One RMS statistic per token over all hc*D values (no weight), then the 24 mixing logits.
    """
    hc = streams.shape[-2]
    x = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)  # stream-major flatten
    rho = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + norm_eps)
    m = jnp.einsum("...k,mk->...m", x, fn.astype(jnp.float32), precision="highest") * rho
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2.0 * jax.nn.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb_logits = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).reshape(*m.shape[:-1], hc, hc)
    return pre, post, sinkhorn(comb_logits, iters, eps)


def hc_pre(streams: jax.Array, pre: jax.Array) -> jax.Array:
    """Collapse: sum_i pre[i] * X_i (f32), back in the streams' dtype. [.., hc, D] -> [.., D]."""
    y = jnp.einsum("...i,...id->...d", pre.astype(jnp.float32), streams.astype(jnp.float32),
                   precision="highest")
    return to_dtype(y, streams.dtype)


def hc_post(y: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """Expand: Y_j = post[j] * y + sum_i comb[i, j] * X_i. [.., D], [.., hc, D] -> [.., hc, D]."""
    mixed = jnp.einsum("...ij,...id->...jd", comb, streams.astype(jnp.float32), precision="highest")
    out = post[..., :, None] * y.astype(jnp.float32)[..., None, :] + mixed
    return to_dtype(out, streams.dtype)


def one_hot_pre(hc: int, lead_shape: tuple[int, ...]) -> jax.Array:
    """The draft's first `pre`: take stream 0."""
    return jnp.broadcast_to(jax.nn.one_hot(0, hc, dtype=jnp.float32), (*lead_shape, hc))


class HyperConnection(nn.Module):
    """Holds one sub-layer's mixing parameters (fn [M, hc*D], base [M], scale [3], all f32)."""

    hc: int
    dim: int
    iters: int
    eps: float
    norm_eps: float

    @nn.compact
    def __call__(self, streams: jax.Array):
        m = (2 + self.hc) * self.hc
        fn = param(self, "fn", nn.initializers.normal(stddev=(self.hc * self.dim) ** -0.5 * 0.1),
                   (m, self.hc * self.dim), "float32", ("hc_mix", "hc_embed"))
        base = param(self, "base", nn.initializers.zeros, (m,), "float32", ("hc_mix",))
        scale = param(self, "scale", nn.initializers.ones, (3,), "float32", (None,))
        return hc_mixes(streams, fn, base, scale, iters=self.iters, eps=self.eps, norm_eps=self.norm_eps)


class MhcBlock(nn.Module):
    """One single-pass mHC block (SPEC 2.4):

        attn_pre, attn_post, attn_comb = hc_mixes(X; hc_attn)
        y = attn(attn_norm(hc_pre(X, pre_in)));   X = hc_post(y, X, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = hc_mixes(X; hc_ffn)
        y = ffn(ffn_norm(hc_pre(X, attn_pre)));   X = hc_post(y, X, ffn_post, ffn_comb)
        -> (X, ffn_pre)                           ffn_pre is the next block's pre_in

    This class holds the norms and hyper-connections (`cfg`: dim, hc_mult, hc_sinkhorn_iters, hc_eps,
    norm_eps, param_dtype); a subclass adds its `attn` and `ffn` in `setup` and calls `mix`."""

    cfg: Any

    def setup(self):
        c = self.cfg
        hc = dict(hc=c.hc_mult, dim=c.dim, iters=c.hc_sinkhorn_iters, eps=c.hc_eps, norm_eps=c.norm_eps)
        self.attn_norm = RMSNorm(c.dim, c.norm_eps, c.param_dtype)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps, c.param_dtype)
        self.hc_attn = HyperConnection(**hc)
        self.hc_ffn = HyperConnection(**hc)

    def mix(self, streams: jax.Array, pre_in: jax.Array, attend: Callable) -> tuple[jax.Array, jax.Array, Any]:
        """streams [.., hc, D] -> (streams, ffn_pre, aux); attend(x [.., D]) -> (y [.., D], aux) runs the
        attention sub-layer on its normed input, `self.ffn` the FFN."""
        attn_pre, attn_post, attn_comb = self.hc_attn(streams)
        y, aux = attend(self.attn_norm(hc_pre(streams, pre_in)))
        streams = hc_post(y, streams, attn_post, attn_comb)
        ffn_pre, ffn_post, ffn_comb = self.hc_ffn(streams)
        y = self.ffn(self.ffn_norm(hc_pre(streams, attn_pre)))
        return hc_post(y, streams, ffn_post, ffn_comb), ffn_pre, aux
