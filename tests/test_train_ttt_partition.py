"""The EAGLE-3 TTT objective equals sequential drafting; sequence partitioning gives the unpartitioned
loss, metrics and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.draft import drafter_forward, fuse_aux
from peagle_jax.drafter.model import init_drafter_params, new_drafter_cache
from peagle_jax.models.config import ModelConfig
from peagle_jax.train.cod import bucketed_elements, cod_batch, max_elements
from peagle_jax.train.config import TrainConfig
from peagle_jax.train.loop import loss_and_grad, partition
from peagle_jax.train.objective import PEagleBatch
from peagle_jax.train.ttt import ttt_forward

V, H, Ht, U, B, T = 61, 32, 24, 61, 2, 24
LAYER = ModelConfig(
    family="llama",
    vocab_size=V,
    hidden_size=H,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


def _cfg(algorithm="peagle"):
    return DrafterConfig(layer=LAYER, algorithm=algorithm, target_hidden_size=Ht, mask_token_id=V - 1)


def _batch(K, seed=0):
    rng = np.random.default_rng(seed)
    loss_mask = (rng.random((B, T)) < 0.8).astype(np.int32)
    docs = np.zeros((B, T), np.int32)
    docs[0, 11:] = 1
    docs[0, 10] = -1  # the last slot of conversation 0 (see pack.training_layout)
    docs[1, -3:] = -1
    elements = cod_batch(loss_mask, max_elements(T, K), num_depths=K, rng=rng)
    return jax.tree.map(
        jnp.asarray,
        PEagleBatch(
            rng.integers(0, V - 1, (B, T)).astype(np.int32),
            rng.standard_normal((B, T, 3 * Ht)).astype(np.float32),
            rng.standard_normal((B, T, Ht)).astype(np.float32),
            loss_mask,
            docs,
            *elements,
        ),
    )


def test_ttt_forward_equals_sequential_drafting():
    """Depth d of anchor a = the drafter fed the context 0..a, then d steps of (true token, own hidden)."""
    cfg, K = _cfg("eagle3"), 4
    params = init_drafter_params(cfg, jax.random.key(0))
    batch = _batch(K)
    outs = ttt_forward(params, batch, cfg=cfg, num_depths=K)
    g = fuse_aux(params, batch.aux_BTX, cfg=cfg)
    row = 1
    for a in (0, 5, 17):
        cache = new_drafter_cache(cfg, 1, T + K)
        out, cache = drafter_forward(
            params,
            cache,
            batch.tokens_BT[row : row + 1, : a + 1],
            g[row : row + 1, : a + 1],
            jnp.zeros(1, jnp.int32),
            cfg=cfg,
        )
        np.testing.assert_allclose(outs[0][0][row, a], out.logits[0, a], atol=1e-5, rtol=1e-5)
        hidden = out.hidden[:, a : a + 1]
        for d in range(1, K):
            assert bool(outs[d][1][row, a])
            token = batch.tokens_BT[row : row + 1, a + d : a + d + 1]
            out, cache = drafter_forward(params, cache, token, hidden, jnp.full(1, a + d, jnp.int32), cfg=cfg)
            np.testing.assert_allclose(outs[d][0][row, a], out.logits[0, 0], atol=1e-5, rtol=1e-5)
            hidden = out.hidden
    # Chains do not cross a conversation's end: row 0's conversation 0 ends at slot 10 (document -1).
    assert not bool(outs[1][1][0, 10]) and not bool(outs[2][1][0, 9]) and bool(outs[1][1][0, 8])


@pytest.mark.parametrize("segments", [2, 3, 5])
def test_partitioned_gradients_equal_unpartitioned(segments):
    cfg, K = _cfg(), 5
    params = init_drafter_params(cfg, jax.random.key(1))
    head = jnp.asarray(np.random.default_rng(2).standard_normal((U, Ht)).astype(np.float32))
    batch = _batch(K, seed=3)
    trainable, frozen = partition(params, cfg)

    def run(tcfg):
        return jax.jit(lambda tr: loss_and_grad(tr, frozen, batch, head, None, cfg=cfg, tcfg=tcfg, num_depths=K))(
            trainable
        )

    (loss, metrics), grads = run(TrainConfig())
    (loss_p, metrics_p), grads_p = run(TrainConfig(segments=segments))
    np.testing.assert_allclose(loss_p, loss, rtol=1e-5)
    for key in ("loss_sum_K", "correct_K", "count_K"):
        np.testing.assert_allclose(metrics_p[key], metrics[key], rtol=1e-5, atol=1e-5)
    for (path, g), gp in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_p), strict=True):
        scale = float(jnp.max(jnp.abs(g))) + 1e-12
        assert float(jnp.max(jnp.abs(gp - g))) <= 1e-5 * scale + 1e-9, jax.tree_util.keystr(path)


def test_eagle3_objective_trains():
    """The TTT objective runs through the same step and lowers the loss on a fixed batch."""
    from peagle_jax.train.loop import init_train_state, train_step

    cfg, K = _cfg("eagle3"), 3
    tcfg = TrainConfig(lr=3e-3, warmup_steps=2, total_steps=60, objective="eagle3")
    state = init_train_state(init_drafter_params(cfg, jax.random.key(4)), cfg, tcfg)
    head = jnp.asarray(np.random.default_rng(5).standard_normal((U, Ht)).astype(np.float32))
    batch = _batch(K, seed=6)
    losses, compiled = [], []
    for _ in range(30):
        state, m = train_step(state, batch, head, cfg=cfg, tcfg=tcfg, num_depths=K)
        losses.append(float(m["loss"]))
        compiled.append(train_step._cache_size())  # other tests share the jitted step: count from here
    assert losses[-1] < 0.5 * losses[0]
    assert compiled[-1] == compiled[0]


@pytest.mark.parametrize("objective, segments", [("eagle3", 1), ("peagle", 1), ("peagle", 3)])
def test_targets_at_the_loss_positions_only_give_the_same_loss_and_gradients(objective, segments):
    """The target's distribution computed at the loss positions only (``loss_pos_BM``; for EAGLE-3 also each
    depth's LM head over the elements at those positions only): the same loss, metrics and gradients (fp32,
    1e-5) as at every position, also under sequence partitioning."""
    cfg, K = _cfg(objective), 4
    trainable, frozen = partition(init_drafter_params(cfg, jax.random.key(7)), cfg)
    head = jnp.asarray(np.random.default_rng(8).standard_normal((U, Ht)).astype(np.float32))
    batch = _batch(K, seed=9)
    loss_mask = np.asarray(batch.loss_mask_BT).copy()
    loss_mask[:, :8] = 0  # a prompt
    batch = batch._replace(loss_mask_BT=jnp.asarray(loss_mask))
    loss_pos = bucketed_elements(loss_mask, num_depths=K, rng=np.random.default_rng(0), buckets=4).loss_pos
    assert loss_pos.shape[1] < T and (loss_pos == -1).any()
    compact = batch._replace(loss_pos_BM=jnp.asarray(loss_pos))
    tcfg = TrainConfig(objective=objective, segments=segments)

    def run(b):
        return jax.jit(lambda tr: loss_and_grad(tr, frozen, b, head, None, cfg=cfg, tcfg=tcfg, num_depths=K))(trainable)

    (loss, metrics), grads = run(batch)
    (loss_c, metrics_c), grads_c = run(compact)
    assert float(loss) > 0.1
    np.testing.assert_allclose(loss_c, loss, rtol=1e-5)
    np.testing.assert_allclose(metrics_c["loss_sum_K"], metrics["loss_sum_K"], rtol=1e-5)
    for key in ("correct_K", "count_K"):
        np.testing.assert_array_equal(metrics_c[key], metrics[key])
    for (path, g), gc in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_c), strict=True):
        scale = float(jnp.max(jnp.abs(g))) + 1e-12
        assert float(jnp.max(jnp.abs(gc - g))) <= 1e-5 * scale + 1e-9, jax.tree_util.keystr(path)
