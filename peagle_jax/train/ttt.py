"""The EAGLE-3 training-time-test (TTT) objective, on the same packed batches as the P-EAGLE one.

EAGLE-3 drafts sequentially: the element at depth d >= 1 of the chain anchored at a feeds the *drafter's
own* output hidden state of depth d - 1 (instead of P-EAGLE's ``mask_hidden``) together with the token at
its position. TTT trains exactly that in K passes, one per depth, each over every anchor of the row:

- depth 0: element a pairs ``tokens[a]`` with ``fc(aux[a])``, as P-EAGLE's depth 0;
- depth d: element a pairs ``tokens[a + d]`` (the true token, which greedy drafting reproduces when the
  previous depth was right) with the depth d - 1 output hidden of anchor a, at RoPE position a + d.

Attention is what sequential drafting from anchor a sees (the P-EAGLE mask with every depth kept): the
depth-0 elements of the same conversation at anchors <= a, and the chain's own elements of depths 1..d.
Depth d's keys sit in cache slots ``[dT, (d+1)T)``: pass d attends over the depth-0 block and, per
anchor, one slot in each of the blocks 1..d (:func:`ttt_visibility`, a chain attention). Element (a, d)
is supervised like P-EAGLE's element at position a + d (``target_hidden`` / ``loss_mask`` there) and exists
when a + d is inside a's conversation. Gradients flow through the fed-back hidden states. The loss is the
same count-normalised KL, and the metrics the same per-depth sums, so both objectives share the loop.
"""

from __future__ import annotations

import jax.numpy as jnp

from peagle_jax import ops
from peagle_jax.chain_attention import ChainVisibility
from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.model import Drafter, new_drafter_cache
from peagle_jax.train.objective import PEagleBatch, _take, depth_metrics, kl_to_targets, loss_targets, target_index


def ttt_visible(document_ids_BT, depth: int, num_depths: int):
    """[B, T, K*T] visibility of depth ``depth``'s queries over the K depth blocks of cache slots (the dense
    mask :func:`ttt_visibility` stands for; the reference the tests hold it to)."""
    B, T = document_ids_BT.shape
    a_T = jnp.arange(T, dtype=jnp.int32)
    doc = document_ids_BT
    context_BTT = (
        (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0) & (a_T[None, None, :] <= a_T[None, :, None])
    )
    own_TT = a_T[:, None] == a_T[None, :]
    blocks = [context_BTT | own_TT[None]]
    for s in range(1, num_depths):
        blocks.append(jnp.broadcast_to(own_TT[None] & (s <= depth), (B, T, T)))
    return jnp.concatenate(blocks, axis=2)


def ttt_visibility(document_ids_BT, depth: int, num_depths: int) -> ChainVisibility:
    """:func:`ttt_visible` as a :class:`peagle_jax.chain_attention.ChainVisibility` (equal to it, tested): the
    depth-0 block (the conversation up to the anchor, and the anchor's own slot) as the prefix, and the
    anchor's slot in each of the blocks 1..d as its chain. Each depth's attention costs ``T * (T + d)``
    scores instead of ``T * K * T``."""
    B, T = document_ids_BT.shape
    a_T = jnp.arange(T, dtype=jnp.int32)
    doc = document_ids_BT
    prefix_BTT = (
        (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0) & (a_T[None, None, :] <= a_T[None, :, None])
    ) | (a_T[:, None] == a_T[None, :])[None]
    chain_TE = a_T[:, None] + T * jnp.arange(1, depth + 1, dtype=jnp.int32)[None, :]
    chain_BTE = jnp.broadcast_to(chain_TE[None], (B, T, depth))
    return ChainVisibility(prefix_BTT, chain_BTE, jnp.ones((B, T, depth), bool), slots=num_depths * T)


def ttt_forward(params, batch: PEagleBatch, embed_VD=None, *, cfg: DrafterConfig, num_depths: int):
    """Per depth d (K of them): ``(draft logits [B, T, U], exists [B, T], position [B, T])`` of the elements
    anchored at every slot a of the row; with ``batch.loss_pos_BM``, of the elements at the M loss positions
    only (anchored at p - d; the LM head runs on those alone): ``[B, M, U], [B, M], [B, M]``."""
    B, T = batch.tokens_BT.shape
    K = num_depths
    drafter = Drafter(cfg)
    cache = new_drafter_cache(cfg, B, K * T, bits=False)  # gradients flow through the cache
    a_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    doc = batch.document_ids_BT
    g_BTD = drafter.apply({"params": params}, batch.aux_BTX.astype(cfg.layer.jnp_dtype), method=Drafter.fuse)
    outs = []
    for d in range(K):
        pos_BT = jnp.minimum(a_BT + d, T - 1)
        exists_BT = (a_BT + d < T) & (doc >= 0) & (_take(doc, pos_BT) == doc)
        tokens_BT = jnp.where(exists_BT, _take(batch.tokens_BT.astype(jnp.int32), pos_BT), 0)
        at_BM = None
        if batch.loss_pos_BM is not None:  # the anchors whose depth-d element sits on a loss position
            p_BM = batch.loss_pos_BM
            at_BM = jnp.maximum(p_BM - d, 0)
            exists_BT = _take(exists_BT, at_BM) & (p_BM >= d)  # p >= d: an anchor exists; -1 padding: none
            pos_BT = jnp.maximum(p_BM, 0)
        out, cache = drafter.apply(
            {"params": params},
            tokens_BT,
            g_BTD,
            a_BT + d,
            jnp.full((B,), d * T, jnp.int32),
            ttt_visibility(doc, d, K),
            cache,
            embed_VD,
            at_BM,
        )
        g_BTD = out.hidden
        outs.append((out.logits, exists_BT, pos_BT))
    return outs


def ttt_loss(params, batch: PEagleBatch, target_head_UD, embed_VD=None, *, cfg: DrafterConfig, num_depths: int):
    """EAGLE-3 TTT loss and per-depth metrics (as :func:`peagle_jax.train.objective.peagle_loss`). Only the
    per-position fields of ``batch`` are used; its COD elements are ignored (TTT keeps every depth)."""
    tgt = loss_targets(target_head_UD, batch, cfg.layer.jnp_dtype)  # per (loss) position, gathered per depth
    kls, correct, weights, depths = [], [], [], []
    for d, (logits_BTU, exists_BT, pos_BT) in enumerate(
        ttt_forward(params, batch, embed_VD, cfg=cfg, num_depths=num_depths)
    ):
        at_BT = target_index(batch, pos_BT)
        kls.append(kl_to_targets(logits_BTU, tgt, at_BT))
        correct.append(ops.argmax_first(logits_BTU, axis=-1) == _take(tgt.argmax_BT, at_BT))
        weights.append((exists_BT & (_take(batch.loss_mask_BT, pos_BT) != 0)).astype(jnp.float32))
        depths.append(jnp.full(pos_BT.shape, d, jnp.int32))
    kl_BY, w_BY = jnp.concatenate(kls, axis=1), jnp.concatenate(weights, axis=1)
    loss = jnp.sum(w_BY * kl_BY) / jnp.maximum(jnp.sum(w_BY), 1.0)
    correct_BY = jnp.concatenate(correct, axis=1)
    return loss, depth_metrics(loss, kl_BY, correct_BY, w_BY, jnp.concatenate(depths, axis=1), num_depths)
