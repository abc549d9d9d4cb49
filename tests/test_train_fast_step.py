"""The fast training step against the reference formulation (the step before it, kept in
:mod:`peagle_jax.bench.train`): the element visibility equals the dense element mask, the chain attention equals
dense attention (EAGLE-3's per depth too), targets per position equal targets per element, and the loss,
metrics and gradients are the reference's: fp32 to 1e-5, bf16 within the bounds stated below. Rows beyond
``ops.SMALL_ROWS`` so that the training product form (:func:`peagle_jax.ops.einsum_f32`) is the one exercised."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train_loop import LAYER as ONE_LAYER

from peagle_jax import chain_attention, ops
from peagle_jax.bench.train import reference_loss, reference_ttt_loss
from peagle_jax.chain_attention import ChainVisibility
from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.model import init_drafter_params
from peagle_jax.train.cod import batch_shape, cod_batch, loss_elements, loss_positions, max_elements
from peagle_jax.train.config import TrainConfig
from peagle_jax.train.loop import compute_config, partition
from peagle_jax.train.objective import (
    PEagleBatch,
    _take,
    element_mask,
    element_positions,
    element_visibility,
    peagle_loss,
    target_logits,
    targets,
)
from peagle_jax.train.partition import segment_batch, segment_mask_capacity
from peagle_jax.train.ttt import ttt_loss, ttt_visibility, ttt_visible

V, H, Ht, U, K, B, T = 97, 32, 24, 40, 4, 2, 160
Y = max_elements(T, K) + 5  # B * Y > ops.SMALL_ROWS, with padding elements
LAYER = ONE_LAYER.replace(num_layers=2)  # the loop tests' tiny drafter layer, one layer deeper
CFG = DrafterConfig(layer=LAYER, draft_vocab_size=U, target_hidden_size=Ht, mask_token_id=V - 1)
assert B * Y > ops.SMALL_ROWS


def _params(seed):
    p = init_drafter_params(CFG, jax.random.key(seed))
    p = jax.tree.map(lambda x: x * 4 if x.dtype == jnp.float32 and x.ndim > 1 else x, p)  # livelier logits
    p["d2t"] = jnp.asarray(np.random.default_rng(seed).integers(0, V - U, U), jnp.int32)
    p["t2d"] = jnp.zeros((V,), bool).at[jnp.arange(U) + p["d2t"]].set(True)
    return p


def _batch(seed) -> tuple[PEagleBatch, jax.Array]:
    rng = np.random.default_rng(seed)
    loss_mask = np.ones((B, T), np.int32)
    loss_mask[:, :5] = 0
    loss_mask[0, 60:66] = 0  # a second conversation's prompt
    docs = np.zeros((B, T), np.int32)
    docs[0, 60:] = 1
    docs[1, T - 9 :] = -1  # padding positions
    loss_mask[1, T - 9 :] = 0
    elements = cod_batch(loss_mask, Y, num_depths=K, rng=rng)
    batch = PEagleBatch(
        rng.integers(0, V - 1, (B, T)).astype(np.int32),
        rng.standard_normal((B, T, 3 * Ht)).astype(np.float32),
        rng.standard_normal((B, T, Ht)).astype(np.float32),
        loss_mask,
        docs,
        *elements,
    )
    head = jnp.asarray(rng.standard_normal((U, Ht)).astype(np.float32))
    return jax.tree.map(jnp.asarray, batch), head


def _dense(vis: ChainVisibility) -> np.ndarray:
    """The [B, T, S] boolean mask a ChainVisibility stands for."""
    prefix, chain, ok = (np.asarray(x) for x in vis.arrays)
    dense = np.zeros(vis.shape, bool)
    dense[:, :, : prefix.shape[2]] = prefix
    rows, queries, slots = np.nonzero(ok)
    dense[rows, queries, chain[rows, queries, slots]] = True
    return dense


@pytest.mark.parametrize("seed", range(3))
def test_element_visibility_equals_element_mask(seed):
    batch, _ = _batch(seed)
    args = (batch.anchor_BY, batch.depth_BY, batch.valid_BY, batch.document_ids_BT)
    want = np.asarray(element_mask(*args))
    vis = element_visibility(*args, num_depths=K)
    np.testing.assert_array_equal(_dense(vis), want)
    assert not np.any(np.asarray(vis.chain_BTE)[np.asarray(vis.chain_ok_BTE)] < T)  # never a prefix slot twice
    # Also on the segments of sequence partitioning (depth-0 elements past the segment invalid).
    for s in range(3):
        part, _ = segment_batch(batch, jnp.int32(s), segments=3, capacity=segment_mask_capacity(T, Y, 3, K))
        args = (part.anchor_BY, part.depth_BY, part.valid_BY, part.document_ids_BT)
        np.testing.assert_array_equal(_dense(element_visibility(*args, num_depths=K)), np.asarray(element_mask(*args)))


def test_ttt_visibility_equals_ttt_visible():
    """EAGLE-3's chain visibility per depth is its dense [T, K*T] mask (two conversations, padding)."""
    batch, _ = _batch(0)
    for d in range(K):
        vis = ttt_visibility(batch.document_ids_BT, d, K)
        assert vis.shape == (B, T, K * T)
        np.testing.assert_array_equal(_dense(vis), np.asarray(ttt_visible(batch.document_ids_BT, d, K)))
        assert not np.any(np.asarray(vis.chain_BTE) < T)  # never a prefix slot twice


@pytest.mark.parametrize("tiles", [1, 3, 7])
def test_chain_attention_and_its_gradient_equal_dense_attention(tiles, monkeypatch):
    """Forward and hand-written gradient (fp32, 1e-5) against dense attention under autodiff: untiled, in 3
    query tiles (Y = 406 queries, padded to 408) and in 7."""
    assert Y % 3 and not Y % 7
    batch, _ = _batch(5)
    vis = element_visibility(batch.anchor_BY, batch.depth_BY, batch.valid_BY, batch.document_ids_BT, num_depths=K)
    N, C = 4, vis.prefix_BTC.shape[2]
    monkeypatch.setattr(chain_attention, "TILE_SCORES", -(-B * Y * N * C // tiles))
    assert chain_attention.num_tiles(B, Y, N, C) == tiles
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, Y, N, 8)).astype(np.float32))
    k, v = (jnp.asarray(rng.standard_normal((B, 2, Y, 8)).astype(np.float32)) for _ in range(2))
    dense = jnp.asarray(_dense(vis))
    usable = np.asarray(dense.any(axis=-1))  # rows that see nothing differ (uniform over other slots): unused
    dout = jnp.asarray(rng.standard_normal(q.shape).astype(np.float32) * usable[:, :, None, None])
    want, want_vjp = jax.vjp(lambda q, k, v: ops.attention(q, k, v, dense, form="q @ K^T"), q, k, v)
    got, got_vjp = jax.vjp(lambda q, k, v: ops.attention(q, k, v, vis), q, k, v)
    np.testing.assert_allclose(np.asarray(got)[usable], np.asarray(want)[usable], rtol=1e-5, atol=1e-6)
    for g, w in zip(got_vjp(dout), want_vjp(dout), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_chain_attention_bf16_gradient_within_bf16_rounding_of_fp32():
    """In bf16 the tiled attention and its gradient stay within a few bf16 roundings of the fp32 result."""
    batch, _ = _batch(6)
    vis = element_visibility(batch.anchor_BY, batch.depth_BY, batch.valid_BY, batch.document_ids_BT, num_depths=K)
    rng = np.random.default_rng(1)
    args = [rng.standard_normal(s).astype(np.float32) for s in ((B, Y, 4, 8), (B, 2, Y, 8), (B, 2, Y, 8))]
    args = [np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in args]  # bf16-exact inputs
    dout = np.asarray(jnp.asarray(rng.standard_normal((B, Y, 4, 8)), jnp.bfloat16), np.float32)

    def run(dtype):
        out, vjp = jax.vjp(lambda *a: ops.attention(*a, vis), *(jnp.asarray(a, dtype) for a in args))
        return [np.asarray(x, np.float32) for x in (out, *vjp(jnp.asarray(dout, dtype)))]

    for got, want in zip(run(jnp.bfloat16), run(jnp.float32), strict=True):
        assert np.max(np.abs(got - want)) <= 4 * 2**-8 * np.max(np.abs(want))


def test_targets_per_position_equal_targets_per_element():
    batch, head = _batch(1)
    pos = element_positions(batch.anchor_BY, batch.depth_BY, T)
    per_element = target_logits(head, _take(batch.target_hidden_BTD, pos))
    tgt = targets(head, batch.target_hidden_BTD)
    np.testing.assert_allclose(
        np.asarray(_take(tgt.log_probs_BTU, pos)), np.asarray(jax.nn.log_softmax(per_element)), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(np.asarray(_take(tgt.argmax_BT, pos)), np.asarray(jnp.argmax(per_element, -1)))


@functools.partial(jax.jit, static_argnames=("objective", "dtype"))
def _loss_and_grad(trainable, frozen, batch, head, *, objective, dtype):
    ccfg = compute_config(CFG, TrainConfig(compute_dtype=dtype))
    fn = {"fast": peagle_loss, "reference": reference_loss, "eagle3": ttt_loss, "eagle3_dense": reference_ttt_loss}[
        objective
    ]

    def loss_fn(tr):
        p = jax.tree.map(lambda x: x.astype(ccfg.layer.jnp_dtype) if x.dtype == jnp.float32 else x, {**tr, **frozen})
        return fn(p, batch, head, cfg=ccfg, num_depths=K)

    return jax.value_and_grad(loss_fn, has_aux=True)(trainable)


def _flat(grads):
    return np.concatenate([np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(grads)])


def _assert_fast_equals_reference(
    fast: PEagleBatch, ref: PEagleBatch, head, seed: int, objectives=("fast", "reference")
) -> None:
    """The fast objective on ``fast`` and the reference on ``ref`` (the same elements): the same loss and
    per-depth loss sums (fp32, 1e-5), accuracy counts and weights, and gradients within 1e-5 in norm."""
    trainable, frozen = partition(_params(seed), CFG)
    (loss, m), g = _loss_and_grad(trainable, frozen, fast, head, objective=objectives[0], dtype="float32")
    (ref_loss, ref_m), ref_g = _loss_and_grad(trainable, frozen, ref, head, objective=objectives[1], dtype="float32")
    assert float(ref_loss) > 0.1
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(m["loss_sum_K"]), np.asarray(ref_m["loss_sum_K"]), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(m["correct_K"]), np.asarray(ref_m["correct_K"]))
    np.testing.assert_array_equal(np.asarray(m["count_K"]), np.asarray(ref_m["count_K"]))
    for name in g:
        a, b = _flat(g[name]), _flat(ref_g[name])
        # Relative to the leaf's gradient norm (single entries near zero carry only rounding).
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b), name


@pytest.mark.parametrize("seed", range(3))
def test_fast_loss_metrics_and_gradients_equal_reference_fp32(seed):
    batch, head = _batch(seed)
    _assert_fast_equals_reference(batch, batch, head, seed)


@pytest.mark.parametrize("seed", range(2))
def test_eagle3_chain_attention_equals_dense_masks_fp32(seed):
    """EAGLE-3's TTT loss, metrics and gradients with each depth's chain attention equal those over its dense
    [T, K*T] mask (fp32, 1e-5); gradients flow through the fed-back hidden states and the cache."""
    batch, head = _batch(seed)
    _assert_fast_equals_reference(batch, batch, head, seed, objectives=("eagle3", "eagle3_dense"))


@pytest.mark.parametrize("buckets", [1, 4])
def test_bucketed_batch_with_the_head_on_loss_elements_equals_reference(buckets):
    """A row whose prompts carry no loss (about half of it here): its batch padded only to its bucket's Y
    elements, the LM head and KL run over only its L elements with loss (``loss_at_BM``) and the target's
    distribution computed at its M loss positions only (``loss_pos_BM``) give the reference's loss, metrics
    and gradients (fp32, 1e-5) on the same elements padded for every position."""
    full, head = _batch(2)
    loss_mask = np.asarray(full.loss_mask_BT).copy()
    loss_mask[0, 70:140] = 0  # a long prompt, and another in the second row
    loss_mask[1, 30:90] = 0
    shape = batch_shape(loss_mask.sum(1), T, K, buckets=buckets)
    assert (shape.Y < Y and shape.Y_loss < shape.Y and shape.T_loss < T) if buckets > 1 else shape == (Y - 5, Y - 5, T)
    elements = cod_batch(loss_mask, shape.Y, num_depths=K, rng=np.random.default_rng(9))
    padded = cod_batch(loss_mask, Y, num_depths=K, rng=np.random.default_rng(9))
    at = loss_elements(elements, loss_mask, shape.Y_loss)
    assert (at >= 0).sum() < elements.valid.sum()  # the prompts' depth-0 elements are left out of the head
    loss_pos = loss_positions(loss_mask, shape.T_loss)

    def with_elements(els, loss_at=None, loss_pos=None):
        a, d, v = map(jnp.asarray, els)
        return full._replace(
            loss_mask_BT=jnp.asarray(loss_mask),
            anchor_BY=a,
            depth_BY=d,
            valid_BY=v,
            loss_at_BM=loss_at,
            loss_pos_BM=loss_pos,
        )

    fast = with_elements(elements, jnp.asarray(at), jnp.asarray(loss_pos))
    _assert_fast_equals_reference(fast, with_elements(padded), head, 2)


@pytest.mark.parametrize("objective", ["fast", "reference", "eagle3"])
def test_target_hidden_is_read_only_where_the_loss_is(objective):
    """The features store ``target_hidden`` as zeros where the loss mask is 0 (half of a row is prompt): the
    loss, the metrics and every gradient are the same bit for bit."""
    batch, head = _batch(1)
    zeroed = batch._replace(
        target_hidden_BTD=jnp.where(batch.loss_mask_BT[:, :, None] != 0, batch.target_hidden_BTD, 0.0)
    )
    assert not np.array_equal(np.asarray(zeroed.target_hidden_BTD), np.asarray(batch.target_hidden_BTD))
    trainable, frozen = partition(_params(1), CFG)
    want = _loss_and_grad(trainable, frozen, batch, head, objective=objective, dtype="float32")
    got = _loss_and_grad(trainable, frozen, zeroed, head, objective=objective, dtype="float32")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fast_bf16_within_bounds_of_fp32():
    """bf16 compute: operands rounded to 8 significant bits (relative 2^-9 ~ 0.2% each), f32 accumulation and
    an fp32 softmax/KL. Bounds: the loss within 2% of the fp32 reference, the whole gradient within 5% (in
    norm) of it; and the fast bf16 step no further from fp32 than 1.5x the former bf16 step (which rounded
    every product's result to bf16 too) plus 0.5%."""
    batch, head = _batch(0)
    trainable, frozen = partition(_params(0), CFG)
    run = functools.partial(_loss_and_grad, trainable, frozen, batch, head)
    (ref, _), g_ref = run(objective="reference", dtype="float32")
    (fast, _), g_fast = run(objective="fast", dtype="bfloat16")
    (old, _), g_old = run(objective="reference", dtype="bfloat16")
    assert float(fast) != float(ref)  # the products really ran in bf16
    np.testing.assert_allclose(float(fast), float(ref), rtol=2e-2)
    ref_v = _flat(g_ref)
    err_fast = np.linalg.norm(_flat(g_fast) - ref_v) / np.linalg.norm(ref_v)
    err_old = np.linalg.norm(_flat(g_old) - ref_v) / np.linalg.norm(ref_v)
    assert err_fast < 5e-2
    assert err_fast <= 1.5 * err_old + 5e-3
    assert abs(float(fast) - float(ref)) <= 1.5 * abs(float(old) - float(ref)) + 5e-3 * float(ref)


def test_einsum_f32_bf16_gradient_is_the_rounded_products():
    """bf16 operands: the forward and both gradient products are the f32 products of the bf16 values."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((600, 24)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((40, 24)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((600, 40)), jnp.float32)
    y, vjp = jax.vjp(lambda a, b: ops.einsum_f32("MI,OI->MO", a, b), a, b)
    da, db = vjp(g)
    assert y.dtype == jnp.float32 and da.dtype == b.dtype == jnp.bfloat16
    a32, b32, g16 = (np.asarray(x, np.float32) for x in (a, b, g.astype(jnp.bfloat16)))
    np.testing.assert_allclose(np.asarray(y), a32 @ b32.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(da, np.float32), g16 @ b32, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(db, np.float32), g16.T @ a32, rtol=1e-2, atol=5e-2)


@pytest.mark.parametrize(
    "spec, shape_a, shape_b",
    [
        ("MI,OI->MO", (24, 16), (40, 16)),  # a linear layer: its weight gradient sums over the rows
        ("BGMH,BGCH->BGMC", (2, 3, 20, 8), (2, 3, 12, 8)),  # attention scores
        ("BGMC,BGCH->BGMH", (2, 3, 20, 12), (2, 3, 12, 8)),  # attention output
        ("MI,OI->MO", (21, 16), (40, 16)),  # an odd row count (21 = 3 x 7)
        ("MI,OI->MO", (23, 16), (41, 16)),  # a prime row count, and a prime output width
        ("MI,OI->MO", (1, 16), (5, 16)),  # one row
        ("MI,OI->MO", (13, 7), (11, 7)),  # every extent prime: left to XLA
    ],
)
def test_einsum_f32_bf16_products_in_every_form(spec, shape_a, shape_b):
    """Forward and both gradients of a bf16 ``einsum_f32`` equal the float64 products of the bf16 values (the
    cotangent rounded to bf16) to f32 accumulation, whichever operand is copied into the kernel's form."""
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal(shape_a), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(shape_b), jnp.bfloat16)
    y, vjp = jax.jit(lambda a, b: jax.vjp(lambda a, b: ops.einsum_f32(spec, a, b), a, b))(a, b)
    g = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)
    da, db = jax.jit(vjp)(g)
    ins, out = spec.split("->")
    sa, sb = ins.split(",")
    a64, b64, g64 = (np.asarray(x, np.float64) for x in (a, b, g.astype(jnp.bfloat16)))
    np.testing.assert_allclose(np.asarray(y), np.einsum(spec, a64, b64), rtol=1e-5, atol=1e-5)
    for got, want in ((da, np.einsum(f"{out},{sb}->{sa}", g64, b64)), (db, np.einsum(f"{out},{sa}->{sb}", g64, a64))):
        assert got.dtype == jnp.bfloat16
        # the f32 sum rounded to bf16: within one bf16 rounding (2^-8 relative) of the exact sum
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-8, atol=1e-5)


def test_swiglu_gradient_equals_autodiff():
    """ops.swiglu's forward is silu(gate) * up bit for bit; its written-out gradient equals autodiff's in fp32
    (1e-6) and lies within one bf16 rounding of the fp32 gradient in bf16."""
    rng = np.random.default_rng(3)
    gu = rng.standard_normal((2, 7, 2, 96)).astype(np.float32) * 3
    dy = rng.standard_normal((2, 7, 96)).astype(np.float32)
    plain = lambda x: jax.nn.silu(x[..., 0, :]) * x[..., 1, :]  # noqa: E731
    want, want_vjp = jax.vjp(plain, jnp.asarray(gu))
    got, got_vjp = jax.vjp(ops.swiglu, jnp.asarray(gu))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(
        np.asarray(got_vjp(jnp.asarray(dy))[0]), np.asarray(want_vjp(jnp.asarray(dy))[0]), 1e-6, 1e-6
    )
    gu16, dy16 = jnp.asarray(gu, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
    out16, vjp16 = jax.vjp(ops.swiglu, gu16)
    np.testing.assert_array_equal(np.asarray(out16), np.asarray(plain(gu16)))
    exact = np.asarray(jax.vjp(plain, gu16.astype(jnp.float32))[1](dy16.astype(jnp.float32))[0])
    np.testing.assert_allclose(np.asarray(vjp16(dy16)[0], np.float32), exact, rtol=2**-8, atol=1e-6)
