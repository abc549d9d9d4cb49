"""The P-EAGLE training objective: element mask, element inputs, KL loss and per-depth metrics.

Data layout (one packed sequence per row, T positions, the EAGLE shift already applied by data prep):
position p holds the input token ``tokens[p]`` (= x_{p+1}), the target's aux hidden states ``aux[p]``
(= of position p), the target's final *normed* hidden state ``target_hidden[p]`` whose draft-vocab logits
supervise the element at p, the loss mask ``loss_mask[p]`` and ``document_ids[p]`` (-1 = padding).

Elements (see :mod:`peagle_jax.train.cod`): (anchor a, depth d) at position ``p = a + d``; Y per row, the
invalid ones padding. Depth 0: real token and aux; depth >= 1: the mask token and ``mask_hidden``, both
through the same input norms and ``fc`` as real aux features. RoPE position ``p``.

Attention (:func:`element_mask`; the forward uses the equal, sparser :func:`element_visibility`): q sees kv
iff both are valid, q's anchor is not a padding position, they
share a document (of their anchors), and either kv is a depth-0 element at or before q's anchor, or kv is
in q's own chain (same anchor) at a depth <= q's. This is exactly what the drafter sees when drafting from
anchor a at inference: the committed context up to a, then the mask slots before it in the window.
Invalid elements are seen by nobody, so their inputs cannot influence the loss; their own rows see
nothing (a uniform, finite softmax) and carry zero loss weight.

Loss: ``sum_e w_e KL(softmax(t_e) || softmax(z_e)) / sum_e w_e`` with z the draft logits, t the target
logits over the draft vocab and ``w_e = valid_e * loss_mask[p_e]``; no per-depth decay. t depends on the
position only, so it is computed per position and gathered per element (:class:`Targets`).

Cost (why the step is written as it is; ``python -m peagle_jax.bench.train`` measures it against the former
step, kept there as :func:`peagle_jax.bench.train.reference_loss`): attention over the T depth-0 elements
plus K - 1 chain slots per element instead of all Y; the target's logits over T positions instead of Y
elements, and at the loss positions only (``loss_pos_BM``); the drafter's LM head and the KL over only the
elements that carry loss (``loss_at_BM``: no prompt position's); with ``compute_dtype: bfloat16`` every
large product in the form XLA's CPU runs on its bf16 kernel, forward and backward
(:func:`peagle_jax.ops.einsum_f32`), the softmaxes and the KL in fp32. Shape letters: docs/glossary.md
(Y: elements, M: elements or positions gathered before a head, K: draft depths).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from peagle_jax import ops
from peagle_jax.chain_attention import ChainVisibility
from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.model import Drafter, new_drafter_cache


class PEagleBatch(NamedTuple):
    """One training batch with static shapes; every field an array (a pytree)."""

    tokens_BT: jax.Array  # int32 input token per position
    aux_BTX: jax.Array  # target aux hidden states, concatenated (X = A * the target's D)
    target_hidden_BTD: jax.Array  # target final normed hidden states (the target's D)
    loss_mask_BT: jax.Array  # 0/1
    document_ids_BT: jax.Array  # int32, -1 for padding positions
    anchor_BY: jax.Array  # int32 [B, Y]
    depth_BY: jax.Array  # int32 [B, Y]
    valid_BY: jax.Array  # bool [B, Y], False for padding elements
    # int32 [B, M]: the elements whose position carries loss, then -1 (peagle_jax.train.cod.loss_elements);
    # None: every element (the LM head and the KL over all Y)
    loss_at_BM: jax.Array | None = None
    # int32 [B, M]: the positions with loss, then -1 (peagle_jax.train.cod.loss_positions); the target's
    # distribution is computed there only. None: at every position
    loss_pos_BM: jax.Array | None = None


def split_trainable(params) -> tuple[dict, dict]:
    """(trainable, frozen) top-level parameter dicts: the vocab maps ``d2t`` / ``t2d`` are integer and
    boolean arrays, which ``jax.grad`` refuses; differentiate in the first and pass ``{**a, **b}`` on."""
    frozen = {k: v for k, v in params.items() if not hasattr(v, "dtype") or not jnp.issubdtype(v.dtype, jnp.floating)}
    frozen = {k: v for k, v in frozen.items() if not isinstance(v, dict)}
    return {k: v for k, v in params.items() if k not in frozen}, frozen


def _take(x_BT, idx_BY):
    """Gather along the position axis; works for [B, T] and [B, T, X]."""
    if x_BT.ndim == 2:
        return jnp.take_along_axis(x_BT, idx_BY, axis=1)
    return jnp.take_along_axis(x_BT, idx_BY[:, :, None], axis=1)


def element_positions(anchor_BY, depth_BY, num_positions: int):
    """``anchor + depth``, clipped into the sequence (padding elements may point anywhere)."""
    return jnp.clip(anchor_BY + depth_BY, 0, num_positions - 1).astype(jnp.int32)


def element_mask(anchor_BY, depth_BY, valid_BY, document_ids_BT):
    """The P-EAGLE attention mask [B, Y, Y] (query, key), as described in the module docstring."""
    T = document_ids_BT.shape[1]
    doc_BY = _take(document_ids_BT, jnp.clip(anchor_BY, 0, T - 1))
    q_anchor, kv_anchor = anchor_BY[:, :, None], anchor_BY[:, None, :]
    same_doc = doc_BY[:, :, None] == doc_BY[:, None, :]
    usable = (doc_BY != -1)[:, :, None] & valid_BY[:, :, None] & valid_BY[:, None, :]
    context = (depth_BY == 0)[:, None, :] & (kv_anchor <= q_anchor)
    chain = (kv_anchor == q_anchor) & (depth_BY[:, None, :] <= depth_BY[:, :, None])
    return usable & same_doc & (context | chain)


def element_inputs(params, batch: PEagleBatch, *, cfg: DrafterConfig):
    """Tokens [B, Y], fused g [B, Y, D] and positions [B, Y] of the elements: depth 0 real, else mask."""
    T = batch.tokens_BT.shape[1]
    pos_BY = element_positions(batch.anchor_BY, batch.depth_BY, T)
    real_BY = batch.depth_BY == 0
    tokens_BY = jnp.where(real_BY, _take(batch.tokens_BT.astype(jnp.int32), pos_BY), jnp.int32(cfg.mask_token_id))
    aux_BYX = _take(batch.aux_BTX, pos_BY).astype(cfg.layer.jnp_dtype)
    aux_BYX = jnp.where(real_BY[:, :, None], aux_BYX, params["mask_hidden"].astype(aux_BYX.dtype))
    g_BYD = Drafter(cfg).apply({"params": params}, aux_BYX, method=Drafter.fuse)
    return tokens_BY, g_BYD, pos_BY


def element_visibility(anchor_BY, depth_BY, valid_BY, document_ids_BT, *, num_depths: int) -> ChainVisibility:
    """:func:`element_mask` as an :class:`peagle_jax.chain_attention.ChainVisibility` (equal to it, tested): the keys a
    query can see are the depth-0 elements of positions <= its anchor and its own chain, so the attention
    needs ``Y * (T + K - 1)`` scores instead of ``Y * Y`` (about 3.4x fewer with COD).

    Layout precondition (guaranteed by :func:`peagle_jax.train.cod.cod_sample`, kept by
    :mod:`peagle_jax.train.partition`): a row's first T elements are the depth-0 elements of positions
    0..T-1, every other element has depth >= 1 or is invalid, and no (anchor, depth) pair is valid twice.
    """
    B, Y = anchor_BY.shape
    T = document_ids_BT.shape[1]
    E = num_depths - 1
    doc_BY = _take(document_ids_BT, jnp.clip(anchor_BY, 0, T - 1))
    usable_BY = (doc_BY != -1) & valid_BY
    t_T = jnp.arange(T, dtype=jnp.int32)
    prefix_BYT = (
        usable_BY[:, :, None]
        & valid_BY[:, None, :T]
        & (t_T[None, None, :] <= anchor_BY[:, :, None])
        & (doc_BY[:, :, None] == document_ids_BT[:, None, :])
    )
    # table_BTK[b, a, d]: the element (a, d) of row b for d >= 1 (Y where there is none).
    chained_BY = valid_BY & (depth_BY >= 1) & (depth_BY < num_depths)
    rows_BY = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, Y))
    at_BY = jnp.where(chained_BY, anchor_BY, T)  # out of range: dropped
    table_BTK = jnp.full((B, T, num_depths), Y, jnp.int32)
    table_BTK = table_BTK.at[rows_BY, at_BY, depth_BY].set(
        jnp.broadcast_to(jnp.arange(Y, dtype=jnp.int32), (B, Y)), mode="drop"
    )
    chain_BYK = jnp.take_along_axis(table_BTK, jnp.clip(anchor_BY, 0, T - 1)[:, :, None], axis=1)
    chain_BYE = chain_BYK[:, :, 1:]
    j_E = jnp.arange(1, E + 1, dtype=jnp.int32)
    ok_BYE = (chain_BYE < Y) & (j_E[None, None, :] <= depth_BY[:, :, None]) & usable_BY[:, :, None]
    return ChainVisibility(prefix_BYT, jnp.minimum(chain_BYE, Y - 1), ok_BYE)


def target_logits(target_head_UD, target_hidden_BTD):
    """The target's logits over the draft vocab: its lm_head rows of the draft ids (t2d) applied to its
    final normed hidden states, in fp32. Frozen: no gradient flows into the target."""
    head_UD = jax.lax.stop_gradient(target_head_UD)
    hidden_BTD = jax.lax.stop_gradient(target_hidden_BTD)
    return ops.linear(head_UD, hidden_BTD, preferred_element_type=jnp.float32).astype(jnp.float32)


class Targets(NamedTuple):
    """The target's distribution over the draft vocab per *position* (an element at position p is supervised
    by position p's): computed once for the T positions and gathered per element, rather than once per
    element (Y ~ 3.4 T of them with COD, and K T for TTT)."""

    probs_BTU: jax.Array  # fp32 softmax of the target logits
    log_probs_BTU: jax.Array  # fp32 log-softmax
    neg_entropy_BT: jax.Array  # sum_u p log p
    argmax_BT: jax.Array  # int32, first maximum of the target logits


def targets(target_head_UD, target_hidden_BTD, dtype=jnp.float32, at_BM=None) -> Targets:
    """:class:`Targets` of every position (``at_BM``: of those positions only, [B, M] in place of [B, T]);
    the logits' product takes operands in ``dtype`` (the compute dtype: bf16 operands accumulate in f32) and
    the softmax is fp32."""
    hidden = target_hidden_BTD if at_BM is None else _take(target_hidden_BTD, at_BM)
    t_BTU = target_logits(target_head_UD.astype(dtype), hidden.astype(dtype))
    log_p = jax.nn.log_softmax(t_BTU, axis=-1)
    p = jnp.exp(log_p)
    return Targets(p, log_p, jnp.sum(p * log_p, axis=-1), ops.argmax_first(t_BTU, axis=-1))


def kl_to_targets(draft_logits_BYU, tgt: Targets, pos_BY):
    """``KL(softmax(t) || softmax(z))`` per element, in fp32: [B, Y], with t the target logits of the
    element's position: ``sum p log p - sum p z + logsumexp z`` (``sum p = 1``), the first term per position."""
    z_BYU = draft_logits_BYU.astype(jnp.float32)
    p_BYU = _take(tgt.probs_BTU, pos_BY)
    return _take(tgt.neg_entropy_BT, pos_BY) - jnp.sum(p_BYU * z_BYU, axis=-1) + jax.nn.logsumexp(z_BYU, axis=-1)


def peagle_loss(
    params,
    batch: PEagleBatch,
    target_head_UD,
    embed_VD=None,
    *,
    cfg: DrafterConfig,
    num_depths: int,
    owned_BY=None,
    total_weight=None,
):
    """P-EAGLE training loss and metrics; pure, static-shaped, jittable and differentiable in ``params``.

    ``target_head_UD``: the target's lm_head rows of the draft vocab ``[U, D]`` (the target's D);
    ``embed_VD``: the target's embedding table when the drafter shares it. Returns ``(loss, metrics)`` with
    metrics as sums and counts, so that they aggregate exactly over batches and devices:

    - ``loss_sum_K`` [K]: sum of the weighted per-element KL per depth (``sum / count`` is the depth loss);
    - ``correct_K`` [K]: elements whose draft argmax equals the target argmax (over the draft vocab);
    - ``count_K`` [K]: loss-weighted elements per depth (depths >= K are in the loss but not the metrics).

    Sequence partitioning (:mod:`peagle_jax.train.partition`) passes ``owned_BY`` (the elements whose loss
    this call counts; the others are context only) and ``total_weight`` (the whole batch's weight, so that
    the partial losses add up to the whole loss).
    """
    at_BM = None if batch.loss_at_BM is None else jnp.maximum(batch.loss_at_BM, 0)
    logits_BMU, pos_BY = element_logits(params, batch, embed_VD, cfg=cfg, num_depths=num_depths, logits_at_BM=at_BM)
    w_BY = loss_weights(batch, pos_BY)
    if owned_BY is not None:
        w_BY = w_BY * owned_BY.astype(jnp.float32)
    total = jnp.sum(w_BY) if total_weight is None else total_weight
    if at_BM is None:  # every element
        w_BM, pos_BM, depth_BM = w_BY, pos_BY, batch.depth_BY
    else:  # the elements that carry loss (every one with weight), then padding of weight 0
        w_BM = _take(w_BY, at_BM) * (batch.loss_at_BM >= 0)
        pos_BM, depth_BM = _take(pos_BY, at_BM), _take(batch.depth_BY, at_BM)
    tgt, tgt_at_BM = loss_targets(target_head_UD, batch, cfg.layer.jnp_dtype), target_index(batch, pos_BM)
    kl_BM = kl_to_targets(logits_BMU, tgt, tgt_at_BM)
    loss = jnp.sum(w_BM * kl_BM) / jnp.maximum(total, 1.0)
    correct_BM = ops.argmax_first(logits_BMU, axis=-1) == _take(tgt.argmax_BT, tgt_at_BM)
    return loss, depth_metrics(loss, kl_BM, correct_BM, w_BM, depth_BM, num_depths)


def loss_targets(target_head_UD, batch: PEagleBatch, dtype) -> Targets:
    """The target's :class:`Targets` at every position, or with ``batch.loss_pos_BM`` at the loss positions
    only ([B, M]): no prompt position's distribution is computed."""
    at_BM = None if batch.loss_pos_BM is None else jnp.maximum(batch.loss_pos_BM, 0)
    return targets(target_head_UD, batch.target_hidden_BTD, dtype, at_BM)


def target_index(batch: PEagleBatch, pos_BM):
    """Where elements at positions ``pos_BM`` read :func:`loss_targets`: their positions, or, per loss
    position, p's rank among the row's loss positions (an element elsewhere carries no loss and reads a
    clipped index)."""
    if batch.loss_pos_BM is None:
        return pos_BM
    rank_BT = jnp.cumsum(batch.loss_mask_BT != 0, axis=1, dtype=jnp.int32) - 1
    return jnp.clip(_take(rank_BT, pos_BM), 0, batch.loss_pos_BM.shape[1] - 1)


def element_logits(
    params, batch: PEagleBatch, embed_VD=None, *, cfg: DrafterConfig, num_depths: int, logits_at_BM=None
):
    """The drafter's logits [B, Y, U] over the draft vocab for every element (``logits_at_BM``: only for
    those elements, [B, M, U]), in one forward pass under :func:`element_mask` (as
    :func:`element_visibility`), and the elements' positions [B, Y]. What the element (a, d) predicts here
    is what :func:`peagle_jax.drafter.draft.parallel_draft` drafts at depth d + 1 from anchor a (tested).
    ``num_depths``: K_train (elements have depths 0..K-1)."""
    B, Y = batch.anchor_BY.shape
    tokens_BY, g_BYD, pos_BY = element_inputs(params, batch, cfg=cfg)
    vis = element_visibility(
        batch.anchor_BY, batch.depth_BY, batch.valid_BY, batch.document_ids_BT, num_depths=num_depths
    )
    out, _ = Drafter(cfg).apply(
        {"params": params},
        tokens_BY,
        g_BYD,
        pos_BY,
        jnp.zeros((B,), jnp.int32),
        vis,
        new_drafter_cache(cfg, B, Y, bits=False),  # gradients flow through the cache
        embed_VD,
        logits_at_BM,
    )
    return out.logits, pos_BY


def loss_weights(batch: PEagleBatch, pos_BY):
    """``valid * loss_mask[position]`` per element, and 0 for an element anchored at a padding position
    (it attends to nothing, so its output is meaningless): fp32 [B, Y]."""
    T = batch.document_ids_BT.shape[1]
    anchored_BY = _take(batch.document_ids_BT, jnp.clip(batch.anchor_BY, 0, T - 1)) != -1
    return (batch.valid_BY & anchored_BY & (_take(batch.loss_mask_BT, pos_BY) != 0)).astype(jnp.float32)


def depth_metrics(loss, kl_BY, correct_BY, w_BY, depth_BY, num_depths: int) -> dict:
    """The metrics dict of :func:`peagle_loss` (sums and counts per depth); shared by every objective.
    ``correct_BY``: whether the element's draft argmax equals its target argmax."""
    depth_BYK = jax.nn.one_hot(depth_BY, num_depths, dtype=jnp.float32) * w_BY[:, :, None]
    return {
        "loss": loss,
        "loss_sum_K": jnp.einsum("BY,BYK->K", jax.lax.stop_gradient(kl_BY), depth_BYK),
        "correct_K": jnp.einsum("BY,BYK->K", correct_BY.astype(jnp.float32), depth_BYK),
        "count_K": jnp.sum(depth_BYK, axis=(0, 1)),
    }
