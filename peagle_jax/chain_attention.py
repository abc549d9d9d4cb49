"""Attention under training's visibilities: a dense prefix plus each query's own short chain.

P-EAGLE training attends Y elements (depth-0 tokens and COD-sampled mask elements) over the same Y elements.
A query sees the depth-0 elements up to its anchor and the at most K - 1 elements of its own chain, so
:class:`ChainVisibility` stores that as a ``[B, Y, C]`` prefix mask and ``[B, Y, E]`` gathered chain slots,
and :func:`chain_attention` costs ``Y * (C + E)`` scores instead of ``Y * Y``. EAGLE-3's training-time test
(:mod:`peagle_jax.train.ttt`) has the same form at each depth d: T queries over the depth-0 block of T slots
and, per query, its own slot in each of the d deeper blocks of the K * T-slot cache.

The computation is tiled over the queries, forward and backward, with a hand-written gradient (the usual
fused-attention one: the backward recomputes each tile's probabilities from the saved log-sum-exp instead of
keeping them). Written whole, a layer's ``[B, N, Y, C]`` f32 scores and probabilities (63 MB for a
2 x 512-position batch of SmolLM2's drafter) go through memory several times, forward and backward, and on
a CPU those passes, not the products, dominate the attention; a tile of about :data:`TILE_SCORES` scores
stays in the CPU's cache between its product and its softmax. Other backends run it as one tile. The
training step's time: ``python -m peagle_jax.bench.train`` (docs/bench/train/README.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from peagle_jax.ops import MASK_VALUE, einsum_f32

# Scores per tile on the CPU (all rows, heads and prefix slots of a tile's queries): 8 MiB of f32, chosen by
# timing the training step at half, twice and four times as many tiles.
TILE_SCORES = 1 << 21


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["prefix_BTC", "chain_BTE", "chain_ok_BTE"], meta_fields=["slots"]
)
@dataclasses.dataclass(frozen=True)
class ChainVisibility:
    """A visibility of T new queries over a window of S cache slots made of a dense prefix and a few gathered
    slots: query t sees prefix slot c < C iff ``prefix_BTC[b, t, c]``, and slot ``chain_BTE[b, t, e]`` iff
    ``chain_ok_BTE[b, t, e]``; no other slot. The chain slots must lie at or beyond C (never counted twice)
    and below S. ``slots`` is S (0: S = T, the queries' own slots from 0).

    P-EAGLE training's element mask has this form (:func:`peagle_jax.train.objective.element_visibility`):
    the depth-0 elements up to the query's anchor, then the query's own chain of at most K - 1 mask elements.
    So has EAGLE-3's at depth d (:func:`peagle_jax.train.ttt.ttt_visibility`): the depth-0 block, then the
    anchor's own slot in each of the d deeper blocks. Passed to :func:`peagle_jax.ops.attention` in place of a
    boolean mask, it costs ``T * (C + E)`` scores instead of ``T * S``.
    """

    prefix_BTC: jax.Array  # bool
    chain_BTE: jax.Array  # int32 slot indices
    chain_ok_BTE: jax.Array  # bool
    slots: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        """The shape of the dense [B, T, S] mask it stands for (the attention window is S slots)."""
        B, T, _ = self.prefix_BTC.shape
        return (B, T, self.slots or T)

    @property
    def arrays(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(prefix, chain slots, chain ok)."""
        return (self.prefix_BTC, self.chain_BTE, self.chain_ok_BTE)


def num_tiles(B: int, T: int, N: int, C: int) -> int:
    """Query tiles for T queries of N heads over C prefix slots: about :data:`TILE_SCORES` scores each on the
    CPU, one elsewhere."""
    if jax.default_backend() != "cpu":
        return 1
    return max(1, min(T, round(B * T * N * C / TILE_SCORES)))


def chain_attention(q_BTNH, k_BGSH, v_BGSH, vis: ChainVisibility):
    """Grouped-query attention of T queries over S slots under ``vis``: one softmax in fp32 over the prefix
    and the chain, the products through :func:`peagle_jax.ops.einsum_f32` (bf16 operands: the bf16 kernel).
    Tiled over the queries (:func:`num_tiles`); T is padded to a multiple of the tile count with queries that
    see nothing, and their rows are dropped."""
    B, T, N, _ = q_BTNH.shape
    n = num_tiles(B, T, N, vis.prefix_BTC.shape[2])
    pad = -T % n
    if pad:
        q_BTNH = jnp.pad(q_BTNH, ((0, 0), (0, pad), (0, 0), (0, 0)))
        arrays = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in vis.arrays)  # False / slot 0
        vis = ChainVisibility(*arrays, slots=vis.slots)
    return _tiled(n, q_BTNH, k_BGSH, v_BGSH, *vis.arrays)[:, :T]


def _tiles(n: int, x):
    """``[B, T, ...]`` as n tiles ``[n, B, T / n, ...]``."""
    B, T = x.shape[:2]
    return jnp.swapaxes(x.reshape(B, n, T // n, *x.shape[2:]), 0, 1)


def _untile(x):
    n, B, Tt = x.shape[:3]
    return jnp.swapaxes(x, 0, 1).reshape(B, n * Tt, *x.shape[3:])


def _prefix_scores(q_BTNH, k_BGSH, prefix_BTC):
    """The masked, scaled prefix scores [B, G, J, T, C] (f32) and the queries as the product's rows [B, G, M, H]."""
    B, T, N, H = q_BTNH.shape
    G, C = k_BGSH.shape[1], prefix_BTC.shape[2]
    J = N // G
    q_BGMH = jnp.transpose(q_BTNH.reshape(B, T, G, J, H), (0, 2, 3, 1, 4)).reshape(B, G, J * T, H).astype(k_BGSH.dtype)
    s_BGJTC = einsum_f32("BGMH,BGCH->BGMC", q_BGMH, k_BGSH[:, :, :C]).reshape(B, G, J, T, C) / math.sqrt(H)
    return jnp.where(prefix_BTC[:, None, None], s_BGJTC, MASK_VALUE), q_BGMH


def _gather_chain(x_BGSH, chain_BTE):
    """The chain slots of every query, [B, T, G, E, H] in f32: per query a small batched product over (B, T, G)
    (with the J heads anywhere but next to H, XLA materialises the slots J times)."""
    B, G, _, H = x_BGSH.shape
    T, E = chain_BTE.shape[1:]
    idx_BR11 = chain_BTE.reshape(B, T * E, 1, 1).astype(jnp.int32)
    x_BRGH = jnp.take_along_axis(jnp.transpose(x_BGSH, (0, 2, 1, 3)), idx_BR11, axis=1)
    return jnp.transpose(x_BRGH.reshape(B, T, E, G, H), (0, 1, 3, 2, 4)).astype(jnp.float32)


def _chain_scores(q_BTNH, k_BTGEH, chain_ok_BTE, dt):
    """The masked, scaled chain scores [B, T, G, J, E] (f32) and the queries [B, T, G, J, H] (rounded to dt, f32)."""
    B, T, N, H = q_BTNH.shape
    G = k_BTGEH.shape[2]
    q_BTGJH = q_BTNH.reshape(B, T, G, N // G, H).astype(dt).astype(jnp.float32)
    s_BTGJE = jnp.einsum("BTGJH,BTGEH->BTGJE", q_BTGJH, k_BTGEH) / math.sqrt(H)
    return jnp.where(chain_ok_BTE[:, :, None, None], s_BTGJE, MASK_VALUE), q_BTGJH


def _tile_forward(q_BTNH, k_BGSH, v_BGSH, prefix_BTC, chain_BTE, chain_ok_BTE):
    """One tile's output [B, T, N, H] and each query's log-sum-exp [B, G, J, T] (f32)."""
    B, T, N, H = q_BTNH.shape
    G, C, E = k_BGSH.shape[1], prefix_BTC.shape[2], chain_BTE.shape[2]
    J, dt = N // G, k_BGSH.dtype
    s_BGJTC, _ = _prefix_scores(q_BTNH, k_BGSH, prefix_BTC)
    max_BGJT = jnp.max(s_BGJTC, axis=-1)
    if E:
        s_BTGJE, _ = _chain_scores(q_BTNH, _gather_chain(k_BGSH, chain_BTE), chain_ok_BTE, dt)
        max_BGJT = jnp.maximum(max_BGJT, jnp.transpose(jnp.max(s_BTGJE, axis=-1), (0, 2, 3, 1)))
    exp_BGJTC = jnp.exp(s_BGJTC - max_BGJT[..., None])
    sum_BGJT = jnp.sum(exp_BGJTC, axis=-1)
    if E:
        exp_BTGJE = jnp.exp(s_BTGJE - jnp.transpose(max_BGJT, (0, 3, 1, 2))[..., None])
        sum_BGJT = sum_BGJT + jnp.transpose(jnp.sum(exp_BTGJE, axis=-1), (0, 2, 3, 1))
    inv_BGJT = 1.0 / sum_BGJT
    p_BGMC = (exp_BGJTC * inv_BGJT[..., None]).astype(dt).reshape(B, G, J * T, C)
    out_BGJTH = einsum_f32("BGMC,BGCH->BGMH", p_BGMC, v_BGSH[:, :, :C]).reshape(B, G, J, T, H)
    out_BTGJH = jnp.transpose(out_BGJTH, (0, 3, 1, 2, 4))
    if E:
        p_BTGJE = (exp_BTGJE * jnp.transpose(inv_BGJT, (0, 3, 1, 2))[..., None]).astype(dt).astype(jnp.float32)
        out_BTGJH = out_BTGJH + jnp.einsum("BTGJE,BTGEH->BTGJH", p_BTGJE, _gather_chain(v_BGSH, chain_BTE))
    return out_BTGJH.astype(dt).reshape(B, T, N, H), max_BGJT + jnp.log(sum_BGJT)


def _tile_backward(q_BTNH, k_BGSH, v_BGSH, prefix_BTC, chain_BTE, chain_ok_BTE, out_BTNH, lse_BGJT, dout_BTNH):
    """One tile's query gradient [B, T, N, H] and its key and value gradients [B, G, S, H] (f32): the
    probabilities recomputed from ``lse``, ``dS = P * (dP - rowsum(dO * O))``."""
    B, T, N, H = q_BTNH.shape
    G, S, C, E = k_BGSH.shape[1], k_BGSH.shape[2], prefix_BTC.shape[2], chain_BTE.shape[2]
    J, dt, scale = N // G, k_BGSH.dtype, 1.0 / math.sqrt(H)
    do_BTGJH = dout_BTNH.reshape(B, T, G, J, H).astype(dt)
    rowsum_BTGJ = jnp.sum(do_BTGJH.astype(jnp.float32) * out_BTNH.reshape(B, T, G, J, H).astype(jnp.float32), -1)
    rowsum_BGJT = jnp.transpose(rowsum_BTGJ, (0, 2, 3, 1))
    s_BGJTC, q_BGMH = _prefix_scores(q_BTNH, k_BGSH, prefix_BTC)
    p_BGJTC = jnp.exp(s_BGJTC - lse_BGJT[..., None])
    do_BGMH = jnp.transpose(do_BTGJH, (0, 2, 3, 1, 4)).reshape(B, G, J * T, H)
    dv_BGCH = einsum_f32("BGMC,BGMH->BGCH", p_BGJTC.astype(dt).reshape(B, G, J * T, C), do_BGMH)
    dp_BGJTC = einsum_f32("BGMH,BGCH->BGMC", do_BGMH, v_BGSH[:, :, :C]).reshape(B, G, J, T, C)
    ds_BGMC = (p_BGJTC * (dp_BGJTC - rowsum_BGJT[..., None]) * scale).astype(dt).reshape(B, G, J * T, C)
    dq_BGMH = einsum_f32("BGMC,BGCH->BGMH", ds_BGMC, k_BGSH[:, :, :C])
    dk_BGCH = einsum_f32("BGMC,BGMH->BGCH", ds_BGMC, q_BGMH)
    dq_BTGJH = jnp.transpose(dq_BGMH.reshape(B, G, J, T, H), (0, 3, 1, 2, 4))
    to_slots = ((0, 0), (0, 0), (0, S - C), (0, 0))
    dk_BGSH, dv_BGSH = jnp.pad(dk_BGCH, to_slots), jnp.pad(dv_BGCH, to_slots)
    if E:
        k_BTGEH, v_BTGEH = _gather_chain(k_BGSH, chain_BTE), _gather_chain(v_BGSH, chain_BTE)
        s_BTGJE, q_BTGJH = _chain_scores(q_BTNH, k_BTGEH, chain_ok_BTE, dt)
        p_BTGJE = jnp.exp(s_BTGJE - jnp.transpose(lse_BGJT, (0, 3, 1, 2))[..., None])
        do32_BTGJH = do_BTGJH.astype(jnp.float32)
        dv_BTGEH = jnp.einsum("BTGJE,BTGJH->BTGEH", p_BTGJE.astype(dt).astype(jnp.float32), do32_BTGJH)
        dp_BTGJE = jnp.einsum("BTGJH,BTGEH->BTGJE", do32_BTGJH, v_BTGEH)
        ds_BTGJE = p_BTGJE * (dp_BTGJE - rowsum_BTGJ[..., None]) * scale
        dq_BTGJH = dq_BTGJH + jnp.einsum("BTGJE,BTGEH->BTGJH", ds_BTGJE, k_BTGEH)
        dk_BTGEH = jnp.einsum("BTGJE,BTGJH->BTGEH", ds_BTGJE, q_BTGJH)
        rows_B1 = jnp.arange(B, dtype=jnp.int32)[:, None]
        slots_BR = chain_BTE.reshape(B, T * E).astype(jnp.int32)

        def scatter(acc_BGSH, d_BTGEH):  # the gather's transpose: add each chain slot's gradient at its slot
            d_BRGH = jnp.transpose(d_BTGEH, (0, 1, 3, 2, 4)).reshape(B, T * E, G, H)
            acc_BSGH = jnp.transpose(acc_BGSH, (0, 2, 1, 3)).at[rows_B1, slots_BR].add(d_BRGH)
            return jnp.transpose(acc_BSGH, (0, 2, 1, 3))

        dk_BGSH, dv_BGSH = scatter(dk_BGSH, dk_BTGEH), scatter(dv_BGSH, dv_BTGEH)
    return dq_BTGJH.reshape(B, T, N, H).astype(q_BTNH.dtype), dk_BGSH, dv_BGSH


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tiled(n, q_BTNH, k_BGSH, v_BGSH, prefix_BTC, chain_BTE, chain_ok_BTE):
    return _tiled_forward(n, q_BTNH, k_BGSH, v_BGSH, prefix_BTC, chain_BTE, chain_ok_BTE)[0]


def _tiled_forward(n, q_BTNH, k_BGSH, v_BGSH, prefix_BTC, chain_BTE, chain_ok_BTE):
    per_tile = (_tiles(n, x) for x in (q_BTNH, prefix_BTC, chain_BTE, chain_ok_BTE))
    out_nBTNH, lse_nBGJT = jax.lax.map(lambda t: _tile_forward(t[0], k_BGSH, v_BGSH, *t[1:]), tuple(per_tile))
    return _untile(out_nBTNH), (q_BTNH, k_BGSH, v_BGSH, prefix_BTC, chain_BTE, chain_ok_BTE, out_nBTNH, lse_nBGJT)


def _tiled_backward(n, res, dout_BTNH):
    q_BTNH, k_BGSH, v_BGSH, prefix_BTC, chain_BTE, chain_ok_BTE, out_nBTNH, lse_nBGJT = res

    def tile(acc, t):
        q, prefix, chain, ok, out, lse, dout = t
        dq, dk, dv = _tile_backward(q, k_BGSH, v_BGSH, prefix, chain, ok, out, lse, dout)
        return (acc[0] + dk, acc[1] + dv), dq

    per_tile = (_tiles(n, x) for x in (q_BTNH, prefix_BTC, chain_BTE, chain_ok_BTE))
    zero = jnp.zeros(k_BGSH.shape, jnp.float32)
    (dk, dv), dq_nBTNH = jax.lax.scan(tile, (zero, zero), (*per_tile, out_nBTNH, lse_nBGJT, _tiles(n, dout_BTNH)))
    return _untile(dq_nBTNH), dk.astype(k_BGSH.dtype), dv.astype(v_BGSH.dtype), None, None, None


_tiled.defvjp(_tiled_forward, _tiled_backward)
