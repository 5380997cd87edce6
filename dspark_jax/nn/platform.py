"""Choosing an implementation by the platform a program is lowered for.

`by_platform(*args, cpu=f, default=g)` is `jax.lax.platform_dependent`: XLA:CPU gets `f` (e.g. dots
widened to f32, MoE expert tiles), TPU and GPU get `g` (bf16 dots accumulating in f32, grouped matmuls).

`accelerator_branches()` makes every `by_platform` traced inside it take the TPU / GPU branch on any
host. `dspark bench roofline` uses it to compile on this CPU the program an accelerator would run, and
read its flops and bytes. One exception: a default branch that XLA:CPU would compute densely
(`dense_on_cpu`: `jax.lax.ragged_dot`, which XLA:CPU expands to every group) cannot be measured by a CPU
compile, so there the CPU branch stays (the MoE's expert tiles: the same pairs plus padding, an upper
bound of the grouped matmul's work). Only for tracing fresh programs: a function jitted and traced before (outside
the context) keeps the branch it was traced with, since jit's cache does not see this switch.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_ACCELERATOR = contextvars.ContextVar("dspark_accelerator_branches", default=False)


def by_platform(*args, cpu, default, dense_on_cpu: bool = False):
    if _ACCELERATOR.get() and not dense_on_cpu:
        return default(*args)
    return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


@contextlib.contextmanager
def accelerator_branches():
    token = _ACCELERATOR.set(True)
    try:
        yield
    finally:
        _ACCELERATOR.reset(token)
