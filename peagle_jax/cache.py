"""Static-shape key/value cache: a pytree of per-layer arrays, donated to every jitted step.

Slot s of row b holds the key/value of that row's token written at slot s. The layout is ``[B, G, S, H]``:
each kv head's slots are contiguous, which is what a CPU batched matmul over (row, head) reads fastest.
Which slots a query may see is decided by :func:`peagle_jax.ops.visible_mask` from the row's write start,
never by what the cache holds, so stale rows (rejected drafts, padding) are harmless and later overwritten.
"""

from __future__ import annotations

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
    def zeros(cls, num_layers: int, batch: int, slots: int, kv_heads: int, head_dim: int, dtype=jnp.float32):
        shape = (batch, kv_heads, slots, head_dim)
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        )


def write_rows(cache_BGSH, new_BTGH, start_B):
    """Write T new entries per row at slots ``start[b] .. start[b]+T-1``.

    One ``dynamic_update_slice`` per row (B is static and small), done in place when the cache is donated;
    on CPU this is several times cheaper than the equivalent scatter. Invariant the callers keep:
    ``start[b] + T <= S`` for every row, padding rows included, because an update that would overrun the
    cache is shifted back to fit (XLA clamps the start index) rather than dropped.
    """
    new_BGTH = jnp.swapaxes(new_BTGH, 1, 2).astype(cache_BGSH.dtype)
    zero = jnp.zeros((), jnp.int32)
    for b in range(new_BGTH.shape[0]):
        cache_BGSH = jax.lax.dynamic_update_slice(
            cache_BGSH, new_BGTH[b : b + 1], (jnp.int32(b), zero, start_B[b].astype(jnp.int32), zero)
        )
    return cache_BGSH
