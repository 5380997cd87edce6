"""Kernel dispatch (dspark_jax.kernels._common), the same for every kernel: "auto" / "xla" / "pallas" off
and on TPU, and the fallback for shapes a kernel cannot run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from dspark_jax.kernels import _common
from dspark_jax.kernels.markov_sampler import markov_sample
from dspark_jax.kernels.window_attention import window_attention

S = jax.ShapeDtypeStruct
SCALE = 128 ** -0.5  # the attention inputs' head_dim below is 128


def _has_pallas_call(fn, *structs) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*structs))


def test_dispatch_routes(monkeypatch):
    attn = (S((2, 5, 4, 128), jnp.float32), S((2, 16, 128), jnp.float32), S((2,), jnp.int32),
            S((2, 5, 128), jnp.float32), S((4,), jnp.float32))
    samp = (S((2, 5, 300), jnp.float32), S((2,), jnp.int32), S((300, 16), jnp.float32), S((300, 16), jnp.float32),
            S((2,), jnp.float32), S((2, 5, 300), jnp.float32))
    a = lambda impl: (lambda *x: window_attention(*x, scale=SCALE, impl=impl))  # noqa: E731
    m = lambda impl: (lambda *x: markov_sample(*x, impl=impl))  # noqa: E731
    # off TPU: auto and xla are the reference, pallas is the (interpreted) kernel
    assert not _has_pallas_call(a("auto"), *attn) and not _has_pallas_call(m("auto"), *samp)
    assert not _has_pallas_call(a("xla"), *attn) and not _has_pallas_call(m("xla"), *samp)
    assert _has_pallas_call(a("pallas"), *attn) and _has_pallas_call(m("pallas"), *samp)
    # on TPU: auto is the kernel ...
    monkeypatch.setattr(_common.jax, "default_backend", lambda: "tpu")
    assert _has_pallas_call(a("auto"), *attn) and _has_pallas_call(m("auto"), *samp)
    # ... except for shapes it cannot run (a 64K-row ring; V >= 2^24), where auto falls back and pallas raises
    big_attn = (S((8, 5, 64, 512), jnp.bfloat16), S((8, 1 << 16, 512), jnp.bfloat16), S((8,), jnp.int32),
                S((8, 5, 512), jnp.bfloat16), S((64,), jnp.float32))
    v = 1 << 24
    big_samp = (S((2, 5, v), jnp.float32), S((2,), jnp.int32), S((v, 16), jnp.bfloat16), S((v, 16), jnp.bfloat16),
                S((2,), jnp.float32), S((2, 5, v), jnp.float32))
    assert not _has_pallas_call(a("auto"), *big_attn) and not _has_pallas_call(m("auto"), *big_samp)
    with pytest.raises(ValueError, match="VMEM"):
        jax.make_jaxpr(a("pallas"))(*big_attn)
    with pytest.raises(ValueError, match="2\\^24"):
        jax.make_jaxpr(m("pallas"))(*big_samp)
