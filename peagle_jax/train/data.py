"""Training batches as a pure function of the data position: packed rows, epoch shuffles, COD elements.

``batch_at(pos)`` (the step's data position, saved in checkpoints) takes rows ``pos*B .. pos*B+B-1`` of the
endless sequence of epochs, each epoch a seeded permutation of the training rows, and COD-samples their
elements with a generator seeded by ``(seed, pos)``. Nothing depends on earlier calls, so a resumed run sees
exactly the batches an uninterrupted one would. Shapes are static: B rows of T slots and Y elements, with the
elements that carry loss and the loss positions, each sized to one of ``element_buckets`` buckets by the
batch's loss positions (:func:`~peagle_jax.train.cod.batch_shape`).

Features come from a :class:`~peagle_jax.train.features.FeatureCache` (cached) or from the target itself
(online, :func:`~peagle_jax.train.features.target_features` on the batch's rows).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from peagle_jax.train.cod import bucketed_elements
from peagle_jax.train.features import FeatureCache, target_features
from peagle_jax.train.objective import PEagleBatch
from peagle_jax.train.pack import PackedRows, training_layout
from peagle_jax.train.prompts import held_out_score


class TrainData:
    """Batches over a subset of packed rows (``row_ids``, e.g. the training or the held-out split)."""

    def __init__(
        self,
        rows: PackedRows,
        row_ids: np.ndarray,
        *,
        batch_size: int,
        num_depths: int,
        seed: int,
        cod_ratio: float = 0.7,
        cod_ratio_min: float = 0.2,
        max_anchors: int | None = None,
        features: FeatureCache | None = None,
        target: tuple | None = None,
        feature_dtype: str = "float32",
        element_buckets: int = 8,
    ):
        if (features is None) == (target is None):
            raise ValueError("give exactly one feature source: a FeatureCache or (target params, target cfg)")
        if len(row_ids) == 0:
            raise ValueError("no rows")
        self.rows, self.row_ids = rows, np.asarray(row_ids)
        self.layout = training_layout(rows)
        self.B, self.K, self.seed = batch_size, num_depths, seed
        self.cod = dict(ratio=cod_ratio, ratio_min=cod_ratio_min, max_anchors=max_anchors)
        self.element_buckets = element_buckets
        self.features, self.target, self.feature_dtype = features, target, feature_dtype

    @property
    def steps_per_epoch(self) -> int:
        return max(1, len(self.row_ids) // self.B)

    def rows_at(self, pos: int) -> np.ndarray:
        """The packed-row ids of batch ``pos``."""
        n = len(self.row_ids)
        flat = pos * self.B + np.arange(self.B)
        out = np.empty(self.B, np.int64)
        for epoch in np.unique(flat // n):
            perm = np.random.default_rng((self.seed, 1, int(epoch))).permutation(n)
            sel = flat // n == epoch
            out[sel] = self.row_ids[perm[flat[sel] % n]]
        return out

    def feature_rows(self, idx: np.ndarray):
        """(aux, target_hidden) of those rows, from the cache or the target."""
        if self.features is not None:
            return self.features.rows(idx)
        params, cfg = self.target
        r = self.rows
        loss_mask = self.layout[1][idx]
        return target_features(
            params, r.tokens[idx], r.positions[idx], r.document[idx], loss_mask, cfg=cfg, dtype=self.feature_dtype
        )

    def feature_spec(self) -> tuple[tuple[tuple[int, ...], np.dtype], tuple[tuple[int, ...], np.dtype]]:
        """((shape, dtype) of one row's aux features, the same of its target hidden states), computing none."""
        if self.features is not None:
            return self.features.spec()
        _, cfg = self.target
        T, dtype = self.rows.tokens.shape[1], np.dtype(jnp.dtype(self.feature_dtype))
        return ((T, len(cfg.aux_layer_ids) * cfg.hidden_size), dtype), ((T, cfg.hidden_size), dtype)

    def batch_at(self, pos: int, *, lazy_features: bool = False) -> PEagleBatch:
        """Batch ``pos``. ``lazy_features``: the features are :class:`LazyRows`, computed only for the rows
        asked of them (a process of a multi-process run fills only its own devices' shards)."""
        idx = self.rows_at(pos)
        tokens, loss_mask, docs = (a[idx] for a in self.layout)
        bucketed = bucketed_elements(
            loss_mask,
            num_depths=self.K,
            rng=np.random.default_rng((self.seed, 2, pos)),
            buckets=self.element_buckets,
            **self.cod,
        )
        if lazy_features:
            aux, hidden = LazyRows.pair(self, idx)
        else:
            aux, hidden = (jnp.asarray(a) for a in self.feature_rows(idx))
        return PEagleBatch(
            jnp.asarray(tokens),
            aux,
            hidden,
            jnp.asarray(loss_mask),
            jnp.asarray(docs),
            *(jnp.asarray(a) for a in bucketed.elements),
            jnp.asarray(bucketed.loss_at),
            jnp.asarray(bucketed.loss_pos),
        )


class LazyRows:
    """One feature array of a batch (aux or target hidden) that is computed only for the rows indexed:
    ``lazy[rows_slice, ...]`` computes (aux, hidden) for those batch rows once, shared by the pair.
    :func:`peagle_jax.train.mesh.global_batch` indexes it with each local device's shard."""

    def __init__(self, data: TrainData, idx: np.ndarray, which: int, shape: tuple[int, ...], dtype, memo: dict):
        self.data, self.idx, self.which, self.shape, self.dtype, self.memo = data, idx, which, shape, dtype, memo
        self.ndim = len(shape)

    @classmethod
    def pair(cls, data: TrainData, idx: np.ndarray) -> tuple[LazyRows, LazyRows]:
        memo: dict = {}
        return tuple(
            cls(data, idx, i, (len(idx), *shape), dtype, memo) for i, (shape, dtype) in enumerate(data.feature_spec())
        )

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        rows = index[0] if index else slice(None)
        key = rows.indices(len(self.idx))
        if key not in self.memo:
            self.memo[key] = self.data.feature_rows(self.idx[rows])
        return np.asarray(self.memo[key][self.which])[(slice(None), *index[1:])]


def split_records(records: list[dict], eval_fraction: float) -> tuple[list[dict], list[dict]]:
    """``(train, held-out)`` records, split by conversation (a record's ``conversation``, else its ``index``):
    those scoring below ``eval_fraction`` (:func:`peagle_jax.train.prompts.held_out_score`) are held out, so
    every turn and every temperature's answer of a conversation lands on the same side, and a conversation
    stays on its side as the data grows. With two or more conversations each side gets at least one."""

    def key(r):
        return r.get("conversation", r["index"])

    score = {c: held_out_score(c) for c in {key(r) for r in records}}
    held = {c for c, s in score.items() if s < eval_fraction}
    if eval_fraction > 0 and len(score) >= 2:
        ranked = sorted(score, key=score.get)
        if not held:
            held = {ranked[0]}
        elif len(held) == len(score):
            held.discard(ranked[-1])
    return [r for r in records if key(r) not in held], [r for r in records if key(r) in held]
