"""The P-EAGLE training objective: element mask, element inputs, KL loss and per-depth metrics.

Data layout (one packed sequence per row, T positions, the EAGLE shift already applied by data prep):
position p holds the input token ``tokens[p]`` (= x_{p+1}), the target's aux hidden states ``aux[p]``
(= of position p), the target's final *normed* hidden state ``target_hidden[p]`` whose draft-vocab logits
supervise the element at p, the loss mask ``loss_mask[p]`` and ``document_ids[p]`` (-1 = padding).

Elements (see :mod:`peagle_jax.train.cod`): (anchor a, depth d) at position ``p = a + d``; E per row, the
invalid ones padding. Depth 0: real token and aux; depth >= 1: the mask token and ``mask_hidden``, both
through the same input norms and ``fc`` as real aux features. RoPE position ``p``.

Attention (:func:`element_mask`): q sees kv iff both are valid, q's anchor is not a padding position, they
share a document (of their anchors), and either kv is a depth-0 element at or before q's anchor, or kv is
in q's own chain (same anchor) at a depth <= q's. This is exactly what the drafter sees when drafting from
anchor a at inference: the committed context up to a, then the mask slots before it in the window.
Invalid elements are seen by nobody, so their inputs cannot influence the loss; their own rows see
nothing (a uniform, finite softmax) and carry zero loss weight.

Loss: ``sum_e w_e KL(softmax(t_e) || softmax(z_e)) / sum_e w_e`` with z the draft logits, t the target
logits over the draft vocab and ``w_e = valid_e * loss_mask[p_e]``; no per-depth decay. Shape letters as
in :mod:`peagle_jax.drafter.model`, plus E elements and K draft depths.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from peagle_jax import ops
from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.draft import drafter_forward
from peagle_jax.drafter.model import Drafter, new_drafter_cache


class PEagleBatch(NamedTuple):
    """One training batch with static shapes; every field an array (a pytree)."""

    tokens_BT: jax.Array  # int32 input token per position
    aux_BTX: jax.Array  # target aux hidden states, concatenated [A*Ht]
    target_hidden_BTD: jax.Array  # target final normed hidden states [Ht]
    loss_mask_BT: jax.Array  # 0/1
    document_ids_BT: jax.Array  # int32, -1 for padding positions
    anchor_BE: jax.Array  # int32
    depth_BE: jax.Array  # int32
    valid_BE: jax.Array  # bool, False for padding elements


def split_trainable(params) -> tuple[dict, dict]:
    """(trainable, frozen) top-level parameter dicts: the vocab maps ``d2t`` / ``t2d`` are integer and
    boolean arrays, which ``jax.grad`` refuses; differentiate in the first and pass ``{**a, **b}`` on."""
    frozen = {k: v for k, v in params.items() if not hasattr(v, "dtype") or not jnp.issubdtype(v.dtype, jnp.floating)}
    frozen = {k: v for k, v in frozen.items() if not isinstance(v, dict)}
    return {k: v for k, v in params.items() if k not in frozen}, frozen


def _take(x_BT, idx_BE):
    """Gather along the position axis; works for [B, T] and [B, T, X]."""
    if x_BT.ndim == 2:
        return jnp.take_along_axis(x_BT, idx_BE, axis=1)
    return jnp.take_along_axis(x_BT, idx_BE[:, :, None], axis=1)


def element_positions(anchor_BE, depth_BE, num_positions: int):
    """``anchor + depth``, clipped into the sequence (padding elements may point anywhere)."""
    return jnp.clip(anchor_BE + depth_BE, 0, num_positions - 1).astype(jnp.int32)


def element_mask(anchor_BE, depth_BE, valid_BE, document_ids_BT):
    """The P-EAGLE attention mask [B, E, E] (query, key), as described in the module docstring."""
    T = document_ids_BT.shape[1]
    doc_BE = _take(document_ids_BT, jnp.clip(anchor_BE, 0, T - 1))
    q_anchor, kv_anchor = anchor_BE[:, :, None], anchor_BE[:, None, :]
    same_doc = doc_BE[:, :, None] == doc_BE[:, None, :]
    usable = (doc_BE != -1)[:, :, None] & valid_BE[:, :, None] & valid_BE[:, None, :]
    context = (depth_BE == 0)[:, None, :] & (kv_anchor <= q_anchor)
    chain = (kv_anchor == q_anchor) & (depth_BE[:, None, :] <= depth_BE[:, :, None])
    return usable & same_doc & (context | chain)


def element_inputs(params, batch: PEagleBatch, *, cfg: DrafterConfig):
    """Tokens [B, E], fused g [B, E, H] and positions [B, E] of the elements: depth 0 real, else mask."""
    T = batch.tokens_BT.shape[1]
    pos_BE = element_positions(batch.anchor_BE, batch.depth_BE, T)
    real_BE = batch.depth_BE == 0
    tokens_BE = jnp.where(real_BE, _take(batch.tokens_BT.astype(jnp.int32), pos_BE), jnp.int32(cfg.mask_token_id))
    aux_BEX = _take(batch.aux_BTX, pos_BE).astype(cfg.layer.jnp_dtype)
    aux_BEX = jnp.where(real_BE[:, :, None], aux_BEX, params["mask_hidden"].astype(aux_BEX.dtype))
    g_BED = Drafter(cfg).apply({"params": params}, aux_BEX, method=Drafter.fuse)
    return tokens_BE, g_BED, pos_BE


def target_logits(target_head_UD, target_hidden_BED):
    """The target's logits over the draft vocab: its lm_head rows of the draft ids (t2d) applied to its
    final normed hidden states. Frozen: no gradient flows into the target."""
    head_UD = jax.lax.stop_gradient(target_head_UD)
    hidden_BED = jax.lax.stop_gradient(target_hidden_BED)
    return ops.linear(head_UD, hidden_BED).astype(jnp.float32)


def kl_per_element(draft_logits_BEU, target_logits_BEU):
    """``KL(softmax(t) || softmax(z))`` per element, in fp32: [B, E]."""
    log_p = jax.nn.log_softmax(target_logits_BEU.astype(jnp.float32), axis=-1)
    log_q = jax.nn.log_softmax(draft_logits_BEU.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def peagle_loss(
    params,
    batch: PEagleBatch,
    target_head_UD,
    embed_VD=None,
    *,
    cfg: DrafterConfig,
    num_depths: int,
    owned_BE=None,
    total_weight=None,
):
    """P-EAGLE training loss and metrics; pure, static-shaped, jittable and differentiable in ``params``.

    ``target_head_UD``: the target's lm_head rows of the draft vocab ``[U, Ht]``; ``embed_VD``: the target's
    embedding table when the drafter shares it. Returns ``(loss, metrics)`` with metrics as sums and
    counts, so that they aggregate exactly over batches and devices:

    - ``loss_sum_K`` [K]: sum of the weighted per-element KL per depth (``sum / count`` is the depth loss);
    - ``correct_K`` [K]: elements whose draft argmax equals the target argmax (over the draft vocab);
    - ``count_K`` [K]: loss-weighted elements per depth (depths >= K are in the loss but not the metrics).

    Sequence partitioning (:mod:`peagle_jax.train.partition`) passes ``owned_BE`` (the elements whose loss
    this call counts; the others are context only) and ``total_weight`` (the whole batch's weight, so that
    the partial losses add up to the whole loss).
    """
    logits_BEU, pos_BE = element_logits(params, batch, embed_VD, cfg=cfg)
    t_BEU = target_logits(target_head_UD, _take(batch.target_hidden_BTD, pos_BE))
    kl_BE = kl_per_element(logits_BEU, t_BEU)
    w_BE = loss_weights(batch, pos_BE)
    if owned_BE is not None:
        w_BE = w_BE * owned_BE.astype(jnp.float32)
    total = jnp.sum(w_BE) if total_weight is None else total_weight
    loss = jnp.sum(w_BE * kl_BE) / jnp.maximum(total, 1.0)

    return loss, depth_metrics(loss, kl_BE, logits_BEU, t_BEU, w_BE, batch.depth_BE, num_depths)


def element_logits(params, batch: PEagleBatch, embed_VD=None, *, cfg: DrafterConfig):
    """The drafter's logits [B, E, U] over the draft vocab for every element, in one forward pass under
    :func:`element_mask`, and the elements' positions [B, E]. What the element (a, d) predicts here is what
    :func:`peagle_jax.drafter.draft.parallel_draft` drafts at depth d + 1 from anchor a (tested)."""
    B, E = batch.anchor_BE.shape
    tokens_BE, g_BED, pos_BE = element_inputs(params, batch, cfg=cfg)
    mask_BEE = element_mask(batch.anchor_BE, batch.depth_BE, batch.valid_BE, batch.document_ids_BT)
    out, _ = drafter_forward(
        params,
        new_drafter_cache(cfg, B, E, bits=False),  # gradients flow through the cache
        tokens_BE,
        g_BED,
        jnp.zeros((B,), jnp.int32),
        cfg=cfg,
        embed_VD=embed_VD,
        mask_BTT=mask_BEE,
        positions_BT=pos_BE,
    )
    return out.logits, pos_BE


def loss_weights(batch: PEagleBatch, pos_BE):
    """``valid * loss_mask[position]`` per element, and 0 for an element anchored at a padding position
    (it attends to nothing, so its output is meaningless): fp32 [B, E]."""
    T = batch.document_ids_BT.shape[1]
    anchored_BE = _take(batch.document_ids_BT, jnp.clip(batch.anchor_BE, 0, T - 1)) != -1
    return (batch.valid_BE & anchored_BE & (_take(batch.loss_mask_BT, pos_BE) != 0)).astype(jnp.float32)


def depth_metrics(loss, kl_BE, draft_logits_BEU, target_logits_BEU, w_BE, depth_BE, num_depths: int) -> dict:
    """The metrics dict of :func:`peagle_loss` (sums and counts per depth); shared by every objective."""
    depth_BEK = jax.nn.one_hot(depth_BE, num_depths, dtype=jnp.float32) * w_BE[:, :, None]
    correct_BE = ops.argmax_first(draft_logits_BEU, axis=-1) == ops.argmax_first(target_logits_BEU, axis=-1)
    return {
        "loss": loss,
        "loss_sum_K": jnp.einsum("BE,BEK->K", jax.lax.stop_gradient(kl_BE), depth_BEK),
        "correct_K": jnp.einsum("BE,BEK->K", correct_BE.astype(jnp.float32), depth_BEK),
        "count_K": jnp.sum(depth_BEK, axis=(0, 1)),
    }
