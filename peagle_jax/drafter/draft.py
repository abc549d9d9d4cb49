"""Pure drafter entry points with static K: the parallel (P-EAGLE) and sequential (EAGLE-3) draft graphs.

Element layout (the EAGLE shift). Drafter element j pairs the token at position j+1 with the target's fused
hidden state g_j of position j, sits at RoPE position j and cache slot j, and predicts the token at j+2.
After a verification step that committed tokens up to position q (the last being the bonus token, whose
own target hidden state is not known yet), the drafter is fed the ``m`` new elements ``j = q-m .. q-1``:
the accepted tokens with their hidden states, the last of them (the bonus slot) pairing the bonus token
with the hidden state of the token before it. Its output predicts the first draft token.

Parallel draft window (fixed width ``C + K - 1``, ``C`` context slots): the ``m`` context elements first,
then K-1 mask elements (mask token, ``fc(mask_hidden)``) at positions ``q .. q+K-2``, then padding. The
layout is arranged with index arithmetic, so ``m`` is data and never a shape. One causal pass; rows
``m-1 .. m+K-2`` give the K draft depths.

Cache invariant. Row b's elements are written at cache slots equal to their positions, starting at
``start[b]``; a query sees committed slots ``< start[b]`` and, among this call's rows, the causal past.
Mask-slot and padding rows are written at slots ``>= start[b] + m``: the next call starts at the next
uncommitted position, so it overwrites them with real elements before any query could see them, and no
query of this call sees padding (it comes after every real row). Rejected and placeholder rows are thus
never visible to a later query.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from peagle_jax import executables, ops
from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.model import Drafter, DraftForwardOut
from peagle_jax.models.cache import KVCache


class Draft(NamedTuple):
    """Per depth k (K of them), the ``top_n`` candidates in the *target* vocabulary: ``tokens`` [B, K, top_n]
    int32 and their draft log-probabilities ``logprobs`` [B, K, top_n] (over the draft vocab), best first."""

    tokens: jax.Array
    logprobs: jax.Array


def fuse_aux(params, aux_BTX, *, cfg: DrafterConfig):
    """Target aux hidden states [B, T, X] -> fused g [B, T, D]."""
    return Drafter(cfg).apply({"params": params}, aux_BTX, method=Drafter.fuse)


@functools.partial(executables.jit, static_argnames=("cfg",))
def fused_mask_hidden(params, *, cfg: DrafterConfig):
    """``fc(mask_hidden)`` [D]: computed once when a parallel drafter is loaded, not per step."""
    return Drafter(cfg).apply({"params": params}, method=Drafter.fused_mask_hidden)


def drafter_forward(
    params,
    cache: KVCache,
    tokens_BT,
    g_BTD,
    start_B,
    *,
    cfg: DrafterConfig,
    embed_VD=None,
    mask_BTT=None,
    positions_BT=None,
    window: int | None = None,
    logits_at_BM=None,
):
    """T drafter elements per row at cache slots ``start[b] ..``; the drafter's counterpart of
    :func:`peagle_jax.models.model.forward` (``logits_at_BM`` gathers rows before the LM head).
    Returns ``(DraftForwardOut, cache)``."""
    start_B, positions_BT, visible_BTW = ops.new_token_layout(
        start_B, tokens_BT.shape[1], cache.num_slots, window, mask_BTT, positions_BT
    )
    return Drafter(cfg).apply(
        {"params": params},
        tokens_BT.astype(jnp.int32),
        g_BTD,
        positions_BT,
        start_B,
        visible_BTW,
        cache,
        embed_VD,
        logits_at_BM,
    )


def to_target_ids(params, draft_ids, cfg: DrafterConfig):
    """Draft-vocab ids -> target ids (``id + d2t[id]``; identity when U == V)."""
    if not cfg.has_vocab_map:
        return draft_ids.astype(jnp.int32)
    return (draft_ids + jnp.take(params["d2t"], draft_ids)).astype(jnp.int32)


def _top(params, logits_BKU, n: int, cfg: DrafterConfig) -> Draft:
    logprobs_BKU = jax.nn.log_softmax(logits_BKU, axis=-1)
    top_lp, top_ids = jax.lax.top_k(logprobs_BKU, n)
    return Draft(to_target_ids(params, top_ids, cfg), top_lp)


class DraftContext(NamedTuple):
    """A draft's context, one pytree: the new context elements per row (``tokens`` [B, C]: the token at j+1,
    ``aux`` [B, Q, X]: the target aux states of j, in a queue of Q >= C slots whose first C are read, see
    :func:`peagle_jax.spec.state.queue_slots`), of which the first ``count`` [B] are valid (1 <= count <= C),
    the first at drafter position ``start`` [B]."""

    tokens: jax.Array
    aux: jax.Array
    count: jax.Array
    start: jax.Array


def _context_g(params, aux_BCX, count_B, cfg):
    """Fused hidden of the context elements; rows beyond ``count`` are zeroed (padding)."""
    g_BCD = fuse_aux(params, aux_BCX, cfg=cfg)
    C = aux_BCX.shape[1]
    valid_BC = jnp.arange(C, dtype=jnp.int32)[None, :] < count_B[:, None]
    return jnp.where(valid_BC[:, :, None], g_BCD, 0).astype(g_BCD.dtype)


@functools.partial(executables.jit, static_argnames=("cfg", "K", "top_n", "window"), donate_argnames=("cache",))
def parallel_draft(
    params,
    cache,
    ctx: DraftContext,
    mask_g_D,
    embed_VD=None,
    *,
    cfg: DrafterConfig,
    K: int,
    top_n: int = 1,
    window: int | None = None,
):
    """P-EAGLE: all K draft depths in one forward pass over a fixed window of ``C + K - 1`` elements.

    ``ctx``: the new context elements (:class:`DraftContext`). ``mask_g_D`` is :func:`fused_mask_hidden`.
    Returns ``(Draft, cache)`` with ``top_n`` candidates per depth.
    """
    if not cfg.parallel:
        raise ValueError("parallel_draft needs a P-EAGLE drafter (mask token and mask_hidden)")
    tokens_BC, aux_BQX, count_B, start_B = ctx
    B, C = tokens_BC.shape
    aux_BCX = aux_BQX[:, :C]
    T = C + K - 1
    count_B = count_B.astype(jnp.int32)
    g_BCD = _context_g(params, aux_BCX, count_B, cfg)
    # Row i of the window: context element i (i < m), mask element (m <= i < m + K - 1), else padding.
    i_T = jnp.arange(T, dtype=jnp.int32)
    src_BT = jnp.minimum(i_T[None, :], C - 1)
    is_ctx_BT = i_T[None, :] < count_B[:, None]
    ctx_tokens_BT = jnp.take_along_axis(tokens_BC.astype(jnp.int32), src_BT, axis=1)
    tokens_BT = jnp.where(is_ctx_BT, ctx_tokens_BT, jnp.int32(cfg.mask_token_id))
    ctx_g_BTD = jnp.take_along_axis(g_BCD, src_BT[:, :, None], axis=1)
    g_BTD = jnp.where(is_ctx_BT[:, :, None], ctx_g_BTD, mask_g_D.astype(g_BCD.dtype)[None, None, :])
    rows_BK = count_B[:, None] - 1 + jnp.arange(K, dtype=jnp.int32)[None, :]
    out, cache = drafter_forward(
        params, cache, tokens_BT, g_BTD, start_B, cfg=cfg, embed_VD=embed_VD, window=window, logits_at_BM=rows_BK
    )
    return _top(params, out.logits, top_n, cfg), cache


@functools.partial(executables.jit, static_argnames=("cfg", "K", "top_n", "window"), donate_argnames=("cache",))
def sequential_draft(
    params,
    cache,
    ctx: DraftContext,
    embed_VD=None,
    *,
    cfg: DrafterConfig,
    K: int,
    top_n: int = 1,
    window: int | None = None,
):
    """EAGLE-3: K passes, each feeding back the drafter's own hidden state and greedy token.

    Pass 1 is one forward over the C context slots (as :func:`parallel_draft`, without mask elements); pass
    k > 1 is one element at position ``start + m + k - 2`` whose token is the previous pass's top draft
    (in target ids) and whose g is the previous pass's output hidden state. Same inputs and outputs as
    :func:`parallel_draft`; works for P-EAGLE checkpoints too (the baseline P-EAGLE is measured against).
    """
    tokens_BC, aux_BQX, count_B, start_B = ctx
    B, C = tokens_BC.shape
    aux_BCX = aux_BQX[:, :C]  # the context may sit in a longer queue (see DraftContext)
    count_B = count_B.astype(jnp.int32)
    g_BCD = _context_g(params, aux_BCX, count_B, cfg)
    last_B1 = (count_B - 1)[:, None]
    out, cache = drafter_forward(
        params, cache, tokens_BC, g_BCD, start_B, cfg=cfg, embed_VD=embed_VD, window=window, logits_at_BM=last_B1
    )
    logits_BU = out.logits[:, 0]
    hidden_B1D = jnp.take_along_axis(out.hidden, last_B1[:, :, None], axis=1)
    depths = [logits_BU]
    for k in range(1, K):
        token_B1 = to_target_ids(params, ops.argmax_first(logits_BU, axis=-1), cfg)[:, None]
        step: DraftForwardOut
        step, cache = drafter_forward(
            params,
            cache,
            token_B1,
            hidden_B1D,
            start_B + count_B + (k - 1),
            cfg=cfg,
            embed_VD=embed_VD,
            window=window,
        )
        logits_BU, hidden_B1D = step.logits[:, 0], step.hidden
        depths.append(logits_BU)
    return _top(params, jnp.stack(depths, axis=1), top_n, cfg), cache


@functools.partial(executables.jit, static_argnames=("cfg", "window"), donate_argnames=("cache",))
def drafter_prefill(
    params, cache, tokens_BT, aux_BTX, start_B, embed_VD=None, *, cfg: DrafterConfig, window: int | None = None
):
    """Seed the drafter's cache with a chunk of prompt elements (token at j+1, target aux of j) at slots
    ``start ..``. Elements past a row's prompt are padding, overwritten by the first draft call."""
    g_BTD = fuse_aux(params, aux_BTX, cfg=cfg)
    no_logits_B1 = jnp.zeros((tokens_BT.shape[0], 1), jnp.int32)  # the LM head is not needed here
    _, cache = drafter_forward(
        params, cache, tokens_BT, g_BTD, start_B, cfg=cfg, embed_VD=embed_VD, window=window, logits_at_BM=no_logits_B1
    )
    return cache
