"""Training batches as a pure function of the data position: packed rows, epoch shuffles, COD elements.

``batch_at(pos)`` (the step's data position, saved in checkpoints) takes rows ``pos*B .. pos*B+B-1`` of the
endless sequence of epochs, each epoch a seeded permutation of the training rows, and COD-samples their
elements with a generator seeded by ``(seed, pos)``. Nothing depends on earlier calls, so a resumed run sees
exactly the batches an uninterrupted one would. Shapes are static: B rows of T slots and Y elements.

Features come from a :class:`~peagle_jax.train.features.FeatureCache` (cached) or from the target itself
(online, :func:`~peagle_jax.train.features.target_features` on the batch's rows).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from peagle_jax.train.cod import cod_batch, max_elements
from peagle_jax.train.features import FeatureCache, target_features
from peagle_jax.train.objective import PEagleBatch
from peagle_jax.train.pack import PackedRows, training_layout


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
    ):
        if (features is None) == (target is None):
            raise ValueError("give exactly one feature source: a FeatureCache or (target params, target cfg)")
        if len(row_ids) == 0:
            raise ValueError("no rows")
        self.rows, self.row_ids = rows, np.asarray(row_ids)
        self.layout = training_layout(rows)
        self.B, self.K, self.seed = batch_size, num_depths, seed
        self.cod = dict(ratio=cod_ratio, ratio_min=cod_ratio_min, max_anchors=max_anchors)
        self.Y = max_elements(rows.tokens.shape[1], num_depths, cod_ratio, cod_ratio_min, max_anchors)
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
        return target_features(
            params, r.tokens[idx], r.positions[idx], r.document[idx], cfg=cfg, dtype=self.feature_dtype
        )

    def batch_at(self, pos: int) -> PEagleBatch:
        idx = self.rows_at(pos)
        tokens, loss_mask, docs = (a[idx] for a in self.layout)
        elements = cod_batch(
            loss_mask, self.Y, num_depths=self.K, rng=np.random.default_rng((self.seed, 2, pos)), **self.cod
        )
        aux, hidden = self.feature_rows(idx)
        return PEagleBatch(
            jnp.asarray(tokens),
            jnp.asarray(aux),
            jnp.asarray(hidden),
            jnp.asarray(loss_mask),
            jnp.asarray(docs),
            *(jnp.asarray(a) for a in elements),
        )


def split_rows(num_rows: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, held-out ids): a seeded shuffle, at least one row each when there are two or more."""
    perm = np.random.default_rng((seed, 0)).permutation(num_rows)
    n_eval = int(round(num_rows * eval_fraction))
    if eval_fraction > 0 and num_rows >= 2:
        n_eval = min(max(n_eval, 1), num_rows - 1)
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])
