"""Static-shape key/value cache: a pytree of per-layer arrays, donated to every jitted step.

Slot s of row b holds the key/value of that row's token written at slot s. Which slots a query may see is
decided by :func:`peagle_jax.ops.visible_mask` from the row's write start, never by what the cache holds,
so stale rows (rejected drafts, padding) are harmless and are overwritten by later writes.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
    """Keys and values, one ``[B, S, G, H]`` array per layer."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def batch_size(self) -> int:
        return self.k[0].shape[0]

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[1]

    @classmethod
    def zeros(cls, num_layers: int, batch: int, slots: int, kv_heads: int, head_dim: int, dtype=jnp.float32):
        shape = (batch, slots, kv_heads, head_dim)
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        )


def write_rows(cache_BSGH, new_BTGH, start_B):
    """Write T new entries per row at slots ``start[b] .. start[b]+T-1``.

    A scatter, done in place when the cache is donated. Writes that would land at or beyond S are dropped
    (the scatter's out-of-bounds mode), so a padded bucket near the end of the cache cannot corrupt it.
    """
    B, T = new_BTGH.shape[:2]
    slots_BT = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    rows_BT = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
    return cache_BSGH.at[rows_BT, slots_BT].set(new_BTGH.astype(cache_BSGH.dtype), mode="drop")
