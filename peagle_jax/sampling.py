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
from peagle_jax.logit_rules import step_logits
from peagle_jax.ops import argmax_first
from peagle_jax.platform import branching_allowed


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


def _order_keys(x):
    """uint32 keys whose unsigned order is the float32 order of ``x`` (-0.0 is folded onto +0.0, so equal
    floats get equal keys): non-negative floats get their bits with the sign bit set, negative floats
    their bits inverted."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x).astype(jnp.float32), jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _largest_key_where(holds, batch: int):
    """Per row, the largest uint32 key ``u`` with ``holds(u)`` true, for a predicate ``holds([B, 1] keys)
    -> [B]`` that is true at 0 and monotone (true up to some key, false above). Built bit by bit from the
    top: 32 steps of one comparison and one reduction over the row each, no sort. The steps are a loop with
    a static trip count (a ``stablehlo.while`` Neuron accepts), not unrolled: on XLA's CPU backend each
    unrolled copy is its own compiled kernel, and every kernel of every graph costs the process memory
    mappings (:class:`peagle_jax.platform.MapBudget`). A sampling decode graph of SmolLM2 took 890 mappings
    with all 32 steps unrolled, 550 with 8; the sampler of 8 x 49152 logits alone takes 81 rolled and 164
    with 8 unrolled, in about the same time (13.8 vs 13.6 ms)."""

    def step(i, ans_B):
        cand_B = ans_B | (jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32)))
        return jnp.where(holds(cand_B[:, None]), cand_B, ans_B)

    return jax.lax.fori_loop(0, 32, step, jnp.zeros((batch,), jnp.uint32))


def processed_logits(logits_BV, params: SamplingParams):
    """Logits after temperature, top-k and top-p, with removed tokens at -inf (rows with temperature 0 are
    left at temperature 1; :func:`sample` treats them greedily).

    Definitions (on the temperature-scaled logits, ties included): top-k keeps every token whose logit is
    >= the k-th largest logit; top-p then keeps, in descending order, each token whose preceding mass is
    below ``top_p`` (the first always), the mass being softmax over exactly the k top-ranked tokens; a row
    keeps every token at or above both thresholds. ``top_p >= 1`` keeps everything top-k kept.

    No sort (Neuron cannot sort a 49152-wide vocabulary): both thresholds are found by a bitwise search over
    order-preserving integer keys of the logits (:func:`_cut_keys`). Where a graph may branch
    (:func:`peagle_jax.platform.branching_allowed`: not on Neuron), a batch in which no row filters (every
    top_k 0 and top_p 1, the OpenAI defaults) skips the searches, 64 passes over the vocabulary (about
    1.4 ms per row of 49152 logits on a 2-core CPU: ``python -m peagle_jax.bench.sampling``). It keeps the
    same tokens: with neither filter the searches end at the row's smallest key, and every key is >= 0. The
    branch returns only the cut-off keys, so the filter itself stays fused with what reads it (the draw).
    """
    temp_B1 = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    scaled_BV = logits_BV.astype(jnp.float32) / temp_B1
    keys_BV = _order_keys(scaled_BV)
    if branching_allowed():
        filters = jnp.any((params.top_k > 0) | (params.top_p < 1.0))
        keep_all = lambda *_: jnp.zeros(keys_BV.shape[:1], jnp.uint32)  # noqa: E731
        cut_key_B = jax.lax.cond(filters, _cut_keys, keep_all, scaled_BV, keys_BV, params)
    else:
        cut_key_B = _cut_keys(scaled_BV, keys_BV, params)
    return jnp.where(keys_BV >= cut_key_B[:, None], scaled_BV, -jnp.inf)


def _cut_keys(scaled_BV, keys_BV, params: SamplingParams):
    """Per row, the smallest key :func:`processed_logits` keeps (``keys_BV``: :func:`_order_keys` of the
    temperature-scaled logits ``scaled_BV``). The k-th largest logit is the largest key with at least k
    tokens at or above it. The top-p cut-off is the largest key whose mass at or above it reaches
    ``top_p``: the tokens strictly above it have mass below ``top_p`` and every smaller kept value would
    need more. Both land exactly on a logit value, so the filter is the sorted definition's, up to the
    rounding of the mass sums at a boundary."""
    B, V = keys_BV.shape
    k_B = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, V), V).astype(jnp.int32)
    kth_key_B = _largest_key_where(lambda u_B1: jnp.sum((keys_BV >= u_B1).astype(jnp.int32), axis=-1) >= k_B, B)
    at_or_above_kth_BV = keys_BV >= kth_key_B[:, None]
    kth_B1 = jnp.max(jnp.where(keys_BV == kth_key_B[:, None], scaled_BV, -jnp.inf), axis=-1, keepdims=True)
    # Softmax over the k top-ranked tokens: those above the k-th value, plus as many tokens tied at it as
    # fill k (``m`` of them).
    above_BV = keys_BV > kth_key_B[:, None]
    m_B1 = (k_B - jnp.sum(above_BV.astype(jnp.int32), axis=-1))[:, None].astype(jnp.float32)
    top_B1 = jnp.max(scaled_BV, axis=-1, keepdims=True)
    e_BV = jnp.where(above_BV, jnp.exp(scaled_BV - top_B1), 0.0)
    z_B1 = jnp.sum(e_BV, axis=-1, keepdims=True) + m_B1 * jnp.exp(kth_B1 - top_B1)
    probs_BV = jnp.where(at_or_above_kth_BV, jnp.exp(scaled_BV - top_B1) / z_B1, 0.0)
    top_p_B = params.top_p.astype(jnp.float32)
    cut_key_B = _largest_key_where(
        lambda u_B1: jnp.sum(jnp.where(keys_BV >= u_B1, probs_BV, 0.0), axis=-1) >= top_p_B, B
    )
    return jnp.where(top_p_B >= 1.0, kth_key_B, jnp.maximum(cut_key_B, kth_key_B))


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
    idx = jnp.arange(n, dtype=jnp.uint32)  # [n]
    bits = _mix32(_mix32((idx * jnp.uint32(0x85EBCA6B))[None, :] ^ row_B[:, None]) + row_B[:, None])  # [B, n]
    return ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))


def greedy_graph(temperature) -> bool:
    """The static ``greedy_only`` flag for a batch with these per-row temperatures (host values): whether
    to compile its greedy-only graph. Only where graphs cannot branch (Neuron, :func:`static_graphs
    <peagle_jax.platform.static_graphs>`) and every row is greedy: elsewhere the sampling graph itself
    branches to the greedy path when no row samples (:func:`greedy_or_sampled`), so one graph serves both and
    a server compiles half the graphs (each compiled kernel costs the process memory mappings on XLA's CPU
    backend: :class:`peagle_jax.platform.MapBudget`)."""
    return not branching_allowed() and not bool(np.any(np.asarray(temperature) > 0))


def greedy_modes() -> tuple[bool, ...]:
    """The ``greedy_only`` values whose graphs a warm-up compiles (:func:`greedy_graph`): both where graphs
    cannot branch, else the sampling graph alone."""
    return (True, False) if greedy_graph(0.0) else (False,)


def greedy_or_sampled(greedy, sampled, temperature_B):
    """``sampled()`` (which keeps the greedy choice of its rows with temperature 0), or ``greedy`` where no
    row samples and the graph may branch (:func:`peagle_jax.platform.branching_allowed`): the same values,
    without the filters and the draw."""
    if not branching_allowed():
        return sampled()
    return jax.lax.cond(jnp.any(temperature_B > 0), sampled, lambda: greedy)


def sample(logits_BV, params: SamplingParams, seeds_B, positions_B, *, greedy_only: bool = False, rules=None):
    """One token per row, int32 [B], for the token at ``positions_B``. ``greedy_only`` (static) skips the
    filters (every row greedy; :func:`greedy_graph`). The draw is Gumbel-max over the filtered logits.
    ``rules`` (:class:`peagle_jax.logit_rules.LogitRules`: penalties, bias, grammar) adjust the logits first."""
    logits_BV = step_logits(logits_BV, rules)
    greedy_B = argmax_first(logits_BV, axis=-1)
    if greedy_only:
        return greedy_B

    def sampled():
        filtered_BV = processed_logits(logits_BV, params)
        gumbel_BV = -jnp.log(-jnp.log(uniforms(seeds_B, positions_B, logits_BV.shape[-1])))
        sampled_B = argmax_first(filtered_BV + gumbel_BV, axis=-1)
        return jnp.where(params.temperature > 0, sampled_B, greedy_B)

    return greedy_or_sampled(greedy_B, sampled, params.temperature)
