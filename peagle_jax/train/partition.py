"""Sequence partitioning: one long row's P-EAGLE elements in several forward/backward passes, exact gradients.

The attention cost of a row is quadratic in its Y elements (about 3.4 T with COD). Partitioning splits the
row's anchors into ``segments`` contiguous segments of ``ceil(T / segments)`` positions. Segment s runs one
forward over

- every depth-0 element anchored before the segment's end (the context its chains attend to, carried
  along; those before the segment's start are context only), and
- the mask elements (depth >= 1) anchored inside the segment, at most ``capacity`` of them (padded),

and counts the loss of the elements it owns (anchored inside it), normalised by the whole row's weight.

Why this is exact: a depth-0 element attends only to depth-0 elements at anchors <= its own, all of which
the segment carries, so its activations (and keys / values) equal the unpartitioned forward's; a mask element
attends to depth-0 elements at anchors <= its anchor and to its own chain, all inside the segment. Each owned
element's loss term is therefore the same function of the parameters as in the whole-row loss, every element
is owned by exactly one segment, and the gradient is the sum of the segments' gradients. The segments run
in a ``lax.scan`` that accumulates gradients, so only one segment's activations are alive at a time.

Layout precondition (guaranteed by :func:`peagle_jax.train.cod.cod_sample`): a row's first T elements are
the depth-0 elements of positions 0..T-1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.train.objective import PEagleBatch, element_positions, loss_weights, peagle_loss


def segment_mask_capacity(num_positions: int, num_elements: int, segments: int, num_depths: int) -> int:
    """``capacity``: the most mask elements one segment can own (static)."""
    seg = -(-num_positions // segments)
    return min(num_elements - num_positions, (num_depths - 1) * seg)


def segment_batch(batch: PEagleBatch, s, *, segments: int, capacity: int) -> tuple[PEagleBatch, jax.Array]:
    """Segment ``s`` (traced) of every row: ``(batch with T + capacity elements, owned [B, T + capacity])``."""
    B, T = batch.tokens_BT.shape
    seg = -(-T // segments)
    lo, hi = s * seg, (s + 1) * seg
    a0, v0 = batch.anchor_BY[:, :T], batch.valid_BY[:, :T]
    am, dm, vm = batch.anchor_BY[:, T:], batch.depth_BY[:, T:], batch.valid_BY[:, T:]
    in_seg = vm & (am >= lo) & (am < hi)
    # The in-segment mask elements first (stable: in their original order), then the rest as padding.
    order = jnp.argsort(~in_seg, axis=1, stable=True)[:, :capacity]
    take = lambda x: jnp.take_along_axis(x, order, axis=1)  # noqa: E731
    sel_valid = take(in_seg)
    part = batch._replace(
        anchor_BY=jnp.concatenate([a0, take(am)], axis=1),
        depth_BY=jnp.concatenate([batch.depth_BY[:, :T], take(dm)], axis=1),
        valid_BY=jnp.concatenate([v0 & (a0 < hi), sel_valid], axis=1),
        loss_at_BM=None,  # it indexes the whole row's elements: the head runs over the segment's
    )
    owned = jnp.concatenate([v0 & (a0 >= lo) & (a0 < hi), sel_valid], axis=1)
    return part, owned


def partitioned_loss_and_grad(
    trainable,
    frozen,
    batch: PEagleBatch,
    target_head_UD,
    embed_VD,
    *,
    cfg: DrafterConfig,
    num_depths: int,
    segments: int,
    cast=lambda p: p,
):
    """``((loss, metrics), grads)`` of the P-EAGLE loss over ``trainable``, computed segment by segment.
    ``cast`` maps the merged params to the compute dtype (inside the differentiated function)."""
    B, T = batch.tokens_BT.shape
    Y = batch.anchor_BY.shape[1]
    capacity = segment_mask_capacity(T, Y, segments, num_depths)
    total = jnp.sum(loss_weights(batch, element_positions(batch.anchor_BY, batch.depth_BY, T)))

    def segment(carry, s):
        part, owned = segment_batch(batch, s, segments=segments, capacity=capacity)

        def loss_fn(tr):
            return peagle_loss(
                cast({**tr, **frozen}),
                part,
                target_head_UD,
                embed_VD,
                cfg=cfg,
                num_depths=num_depths,
                owned_BY=owned,
                total_weight=total,
            )

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        acc_grads, acc_metrics = carry
        add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
        return (add(acc_grads, grads), add(acc_metrics, {**metrics, "loss": loss})), None

    zero_grads = jax.tree.map(jnp.zeros_like, trainable)
    zero_metrics = {
        "loss": jnp.zeros((), jnp.float32),
        "loss_sum_K": jnp.zeros((num_depths,), jnp.float32),
        "correct_K": jnp.zeros((num_depths,), jnp.float32),
        "count_K": jnp.zeros((num_depths,), jnp.float32),
    }
    (grads, metrics), _ = jax.lax.scan(segment, (zero_grads, zero_metrics), jnp.arange(segments, dtype=jnp.int32))
    return (metrics["loss"], metrics), grads
