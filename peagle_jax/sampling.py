"""Token sampling with per-row parameters as arrays, so changing them never recompiles.

Order of operations (the one the speculative verifier must repeat exactly): temperature, then top-k, then
top-p, then a categorical draw. A row with temperature 0 is greedy (first maximum of the raw logits).
Randomness is counter-based: a uniform is a hash of (row seed, position, stream, index), computed with
uint32 arithmetic inside the graph. A row's draws therefore depend only on its own seed and position, not
on the batch it shares or its bucket (PRNG keys under ``vmap`` do not promise that), and the graph holds no
threefry or host callback (both bad on Neuron).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.errors import UserError
from peagle_jax.ops import argmax_first


class SamplingParams(NamedTuple):
    """Per-row sampling parameters, each ``[B]``: temperature (0 = greedy), top_k (0 = off), top_p (1 = off)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def make(cls, batch: int, temperature=0.0, top_k=0, top_p=1.0) -> SamplingParams:
        def col(x, dtype):
            return jnp.asarray(np.broadcast_to(np.asarray(x, dtype), (batch,)))

        return cls(col(temperature, np.float32), col(top_k, np.int32), col(top_p, np.float32))


def check_sampling_args(temperature: float, top_k: int, top_p: float) -> None:
    """Validate user-facing sampling arguments; raise UserError with a one-line reason."""
    if not temperature >= 0:
        raise UserError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise UserError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0 < top_p <= 1:
        raise UserError(f"top_p must be in (0, 1], got {top_p}")


def processed_logits(logits_BV, params: SamplingParams):
    """Logits after temperature, top-k and top-p, with removed tokens at -inf (rows with temperature 0 are
    left at temperature 1; :func:`sample` treats them greedily)."""
    V = logits_BV.shape[-1]
    temp_B1 = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    scaled_BV = logits_BV.astype(jnp.float32) / temp_B1
    sorted_BV = -jnp.sort(-scaled_BV, axis=-1)
    k_B = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, V), V)
    kth_B1 = jnp.take_along_axis(sorted_BV, (k_B - 1)[:, None], axis=-1)
    ranks_V = jnp.arange(V, dtype=jnp.int32)[None, :]
    sorted_BV = jnp.where(ranks_V < k_B[:, None], sorted_BV, -jnp.inf)
    # top-p over what top-k kept: keep the smallest prefix whose probability reaches top_p (at least one).
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_BV = (before_BV < params.top_p[:, None]) | (ranks_V == 0)
    cutoff_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    threshold_B1 = jnp.maximum(kth_B1, cutoff_B1)
    return jnp.where(scaled_BV >= threshold_B1, scaled_BV, -jnp.inf)


def _mix32(x):
    """lowbias32 (C. Wellons): a fast uint32 avalanche hash."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seeds_B, positions_B, n: int, stream: int = 0):
    """Uniforms in (0, 1), float32 [B, n], a pure function of (seed, position, stream, index)."""
    row_B = _mix32(
        seeds_B.astype(jnp.uint32)
        ^ _mix32(positions_B.astype(jnp.uint32) + jnp.uint32((stream * 0x9E3779B9) & 0xFFFFFFFF))
    )
    idx_N = jnp.arange(n, dtype=jnp.uint32)
    bits_BN = _mix32(_mix32((idx_N * jnp.uint32(0x85EBCA6B))[None, :] ^ row_B[:, None]) + row_B[:, None])
    return ((bits_BN >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))


def sample(logits_BV, params: SamplingParams, seeds_B, positions_B, *, greedy_only: bool = False):
    """One token per row, int32 [B], for the token at ``positions_B``. ``greedy_only`` (static) skips the
    sort when every row is greedy. The draw is Gumbel-max over the filtered logits."""
    greedy_B = argmax_first(logits_BV, axis=-1)
    if greedy_only:
        return greedy_B
    filtered_BV = processed_logits(logits_BV, params)
    gumbel_BV = -jnp.log(-jnp.log(uniforms(seeds_B, positions_B, logits_BV.shape[-1])))
    sampled_B = argmax_first(filtered_BV + gumbel_BV, axis=-1)
    return jnp.where(params.temperature > 0, sampled_B, greedy_B)
