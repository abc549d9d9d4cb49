"""Static-shape key/value cache: a pytree of per-layer arrays, donated to every jitted step.

Slot s of row b holds the key/value of that row's token written at slot s. The layout is ``[B, G, S, H]``:
each kv head's slots are contiguous, which is what a CPU batched matmul over (row, head) reads fastest.
Which slots a query may see is decided by :func:`peagle_jax.ops.visible_mask` from the row's write start,
never by what the cache holds, so stale rows (rejected drafts, padding) are harmless and later overwritten.
A bf16 inference cache is stored as the uint16 of its bits (:func:`storage_dtype`): read it with :func:`read`.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
    """Keys and values, one ``[B, G, S, H]`` array per layer."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[2]

    @classmethod
    def zeros(cls, num_layers: int, batch: int, slots: int, kv_heads: int, head_dim: int, dtype=jnp.float32, bits=True):
        """``bits``: a bf16 cache stored as its bits (inference); False for a cache that gradients flow
        through (training: an integer bitcast has no gradient)."""
        shape, store = (batch, kv_heads, slots, head_dim), storage_dtype(dtype) if bits else jnp.dtype(dtype)
        k, v = _zeros(num_layers, shape, store)
        return cls(k=k, v=v)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _zeros(num_layers: int, shape: tuple[int, ...], dtype) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Every layer's zero keys and values in one launch. Created one by one, the 2 x L arrays of a cache were as
    many launches: 8.6 ms for a one-row SmolLM2 cache against 1.2 ms here, and a serving admission (which
    prefills into a fresh one-row cache) took 68 ms against 48 ms (bf16)."""
    return tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)), tuple(
        jnp.zeros(shape, dtype) for _ in range(num_layers)
    )


def write_rows(cache_BGSH, new_BTGH, start_B):
    """Write T new entries per row at slots ``start[b] .. start[b]+T-1`` of cache rows ``0 .. B-1`` (B: the
    rows of ``new_BTGH``; the cache may hold more, which are left as they are).

    One scatter over (row, slot) indices, done in place when the cache is donated. Invariant the callers
    keep: ``start[b] + T <= S`` for every row, padding rows included; an entry past the cache is dropped.

    Why a scatter and not one ``dynamic_update_slice`` per row: the attention reads a window of the updated
    cache, and XLA CPU fuses that slice with the last per-row update, which then needs the intermediate
    buffer twice and copies the whole cache (twice per layer). With the scatter nothing is copied: a decode
    step of SmolLM2-135M at 8 rows x 2048 slots went from ~775 ms to ~140 ms, at 1 row it is no slower.
    """
    T = new_BTGH.shape[1]
    slots_BT = start_B.astype(jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    rows_B1 = jnp.arange(new_BTGH.shape[0], dtype=jnp.int32)[:, None]  # rows 0..B-1 (the cache may hold more)
    # Advanced indices on axes 0 and 2 come first in the update's shape: [B, T, G, H], the layout given.
    new_BTGH = new_BTGH.astype(values_dtype(cache_BGSH.dtype))
    if new_BTGH.dtype != cache_BGSH.dtype:  # a cache stored as bits
        new_BTGH = jax.lax.bitcast_convert_type(new_BTGH, cache_BGSH.dtype)
    return cache_BGSH.at[rows_B1, :, slots_BT].set(new_BTGH, mode="drop")


# bf16 caches are stored as the uint16 of their bits. XLA's CPU compiler has no bf16 scatter or
# dynamic-update-slice: it converts the whole bf16 operand to f32, writes, and converts it back, a pass over
# every layer's cache per step (a bf16 decode step at 2048 slots ran at 0.79x of the f32 one). On the bits
# the write is in place, and a read bitcasts only the window it attends over (fused into that read).
_BITS = {jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16)}
_VALUES = {v: k for k, v in _BITS.items()}


def storage_dtype(dtype):
    """The dtype a cache of ``dtype`` values is stored in."""
    return _BITS.get(jnp.dtype(dtype), jnp.dtype(dtype))


def values_dtype(dtype):
    """The dtype of the values a cache stored in ``dtype`` holds."""
    return _VALUES.get(jnp.dtype(dtype), jnp.dtype(dtype))


def read(cache_slice):
    """Cache entries as values (a bitcast for a bf16 cache)."""
    dt = values_dtype(cache_slice.dtype)
    return jax.lax.bitcast_convert_type(cache_slice, dt) if dt != cache_slice.dtype else cache_slice
