"""COD (Conditional Drop-token) sampling of P-EAGLE training elements, on the host.

A training element is a pair (anchor a, depth d) over one packed sequence of n positions. It sits at
position ``p = a + d`` (its RoPE position, and the position whose token / target / loss mask it uses) and
stands for "the d-th parallel draft slot when drafting from anchor a". Depth 0 is every position (real
token and aux feature); depth d >= 1 elements are mask elements.

Sampling (the PARD / P-EAGLE recipe, as speculators' ``generate_cod_sample_indices``):

- seeds: the positions with loss mask 1, or ``max_anchors`` of them drawn at random when there are more;
- depth d >= 1 keeps ``int(max(0, n_seeds - d) * max(r**d, r_min))`` positions, drawn uniformly among the
  candidate pool (all of it when the pool is smaller), sorted;
- the pool of depth 1 is the seeds; the pool of depth d + 1 is the kept depth-d positions shifted by one,
  restricted to loss-masked positions inside the sequence. So the element (a, d) exists only when its
  parent (a, d - 1) was kept: the chain from an anchor is contiguous.

One deliberate difference: speculators lets a loss-masked position 0 into the depth-1 pool, which yields
an element anchored at -1 (no such depth-0 element; torch's negative indexing then reads the last
document id). Here position 0 is left out of that pool. The per-depth sizes do not change, since the
pool of depth 1 is always larger than the depth-1 sample.

Fixed shapes: :func:`pad_elements` pads the element list to a static length Y with invalid elements
(``valid`` False), which the objective masks out of attention and loss; :func:`max_elements` bounds Y for
any sequence. A batch's count depends on how many of its positions carry loss (about 55% of a packed row of
regenerated answers: the prompts carry none), so :func:`batch_shape` sizes each batch from one of a few
buckets of that count instead: Y, the elements that carry loss (the drafter's LM head and the KL run over
only those, :func:`loss_elements`) and the loss positions (:func:`loss_positions`). Each bucket is one
compiled step.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Elements(NamedTuple):
    """Per element: ``anchor`` and ``depth`` int32, ``valid`` bool (False for padding); all [Y] or [B, Y]."""

    anchor: np.ndarray
    depth: np.ndarray
    valid: np.ndarray


def depth_sizes_bound(n_seeds: int, num_depths: int, ratio: float = 0.7, ratio_min: float = 0.2) -> list[int]:
    """The formula's size per depth 1..num_depths-1 (the sampled size, or less when the pool runs short)."""
    sizes = []
    for d in range(1, num_depths):
        size = int(max(0, n_seeds - d) * max(ratio**d, ratio_min))
        if size <= 0:
            break
        sizes.append(size)
    return sizes


def max_elements(
    seq_len: int, num_depths: int, ratio: float = 0.7, ratio_min: float = 0.2, max_anchors: int | None = None
) -> int:
    """An upper bound on the number of elements of any sequence of ``seq_len`` positions: a static Y."""
    n_seeds = seq_len if max_anchors is None else min(seq_len, max_anchors)
    return seq_len + sum(depth_sizes_bound(n_seeds, num_depths, ratio, ratio_min))


class BatchShape(NamedTuple):
    """Static sizes of a batch: ``Y`` elements per row, of which at most ``Y_loss`` carry loss, over at most
    ``T_loss`` loss positions."""

    Y: int
    Y_loss: int
    T_loss: int


def batch_shape(
    loss_counts,
    seq_len: int,
    num_depths: int,
    ratio: float = 0.7,
    ratio_min: float = 0.2,
    max_anchors: int | None = None,
    buckets: int = 8,
) -> BatchShape:
    """The sizes for a batch whose rows have ``loss_counts`` loss positions. The largest count, rounded up to
    a multiple of ``ceil(seq_len / buckets)``, is ``T_loss`` (so at most ``buckets`` shapes, hence compiled
    steps, over a run); it bounds a row's depth-0 elements with loss (one per loss position) and its depth
    >= 1 elements (:func:`depth_sizes_bound` of its seeds; each of those carries loss). ``buckets=1``: one
    shape, ``Y = Y_loss =`` :func:`max_elements` and ``T_loss = seq_len``."""
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    step = -(-seq_len // buckets)
    top = int(np.max(loss_counts, initial=0))
    m = min(seq_len, max(1, -(-top // step)) * step)
    n_seeds = m if max_anchors is None else min(m, max_anchors)
    masked = sum(depth_sizes_bound(n_seeds, num_depths, ratio, ratio_min))
    return BatchShape(seq_len + masked, m + masked, m)


def cod_sample(
    loss_mask_T,
    *,
    num_depths: int,
    rng: np.random.Generator,
    ratio: float = 0.7,
    ratio_min: float = 0.2,
    max_anchors: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """COD elements of one sequence: ``(anchor, depth)`` int32 arrays, depth 0 first (positions 0..n-1), then
    each depth in increasing position order. ``rng`` is the only source of randomness."""
    loss_mask_T = np.asarray(loss_mask_T)
    n = loss_mask_T.shape[0]
    is_valid_T = loss_mask_T != 0
    valid = np.flatnonzero(is_valid_T)
    if max_anchors is not None and valid.shape[0] > max_anchors:
        seeds = np.sort(rng.choice(valid, size=max_anchors, replace=False))
    else:
        seeds = valid
    anchors = [np.arange(n)]
    depths = [np.zeros(n, np.int64)]
    pool = seeds[seeds >= 1]  # a depth-1 element at p is anchored at p - 1, which must exist
    for d, size in enumerate(depth_sizes_bound(seeds.shape[0], num_depths, ratio, ratio_min), start=1):
        kept = np.sort(rng.choice(pool, size=size, replace=False)) if pool.shape[0] >= size else pool
        nxt = kept + 1
        inside = nxt < n
        pool = nxt[inside][is_valid_T[nxt[inside]]]
        anchors.append(kept - d)
        depths.append(np.full(kept.shape[0], d, np.int64))
    return np.concatenate(anchors).astype(np.int32), np.concatenate(depths).astype(np.int32)


def pad_elements(anchor, depth, num_elements: int) -> Elements:
    """Pad one sequence's elements to the static length Y; padding is (anchor 0, depth 0, invalid)."""
    count = anchor.shape[0]
    if count > num_elements:
        raise ValueError(f"{count} COD elements do not fit in {num_elements}; raise num_elements (see max_elements)")
    pad = num_elements - count
    return Elements(
        np.concatenate([anchor, np.zeros(pad, np.int32)]).astype(np.int32),
        np.concatenate([depth, np.zeros(pad, np.int32)]).astype(np.int32),
        np.arange(num_elements) < count,
    )


def _padded_indices(mask_BN, size: int, what: str) -> np.ndarray:
    """[B, size] int32: per row, the indices where ``mask_BN`` is set, in order, then -1."""
    out = np.full((mask_BN.shape[0], size), -1, np.int32)
    for b, row in enumerate(mask_BN):
        idx = np.flatnonzero(row)
        if idx.shape[0] > size:
            raise ValueError(f"{idx.shape[0]} {what} carry loss, more than {size}; see batch_shape")
        out[b, : idx.shape[0]] = idx
    return out


def loss_elements(elements: Elements, loss_mask_BT, num_loss: int) -> np.ndarray:
    """[B, M] int32: per row, the indices of its valid elements whose position carries loss, in order, then
    -1 up to ``num_loss`` (``Y_loss`` of :func:`batch_shape`)."""
    loss_mask_BT = np.asarray(loss_mask_BT)
    T = loss_mask_BT.shape[1]
    pos_BY = np.clip(elements.anchor + elements.depth, 0, T - 1)
    carries_BY = elements.valid & (np.take_along_axis(loss_mask_BT, pos_BY, axis=1) != 0)
    return _padded_indices(carries_BY, num_loss, "COD elements")


def loss_positions(loss_mask_BT, num_positions: int) -> np.ndarray:
    """[B, M] int32: per row, its positions with loss in order, then -1 up to ``num_positions`` (``T_loss``
    of :func:`batch_shape`)."""
    return _padded_indices(np.asarray(loss_mask_BT) != 0, num_positions, "positions")


class BucketedElements(NamedTuple):
    """A batch's COD elements padded to its bucket (:func:`batch_shape`), with the indices of the elements
    with loss (:func:`loss_elements`) and the loss positions (:func:`loss_positions`), each [B, M]."""

    elements: Elements
    loss_at: np.ndarray
    loss_pos: np.ndarray


def bucketed_elements(
    loss_mask_BT,
    *,
    num_depths: int,
    rng: np.random.Generator,
    buckets: int,
    ratio: float = 0.7,
    ratio_min: float = 0.2,
    max_anchors: int | None = None,
) -> BucketedElements:
    """The host side of a training batch's elements: :func:`cod_batch` at the batch's bucket, and the
    indices the objectives gather the loss through."""
    loss_mask_BT = np.asarray(loss_mask_BT)
    T = loss_mask_BT.shape[1]
    shape = batch_shape(np.count_nonzero(loss_mask_BT, axis=1), T, num_depths, ratio, ratio_min, max_anchors, buckets)
    cod = dict(ratio=ratio, ratio_min=ratio_min, max_anchors=max_anchors)
    elements = cod_batch(loss_mask_BT, shape.Y, num_depths=num_depths, rng=rng, **cod)
    return BucketedElements(
        elements, loss_elements(elements, loss_mask_BT, shape.Y_loss), loss_positions(loss_mask_BT, shape.T_loss)
    )


def cod_batch(
    loss_mask_BT,
    num_elements: int,
    *,
    num_depths: int,
    rng: np.random.Generator,
    ratio: float = 0.7,
    ratio_min: float = 0.2,
    max_anchors: int | None = None,
) -> Elements:
    """COD elements for each row of a batch, each padded to Y: :class:`Elements` of [B, Y] arrays."""
    rows = [
        pad_elements(
            *cod_sample(row, num_depths=num_depths, rng=rng, ratio=ratio, ratio_min=ratio_min, max_anchors=max_anchors),
            num_elements,
        )
        for row in np.asarray(loss_mask_BT)
    ]
    return Elements(*(np.stack(field) for field in zip(*rows, strict=True)))
