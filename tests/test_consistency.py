"""Self-consistency of the cached forward: one full pass, prefill + decode, and multi-token extends agree."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peagle_jax.models import model as M
from peagle_jax.models.config import ModelConfig

CFG = ModelConfig(
    family="qwen3",
    vocab_size=101,
    hidden_size=48,
    intermediate_size=96,
    num_layers=3,
    num_heads=6,
    num_kv_heads=2,
    head_dim=8,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def params():
    return M.init_params(CFG, jax.random.key(0))


def _full(params, ids, slots=48):
    out, _ = M.forward_jit(
        params, M.new_cache(CFG, ids.shape[0], slots), jnp.asarray(ids), jnp.zeros(ids.shape[0], jnp.int32), cfg=CFG
    )
    return out


def test_prefill_then_decode_equals_full_forward(params):
    ids = np.random.RandomState(1).randint(0, CFG.vocab_size, (2, 20))
    full = _full(params, ids)
    cache = M.new_cache(CFG, 2, 48)
    pre, cache = M.prefill(
        params, cache, jnp.asarray(ids[:, :12]), jnp.array([12, 12]), jnp.zeros(2, jnp.int32), cfg=CFG
    )
    np.testing.assert_allclose(pre.logits, full.logits[:, 11], atol=1e-5, rtol=0)
    for t in range(12, 20):
        out, cache = M.forward_jit(params, cache, jnp.asarray(ids[:, t : t + 1]), jnp.full(2, t, jnp.int32), cfg=CFG)
        np.testing.assert_allclose(out.logits[:, 0], full.logits[:, t], atol=1e-5, rtol=0)
        np.testing.assert_allclose(out.aux[:, 0], full.aux[:, t], atol=1e-5, rtol=0)
        np.testing.assert_allclose(out.hidden[:, 0], full.hidden[:, t], atol=1e-5, rtol=0)


def test_multi_token_extend_equals_full_forward(params):
    ids = np.random.RandomState(2).randint(0, CFG.vocab_size, (1, 20))
    full = _full(params, ids)
    cache = M.new_cache(CFG, 1, 48)
    _, cache = M.forward_jit(params, cache, jnp.asarray(ids[:, :7]), jnp.zeros(1, jnp.int32), cfg=CFG)
    out, cache = M.forward_jit(params, cache, jnp.asarray(ids[:, 7:15]), jnp.full(1, 7, jnp.int32), cfg=CFG)
    np.testing.assert_allclose(out.logits, full.logits[:, 7:15], atol=1e-5, rtol=0)
    out, cache = M.forward_jit(params, cache, jnp.asarray(ids[:, 15:]), jnp.full(1, 15, jnp.int32), cfg=CFG)
    np.testing.assert_allclose(out.logits, full.logits[:, 15:], atol=1e-5, rtol=0)


def test_rows_at_different_positions_and_padding_rows(params):
    """Rows of one batch at different absolute positions match their own single-row runs; a padding row
    (garbage tokens, any position) does not disturb them."""
    rng = np.random.RandomState(3)
    a, b = rng.randint(0, CFG.vocab_size, 9), rng.randint(0, CFG.vocab_size, 16)
    full_a, full_b = _full(params, a[None]), _full(params, b[None])
    cache = M.new_cache(CFG, 3, 48)
    toks = np.zeros((3, 16), np.int32)
    toks[0, :9], toks[1] = a, b
    toks[2] = rng.randint(0, CFG.vocab_size, 16)
    pre, cache = M.prefill(
        params, cache, jnp.asarray(toks[:, :8]), jnp.array([8, 8, 8]), jnp.zeros(3, jnp.int32), cfg=CFG
    )
    # Row 0 extends by 1 real token (position 8), row 1 by its 8 remaining, in one call of T=8.
    ext = np.zeros((3, 8), np.int32)
    ext[0, 0], ext[1] = a[8], b[8:]
    out, cache = M.forward_jit(params, cache, jnp.asarray(ext), jnp.array([8, 8, 40], jnp.int32), cfg=CFG)
    np.testing.assert_allclose(out.logits[0, 0], full_a.logits[0, 8], atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.logits[1], full_b.logits[0, 8:], atol=1e-5, rtol=0)


def test_caller_mask_among_new_tokens(params):
    """A tree-style mask: two siblings at the same depth each see the prefix but not each other."""
    ids = np.random.RandomState(4).randint(0, CFG.vocab_size, (1, 10))
    cache = M.new_cache(CFG, 1, 48)
    _, cache = M.forward_jit(params, cache, jnp.asarray(ids[:, :8]), jnp.zeros(1, jnp.int32), cfg=CFG)
    sib = np.array([[ids[0, 8], ids[0, 9]]])
    mask = jnp.asarray(np.eye(2, dtype=bool)[None])
    pos = jnp.array([[8, 8]], jnp.int32)
    out, _ = M.forward_jit(params, cache, jnp.asarray(sib), jnp.full(1, 8, jnp.int32), mask, pos, cfg=CFG)
    for j in range(2):
        alt = np.concatenate([ids[:, :8], sib[:, j : j + 1]], axis=1)
        np.testing.assert_allclose(out.logits[0, j], _full(params, alt).logits[0, 8], atol=1e-5, rtol=0)


def test_causality_by_gradient():
    """The logits at position t do not depend on embeddings of later tokens (untied, so the embedding
    table reaches the logits only through the inputs)."""
    cfg = CFG.replace(tie_word_embeddings=False)
    params = M.init_params(cfg, jax.random.key(1))
    ids = jnp.asarray(np.random.RandomState(5).permutation(cfg.vocab_size)[None, :6])

    def logit_sum_at(embed, t):
        p = {**params, "embed_tokens": embed}
        out, _ = M.forward(p, M.new_cache(cfg, 1, 8), ids, jnp.zeros(1, jnp.int32), cfg=cfg)
        return out.logits[0, t].sum()

    grad = jax.grad(logit_sum_at)(params["embed_tokens"], 2)
    later = np.asarray(ids[0, 3:])
    earlier = np.asarray(ids[0, :3])
    assert np.all(np.asarray(grad)[later] == 0)
    assert np.any(np.asarray(grad)[earlier] != 0)


def test_bfloat16_close_to_float32(params):
    ids = np.random.RandomState(6).randint(0, CFG.vocab_size, (1, 12))
    cfg16 = CFG.replace(dtype="bfloat16")
    p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    out16, _ = M.forward_jit(p16, M.new_cache(cfg16, 1, 16), jnp.asarray(ids), jnp.zeros(1, jnp.int32), cfg=cfg16)
    assert out16.logits.dtype == jnp.float32 and out16.aux.dtype == jnp.bfloat16
    ref = _full(params, ids, 16).logits
    assert float(jnp.max(jnp.abs(out16.logits - ref))) < 0.05 * float(jnp.max(jnp.abs(ref)))


def _dot_products(jaxpr):
    """Every dot_general of ``jaxpr``, nested jaxprs (jit, custom rules) included."""
    from jax.extend import core as jcore

    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, jcore.ClosedJaxpr):
                    yield from _dot_products(sub.jaxpr)
                elif isinstance(sub, jcore.Jaxpr):
                    yield from _dot_products(sub)


@pytest.mark.parametrize("new_tokens", [1, 8])
def test_decode_and_verify_products_run_at_full_fp32_precision(new_tokens):
    """A GPU's default fp32 product is TF32 (a TPU's one bf16 pass): a decode step and a verify then round
    the same token differently and greedy choices can flip. Every product of an fp32 decode step and verify
    (attention, dense layers, a mixture of experts' dense dispatch, the LM head) asks for full precision."""
    from peagle_jax.models.config import MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=24, dispatch="dense", sparse_layers=(0,))
    cfg = dataclasses.replace(CFG, family="qwen3_moe", moe=moe)
    params = M.init_params(cfg, jax.random.key(0))

    def step(params, cache, tokens_BT, start_B):
        return M.forward(params, cache, tokens_BT, start_B, cfg=cfg)

    closed = jax.make_jaxpr(step)(
        params, M.new_cache(cfg, 1, 16), jnp.zeros((1, new_tokens), jnp.int32), jnp.zeros(1, jnp.int32)
    )
    products = list(_dot_products(closed.jaxpr))
    assert len(products) >= 2 * 6  # per layer: q, k, v, o, scores, probs @ V, and the MLP or experts
    for eqn in products:
        assert eqn.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2, eqn
