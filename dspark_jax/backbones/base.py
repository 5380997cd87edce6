"""The backbone (target model) interface the speculative round and the trainer run against.

A backbone family is one class holding a frozen config; everything else is explicit:

    bb = Qwen3Backbone(cfg)
    params = bb.init_params(key)                 # or a loader's params
    cache = bb.init_cache(batch, max_len)        # a pytree; `cache.length` i32[B] always present
    out = bb.forward(params, cache, tokens, taps=(1, 3), tap_mode="entry")
    cache = bb.commit(out.cache, n_accepted)     # only now does the committed length move

Position bookkeeping: token t of row b sits at absolute position `cache.length[b] + t`. Its query sees
the committed cache positions `< length[b]` and the new tokens up to and including itself. `forward`
writes the new keys/values at `length .. length+T-1` (writes past `max_len` are dropped, never wrap
and never touch another row) but leaves `length` alone. `commit(cache, n)` advances it by `n <= T`;
entries written beyond the new length are masked out of every later query (a query at position p
sees keys at positions <= p only, and every position in `[length, p]` is rewritten by the call that
makes it visible), so rejected draft positions roll back for free.

Taps (the features a draft reads): with `tap_mode="entry"` tap i is the residual stream at the
ENTRY of layer i (layer 0's entry = the embeddings; V4.1 convention); with `"output"` tap i is the
OUTPUT of layer i and -1 means the embeddings (DeepSpec convention). Multi-stream (mHC) residuals are
reduced by the plain mean over streams. Taps are concatenated in the order given: `[B, T, n_taps*D]`.

The layers run as one `lax.scan` over layer-stacked params (leading "layers" axis), so compile time
does not grow with depth. Taps are selected inside the scan into an `[n_taps, B, T, D]` carry rather
than by stacking every layer's residual and gathering afterwards: same numbers, but the memory cost
is n_taps residuals instead of n_layers (it matters for long prefills of deep backbones).
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.nn.rows import readable, writable

TAP_MODES = ("entry", "output")

PyTree = Any


class BackboneOutput(NamedTuple):
    logits: jax.Array  # f32[B, T, V] ([B, 1, V] with logits_at)
    taps: jax.Array  # [B, T, n_taps * D]; [B, T, 0] when no taps were requested
    cache: PyTree  # the input cache with this call's entries written; `length` NOT advanced


class Backbone(abc.ABC):
    """Base class of a backbone family. Subclasses set `cfg` and implement the abstract methods."""

    cfg: Any

    # ---- shape facts every family exposes --------------------------------------------------------
    @property
    @abc.abstractmethod
    def dim(self) -> int:
        """Width D of one residual stream (and of one tap)."""

    @property
    @abc.abstractmethod
    def n_layers(self) -> int: ...

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    # ---- parameters ------------------------------------------------------------------------------
    @abc.abstractmethod
    def _boxed_init(self, key: jax.Array) -> PyTree:
        """Parameters with their logical-axis boxes (`nn.LogicallyPartitioned` leaves)."""

    def init_params(self, key: jax.Array) -> PyTree:
        """Random parameters as a plain pytree of arrays (logical names: see `logical_axes`)."""
        return nn.unbox(jax.jit(self._boxed_init)(key))

    def abstract_params(self) -> PyTree:
        """`jax.ShapeDtypeStruct`s of the parameters, no memory allocated (`jax.eval_shape`)."""
        return nn.unbox(jax.eval_shape(self._boxed_init, jax.random.key(0)))

    def logical_axes(self) -> PyTree:
        """Same tree as the params, each leaf a `PartitionSpec` of logical axis names."""
        return nn.get_partition_spec(jax.eval_shape(self._boxed_init, jax.random.key(0)))

    # ---- the contract ---------------------------------------------------------------------------
    @abc.abstractmethod
    def init_cache(self, batch: int, max_len: int) -> PyTree: ...

    @abc.abstractmethod
    def forward(self, params: PyTree, cache: PyTree, tokens: jax.Array, *, taps: tuple[int, ...] = (),
                tap_mode: str = "entry", logits_at: jax.Array | None = None) -> BackboneOutput:
        """tokens i32[B, T] at positions cache.length + t -> BackboneOutput (see the module docstring).

        `logits_at` i32[B] (an index into T per row) computes the logits of that one position only:
        logits come back as [B, 1, V] (a prefill that samples from its last prompt position).

        Token ids must lie in [0, V): an id >= V embeds as NaN (jnp.take's fill mode), which poisons that
        row's outputs and cache entries only, never other rows."""

    @abc.abstractmethod
    def tied(self, params: PyTree) -> dict[str, jax.Array]:
        """{"embed": [V, D], "head": [V, D]}: the embedding and LM head a draft shares."""

    @abc.abstractmethod
    def embed(self, params: PyTree, ids: jax.Array) -> jax.Array:
        """Token embeddings [..., D] in the compute dtype (one stream; no hc expansion)."""

    def commit(self, cache: PyTree, n: jax.Array) -> PyTree:
        """Advance each row's committed length by `n` i32[B] (0 <= n <= tokens written last call)."""
        n = jnp.asarray(n)
        if n.shape != cache.length.shape:
            raise ValueError(f"commit: 'n' must have shape {cache.length.shape} (one count per row), "
                             f"got {n.shape}")
        return cache._replace(length=cache.length + n.astype(jnp.int32))

    # ---- helpers shared by the families -----------------------------------------------------------
    def _check_call(self, cache: PyTree, tokens: jax.Array, taps: tuple[int, ...], tap_mode: str
                    ) -> tuple[int, ...]:
        """Validate a forward call (host side, shapes only) and return the tap STATE ids (see below)."""
        if tokens.ndim != 2:
            raise ValueError(f"forward: 'tokens' must be i32[B, T], got shape {tokens.shape}")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"forward: 'tokens' must be an integer array, got dtype {tokens.dtype}")
        if tokens.shape[0] != cache.length.shape[0]:
            raise ValueError(f"forward: 'tokens' has batch {tokens.shape[0]} but the cache was built for "
                             f"batch {cache.length.shape[0]}")
        return tap_state_ids(taps, tap_mode, self.n_layers)


def tap_state_ids(taps: tuple[int, ...], tap_mode: str, n_layers: int) -> tuple[int, ...]:
    """Map requested taps to residual STATE ids: state s = entry of layer s = output of layer s-1
    (state 0 = embeddings, state n_layers = the last layer's output, before the final norm)."""
    if tap_mode not in TAP_MODES:
        raise ValueError(f"forward: 'tap_mode' must be one of {TAP_MODES}, got {tap_mode!r}")
    try:
        taps = tuple(int(t) for t in taps)
    except TypeError:
        raise ValueError(f"forward: 'taps' must be a tuple of layer ids, got {taps!r}") from None
    if tap_mode == "entry":
        lo, hi, shift = 0, n_layers - 1, 0
    else:
        lo, hi, shift = -1, n_layers - 1, 1
    bad = [t for t in taps if not lo <= t <= hi]
    if bad:
        raise ValueError(f"forward: 'taps' {bad} out of range for tap_mode={tap_mode!r} with {n_layers} layers "
                         f"(expected layer ids in [{lo}, {hi}])")
    return tuple(t + shift for t in taps)


def record_taps(buf: jax.Array, state: jax.Array, state_id, tap_states: tuple[int, ...]) -> jax.Array:
    """Inside the layer scan: store `state` [B, T, D] into every slot of `buf` [n_taps, B, T, D] whose
    tap asks for residual state `state_id` (a traced scalar)."""
    if not tap_states:
        return buf
    want = jnp.asarray(tap_states, jnp.int32) == state_id
    return jnp.where(want[:, None, None, None], state[None].astype(buf.dtype), buf)


def taps_to_features(buf: jax.Array, batch: int, length: int, dtype) -> jax.Array:
    """[n_taps, B, T, D] -> [B, T, n_taps*D] in tap order (an empty [B, T, 0] when there are none)."""
    if buf.shape[0] == 0:
        return jnp.zeros((batch, length, 0), dtype)
    return jnp.moveaxis(buf, 0, 2).reshape(batch, length, -1)


def at_positions(x: jax.Array, index: jax.Array | None) -> jax.Array:
    """x [B, T, ...] -> x[b, index[b]] as [B, 1, ...] (index i32[B]); None keeps every position.

    The LM head is the largest matmul of a prefill: a caller that needs one row's logits (the last
    prompt position) selects that row before the final norm and head instead of after."""
    if index is None:
        return x
    idx = jnp.asarray(index, jnp.int32).reshape((x.shape[0], 1) + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, idx, axis=1)


def query_positions(length: jax.Array, t: int) -> jax.Array:
    """Absolute positions i32[B, T] of this call's tokens."""
    return length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


def cache_visibility(positions: jax.Array, max_len: int) -> jax.Array:
    """visible bool[B, T, S]: cache slot s is visible to the query at `positions[b, t]` iff s <= that
    position. Slots below the committed length hold committed tokens; slots from the committed length up
    to the query's own position were (re)written by this very call, so stale rolled-back entries never
    show. Slots no query of the call sees may hold anything (a previous request's leftovers, even
    non-finite values): the attention core zeroes them (`nn.attention.KeySegment`)."""
    slots = jnp.arange(max_len, dtype=jnp.int32)
    return slots[None, None, :] <= positions[:, :, None]


@jax.custom_vjp
def write_rows(store: jax.Array, layer, new: jax.Array, positions: jax.Array) -> jax.Array:
    """store [L, B, S, ...] <- new [B, T, ...] at (layer, b, positions[b, t]); out-of-range dropped.

    A bf16 store is written through its uint16 view (`nn.rows.writable`): XLA:CPU computes a bf16 scatter
    on an f32 copy of the WHOLE layer-stacked cache, converted there and back at every layer (roofline
    qwen3_8b/decode: 2.0 TB per step). The bit view has no derivative (JAX would give a silent zero),
    so the write has its own backward pass: that of `.at[...].set`."""
    b = _batch_rows(new)
    rows = writable(new.astype(store.dtype))
    return readable(writable(store).at[layer, b, positions].set(rows, mode="drop"), store.dtype)


def _batch_rows(new: jax.Array) -> jax.Array:
    return jnp.arange(new.shape[0], dtype=jnp.int32)[:, None]


def _write_rows_forward(store, layer, new, positions):
    return write_rows(store, layer, new, positions), (layer, positions, jnp.zeros((), new.dtype))


def _write_rows_backward(residuals, d_out):
    layer, positions, zero = residuals
    b = jnp.broadcast_to(_batch_rows(positions), positions.shape)
    d_new = d_out.at[layer, b, positions].get(mode="fill", fill_value=0).astype(zero.dtype)
    return d_out.at[layer, b, positions].set(0, mode="drop"), None, d_new, None


write_rows.defvjp(_write_rows_forward, _write_rows_backward)


# A layer loop that writes a bf16 cache layer by layer pays `write_rows`' view twice per layer (XLA:CPU
# copies the whole cache into and out of the uint16 view: 4 x 87 GB per Qwen3-8B decode step). It can
# carry the view instead: `cache_view` once before the loop, `write_and_read` in each layer,
# `cache_from_view` after it. The view has no derivative, so `write_and_read` carries the gradient from the
# layer's rows to the new entries itself, and a gradient with respect to the incoming cache is refused
# (no caller takes one; JAX would give a silent zero).
@jax.custom_vjp
def cache_view(store: jax.Array) -> jax.Array:
    """The layer-stacked cache in the form `write_and_read` writes (`nn.rows.writable`)."""
    return writable(store)


def _cache_view_forward(store):
    return cache_view(store), None


def _cache_view_backward(_, d_view):
    raise NotImplementedError("a gradient with respect to the incoming KV cache is not supported: the layer "
                              "loop carries the cache as a bit view (backbones.base.cache_view)")


cache_view.defvjp(_cache_view_forward, _cache_view_backward)


def cache_from_view(view: jax.Array, dtype) -> jax.Array:
    return readable(view, dtype)


def _entry_dtype(view: jax.Array):
    """The dtype of the cache a `cache_view` shows (`writable` turns only bf16 into uint16)."""
    return jnp.dtype(jnp.bfloat16) if view.dtype == jnp.uint16 else view.dtype


@jax.custom_vjp
def write_and_read(view: jax.Array, layer, new: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`write_rows` on a `cache_view`, and that layer's cache [B, S, ...] in the cache's dtype.

    A scatter, not one dynamic-update-slice per row (which XLA charges less, a fused scatter being charged
    its whole output): on a cache sharded over its rows (the `data` axis), a dynamic-update-slice at a
    dynamic row makes the SPMD partitioner all-gather the whole cache, where the scatter gathers only
    the new entries."""
    dtype = _entry_dtype(view)
    view = view.at[layer, _batch_rows(new), positions].set(writable(new.astype(dtype)), mode="drop")
    return view, readable(view[layer], dtype)


def _write_and_read_forward(view, layer, new, positions):
    return write_and_read(view, layer, new, positions), (positions, jnp.zeros((), new.dtype))


def _write_and_read_backward(residuals, cotangents):
    positions, zero = residuals
    _, d_rows = cotangents  # the view's own cotangent carries nothing: see cache_view
    b = jnp.broadcast_to(_batch_rows(positions), positions.shape)
    d_new = d_rows.at[b, positions].get(mode="fill", fill_value=0).astype(zero.dtype)
    return None, None, d_new, None


write_and_read.defvjp(_write_and_read_forward, _write_and_read_backward)


def as_dtype(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]
