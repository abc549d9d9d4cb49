"""P-EAGLE training: COD sampling, the element mask and the loss, against the ``speculators`` reference.

speculators' ``PEagleDraftModel`` training forward is run with eager attention and the eager KL loss, with
its COD indices fixed to ours (monkeypatched), on the weights it saved; our side loads that checkpoint.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

speculators = pytest.importorskip("speculators", reason="install with: pip install --no-deps speculators==0.9.0")

from speculators.losses import resolve_loss_config  # noqa: E402
from speculators.losses.eager import kl_div_loss  # noqa: E402
from speculators.models.peagle.attention import create_peagle_mask_mod  # noqa: E402
from speculators.models.peagle.data import generate_cod_sample_indices  # noqa: E402
from speculators_ref import H, U, V, reference_drafter  # noqa: E402

from peagle_jax.drafter.load import load_drafter  # noqa: E402
from peagle_jax.train.cod import (  # noqa: E402
    batch_shape,
    cod_batch,
    cod_sample,
    depth_sizes_bound,
    loss_elements,
    loss_positions,
    max_elements,
    pad_elements,
)
from peagle_jax.train.objective import PEagleBatch, element_mask, peagle_loss, split_trainable  # noqa: E402


def _reference_mask(anchor, depth, docs):
    mod = create_peagle_mask_mod(torch.tensor(anchor), torch.tensor(depth), torch.tensor(docs))
    Y = len(anchor)
    return mod(None, None, torch.arange(Y)[:, None], torch.arange(Y)[None, :]).numpy()


@pytest.mark.parametrize("seed", range(4))
def test_element_mask_matches_speculators(seed):
    rng = np.random.default_rng(seed)
    T, Y = 20, 40
    docs = np.array([0] * 9 + [1] * 8 + [-1] * 3, np.int64)  # two documents, then padding positions
    anchor = rng.integers(0, T, Y)
    depth = np.where(rng.random(Y) < 0.4, 0, rng.integers(1, 4, Y))
    anchor[:T], depth[:T] = np.arange(T), 0  # every depth-0 element, as COD makes them
    ref = _reference_mask(anchor, depth, docs)
    valid = np.ones(Y, bool)
    ours = element_mask(jnp.asarray(anchor[None]), jnp.asarray(depth[None]), jnp.asarray(valid[None]), docs[None])
    np.testing.assert_array_equal(np.asarray(ours[0]), ref)
    # Invalid (padding) elements see nothing and are seen by nobody; the rest is unchanged.
    valid = rng.random(Y) < 0.8
    ours = element_mask(jnp.asarray(anchor[None]), jnp.asarray(depth[None]), jnp.asarray(valid[None]), docs[None])
    np.testing.assert_array_equal(np.asarray(ours[0]), ref & valid[:, None] & valid[None, :])


def _check_cod(anchor, depth, loss_mask, num_depths, n_seeds):
    """Invariants of a COD sample; returns the size per depth 1..K-1."""
    n = loss_mask.shape[0]
    np.testing.assert_array_equal(anchor[:n], np.arange(n))
    np.testing.assert_array_equal(depth[:n], 0)
    assert np.all(np.diff(depth) >= 0)
    kept = {(int(a), int(d)) for a, d in zip(anchor, depth, strict=True)}
    assert len(kept) == len(anchor)
    for a, d in zip(anchor[n:], depth[n:], strict=True):
        assert (a, d - 1) in kept  # the chain from an anchor is contiguous
        assert a >= 0 and loss_mask[a + d] == 1  # targets only loss-masked positions
    return _sizes(anchor, depth, loss_mask, num_depths, n_seeds)


def _sizes(anchor, depth, loss_mask, num_depths, n_seeds):
    """Sizes per depth, checked against the formula: depth 1 has exactly its formula size, depth d >= 2 the
    formula size or the whole pool (kept depth d-1 positions shifted by one, loss-masked) when smaller."""
    n = loss_mask.shape[0]
    bound = depth_sizes_bound(n_seeds, num_depths) + [0] * num_depths
    sizes = [int((depth == d).sum()) for d in range(1, num_depths)]
    assert sizes[0] == bound[0]
    for d in range(2, num_depths):
        pool = {p for p in (anchor[depth == d - 1] + d).tolist() if p < n and loss_mask[p] == 1}
        assert sizes[d - 1] == min(bound[d - 1], len(pool))
    return sizes


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("layout", ["full", "partial", "max_anchors"])
def test_cod_sampling_invariants_and_sizes(seed, layout):
    n, K = 200, 8
    loss_mask = np.ones(n, np.int64)
    if layout != "full":
        loss_mask[:30] = 0  # a prompt
        loss_mask[120:140] = 0  # a second prompt
    max_anchors = 100 if layout == "max_anchors" else None
    n_seeds = min(int(loss_mask.sum()), max_anchors or n)
    anchor, depth = cod_sample(loss_mask, num_depths=K, rng=np.random.default_rng(seed), max_anchors=max_anchors)
    sizes = _check_cod(anchor, depth, loss_mask, K, n_seeds)
    torch.manual_seed(seed)
    ref_anchor, ref_depth = generate_cod_sample_indices(
        n, torch.tensor(loss_mask)[None], num_depths=K, max_anchors=max_anchors
    )
    ref_sizes = _sizes(ref_anchor.numpy(), ref_depth.numpy(), loss_mask, K, n_seeds)
    # Where the pools are surely larger than the sample (before the r_min floor) the sizes are equal; past
    # it they follow the same rule from different random draws.
    assert sizes[:4] == ref_sizes[:4] == depth_sizes_bound(n_seeds, K)[:4]
    assert max(anchor.shape[0], ref_anchor.shape[0]) <= max_elements(n, K, max_anchors=max_anchors)
    # Reproducible for a seed, and the seed matters.
    again = cod_sample(loss_mask, num_depths=K, rng=np.random.default_rng(seed), max_anchors=max_anchors)
    np.testing.assert_array_equal(again[0], anchor)
    other = cod_sample(loss_mask, num_depths=K, rng=np.random.default_rng(seed + 10), max_anchors=max_anchors)
    assert not np.array_equal(other[0], anchor)


@pytest.mark.parametrize("max_anchors", [None, 90])
def test_batch_shape_bounds_every_batch_in_a_few_buckets(max_anchors):
    """Over rows with every share of loss positions: each batch's elements fit its bucket's Y, its elements
    with loss fit L (and are exactly the valid elements at loss positions), its loss positions fit M, the
    shapes number at most ``buckets``, and one bucket is :func:`max_elements` for Y and L (M = T)."""
    T, K, buckets = 200, 6, 4
    rng = np.random.default_rng(0)
    shapes = set()
    for trial in range(40):
        loss_mask = (rng.random((2, T)) < trial / 40).astype(np.int32)
        loss_mask[:, : rng.integers(0, T)] = 0  # a prompt
        shape = batch_shape(loss_mask.sum(1), T, K, max_anchors=max_anchors, buckets=buckets)
        shapes.add(shape)
        elements = cod_batch(loss_mask, shape.Y, num_depths=K, rng=rng, max_anchors=max_anchors)
        at = loss_elements(elements, loss_mask, shape.Y_loss)
        for b in range(2):
            pos = elements.anchor[b] + elements.depth[b]
            want = np.flatnonzero(elements.valid[b] & (loss_mask[b, np.clip(pos, 0, T - 1)] != 0))
            np.testing.assert_array_equal(at[b][at[b] >= 0], want)
            assert np.all(at[b][want.shape[0] :] == -1)
        one = batch_shape(loss_mask.sum(1), T, K, max_anchors=max_anchors, buckets=1)
        assert one == (max_elements(T, K, max_anchors=max_anchors),) * 2 + (T,)
        positions = loss_positions(loss_mask, shape.T_loss)
        for b in range(2):
            np.testing.assert_array_equal(positions[b][positions[b] >= 0], np.flatnonzero(loss_mask[b]))
    assert 1 < len(shapes) <= buckets
    with pytest.raises(ValueError, match="buckets"):
        batch_shape([3], T, K, buckets=0)


def test_cod_short_sequence_and_padding():
    loss_mask = np.array([1, 1, 0, 1, 1, 1])
    anchor, depth = cod_sample(loss_mask, num_depths=8, rng=np.random.default_rng(0))
    _check_cod(anchor, depth, loss_mask, 8, 5)
    padded = pad_elements(anchor, depth, 16)
    assert padded.valid.sum() == anchor.shape[0] and not padded.valid[anchor.shape[0] :].any()
    with pytest.raises(ValueError, match="do not fit"):
        pad_elements(anchor, depth, anchor.shape[0] - 1)


# --- the loss, against speculators' training forward --------------------------------------------------------


def _reference(family, layers, kv_heads, seed, flags, tmp_path):
    return reference_drafter("peagle", family, layers, kv_heads, seed, flags, tmp_path / "peagle")


CASES = [
    # id, layer family, layers, kv heads, seed, flags, positions T
    ("llama-1L", "llama", 1, 2, 0, {}, 30),
    ("llama-3L-normfc", "llama", 3, 2, 1, {"norm_before_fc": True}, 30),
    ("qwen3-2L-all", "qwen3", 2, 2, 2, {"fc_norm": True, "norm_before_residual": True, "norm_output": True}, 30),
    ("llama-2L-long", "llama", 2, 2, 3, {}, 520),
]


def _inputs(seed, T):
    rng = np.random.default_rng(seed + 100)
    ids = rng.integers(0, V - 1, (1, T))
    aux = rng.standard_normal((1, T, 3 * H)).astype(np.float32)
    last = rng.standard_normal((1, T, H)).astype(np.float32)
    loss_mask = np.ones((1, T), np.int64)
    loss_mask[0, :4] = 0  # first document's prompt
    loss_mask[0, 16:19] = 0  # second document's prompt
    docs = np.array([[0] * 16 + [1] * (T - 16)])
    return ids, aux, last, loss_mask, docs


@functools.partial(jax.jit, static_argnames=("cfg", "num_depths"))
def _loss_jit(params, batch, head, *, cfg, num_depths):
    return peagle_loss(params, batch, head, cfg=cfg, num_depths=num_depths)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_loss_and_metrics_match_speculators(case, tmp_path, monkeypatch):
    _, family, layers, kv_heads, seed, flags, T = case
    model, path = _reference(family, layers, kv_heads, seed, flags, tmp_path)
    K = 4
    Y = max_elements(T, K) + 3  # at least three padding elements
    ids, aux, last, loss_mask, docs = _inputs(seed, T)
    anchor, depth = cod_sample(loss_mask[0], num_depths=K, rng=np.random.default_rng(seed))
    monkeypatch.setattr(
        "speculators.models.peagle.core.generate_cod_sample_indices",
        lambda **_: (torch.tensor(anchor, dtype=torch.long), torch.tensor(depth, dtype=torch.long)),
    )
    captured = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    with torch.no_grad():
        _, ref_loss, ref_metrics = model(
            hidden_states=torch.tensor(aux),
            input_ids=torch.tensor(ids),
            document_ids=torch.tensor(docs),
            loss_mask=torch.tensor(loss_mask),
            verifier_last_hidden_states=torch.tensor(last),
            loss_config=resolve_loss_config("kl_div", "eager"),
            num_depths=K,
        )
        target_hidden = model.verifier_norm(torch.tensor(last)).numpy()
        head = jnp.asarray(model.verifier_lm_head.weight.numpy())

    cfg, params = load_drafter(path)
    elements = pad_elements(anchor, depth, Y)
    batch = PEagleBatch(ids, aux, target_hidden, loss_mask, docs, *(x[None] for x in elements))
    batch = jax.tree.map(jnp.asarray, batch)
    loss, metrics = _loss_jit(params, batch, head, cfg=cfg, num_depths=K)
    np.testing.assert_allclose(float(loss), float(ref_loss), atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss_sum"]), atol=1e-4, rtol=1e-5)
    ref_correct = [float(ref_metrics[f"position_{d}_acc_sum"]) for d in range(K)]
    ref_count = [float(ref_metrics[f"position_{d}_acc_total"]) for d in range(K)]
    np.testing.assert_array_equal(np.asarray(metrics["correct_K"]), ref_correct)
    np.testing.assert_array_equal(np.asarray(metrics["count_K"]), ref_count)
    assert float(metrics["correct_K"].sum()) == float(ref_metrics["full_acc_sum"])
    # Per-depth loss sums: speculators' eager KL per element on its own logits, summed per depth.
    with torch.no_grad():
        ref_targets = model.verifier_lm_head(torch.tensor(target_hidden))[:, anchor + depth]
        ref_kl = kl_div_loss(captured[0], ref_targets)[0].numpy() * loss_mask[0, anchor + depth]
    ref_loss_sum = [ref_kl[depth == d].sum() for d in range(K)]
    np.testing.assert_allclose(np.asarray(metrics["loss_sum_K"]), ref_loss_sum, atol=1e-4, rtol=1e-5)
    # The per-depth losses add up to the loss.
    total = float(metrics["loss_sum_K"].sum()) / float(metrics["count_K"].sum())
    np.testing.assert_allclose(total, float(loss), rtol=1e-5)


def test_gradients_finite_and_padding_has_no_influence(tmp_path):
    _, path = _reference("llama", 2, 2, 7, {}, tmp_path)
    cfg, params = load_drafter(path)
    T, K, Y = 30, 4, 90
    ids, aux, last, loss_mask, docs = _inputs(7, T)
    anchor, depth = cod_sample(loss_mask[0], num_depths=K, rng=np.random.default_rng(3))
    elements = pad_elements(anchor, depth, Y)
    head = jnp.asarray(np.random.default_rng(0).standard_normal((U, H)).astype(np.float32) / H**0.5)
    batch = jax.tree.map(jnp.asarray, PEagleBatch(ids, aux, last, loss_mask, docs, *(x[None] for x in elements)))

    trainable, frozen = split_trainable(params)
    assert set(frozen) == {"d2t", "t2d"}

    @jax.jit
    def grad_fn(trainable, batch):
        loss_fn = functools.partial(peagle_loss, cfg=cfg, num_depths=K)
        return jax.value_and_grad(lambda p: loss_fn({**p, **frozen}, batch, head), has_aux=True)(trainable)

    (loss, _), grads = grad_fn(trainable, batch)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads["mask_hidden"]).sum()) > 0  # mask elements train mask_hidden
    assert float(jnp.abs(grads["fc"]["weight"]).sum()) > 0

    # Padding elements pointing elsewhere (other anchors, depths, hence tokens and aux) change nothing.
    pad = ~np.asarray(elements.valid)
    rng = np.random.default_rng(1)
    moved = batch._replace(
        anchor_BY=jnp.where(pad[None], jnp.asarray(rng.integers(0, T - 4, (1, Y)), jnp.int32), batch.anchor_BY),
        depth_BY=jnp.where(pad[None], jnp.asarray(rng.integers(0, K, (1, Y)), jnp.int32), batch.depth_BY),
    )
    (loss2, _), grads2 = grad_fn(trainable, moved)
    assert float(loss2) == float(loss)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6, rtol=0)


def test_batch_rows_are_independent(tmp_path):
    """A two-row batch (different documents, loss masks and COD draws) gives the per-row metric sums."""
    _, path = _reference("llama", 1, 2, 9, {}, tmp_path)
    cfg, params = load_drafter(path)
    T, K, Y = 30, 4, 80
    rows = [_inputs(9, T), _inputs(10, T)]
    rows[1][3][0, 20:] = 0
    stacked = [np.concatenate(x) for x in zip(*rows, strict=True)]
    ids, aux, last, loss_mask, docs = stacked
    elements = cod_batch(loss_mask, Y, num_depths=K, rng=np.random.default_rng(5))
    assert elements.anchor.shape == (2, Y) and elements.valid.dtype == bool
    head = jnp.asarray(np.random.default_rng(0).standard_normal((U, H)).astype(np.float32) / H**0.5)
    batch = jax.tree.map(jnp.asarray, PEagleBatch(ids, aux, last, loss_mask, docs, *elements))
    loss, metrics = _loss_jit(params, batch, head, cfg=cfg, num_depths=K)
    singles = [
        _loss_jit(params, jax.tree.map(lambda x, b=b: x[b : b + 1], batch), head, cfg=cfg, num_depths=K)[1]
        for b in range(2)
    ]
    for key in ("loss_sum_K", "correct_K", "count_K"):
        np.testing.assert_allclose(np.asarray(metrics[key]), sum(np.asarray(m[key]) for m in singles), atol=1e-4)
    np.testing.assert_allclose(float(loss), float(metrics["loss_sum_K"].sum() / metrics["count_K"].sum()), rtol=1e-5)
