"""The draft graphs against the plain drafter forward: layout, feedback loop, cache invariant, compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.draft import (
    DraftContext,
    drafter_forward,
    fuse_aux,
    fused_mask_hidden,
    parallel_draft,
    sequential_draft,
    to_target_ids,
)
from peagle_jax.drafter.model import init_drafter_params, new_drafter_cache
from peagle_jax.models.config import ModelConfig

LAYER = ModelConfig(
    family="llama",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
CFG = DrafterConfig(
    layer=LAYER, algorithm="peagle", draft_vocab_size=40, target_hidden_size=24, mask_token_id=96, norm_before_fc=True
)
B, C, K = 3, 5, 4
A = CFG.num_aux * CFG.target_hidden_size


@pytest.fixture(scope="module")
def params():
    p = init_drafter_params(CFG, jax.random.key(0))
    p = jax.tree.map(lambda x: x * 4 if x.dtype == jnp.float32 and x.ndim > 1 else x, p)
    p["d2t"] = jnp.asarray(np.random.RandomState(1).randint(0, 57, 40), jnp.int32)  # ids map into 0..96
    return p


def _inputs(seed):
    rng = np.random.RandomState(seed)
    tokens = jnp.asarray(rng.randint(0, 96, (B, C)), jnp.int32)
    aux = jnp.asarray(rng.randn(B, C, A).astype(np.float32))
    return tokens, aux


def _fresh_draft(params, ctx: DraftContext, **kw):
    """A parallel draft from ``ctx`` over a cache holding only the 6-element prefix (:func:`_prefix`)."""
    mask_g = fused_mask_hidden(params, cfg=CFG)
    return parallel_draft(params, _prefix(params, new_drafter_cache(CFG, B, 32)), ctx, mask_g, cfg=CFG, K=K, **kw)[0]


def _prefix(params, cache, seed=9):
    """Commit 6 depth-0 elements per row at slots 0..5 (the drafter's prefill)."""
    rng = np.random.RandomState(seed)
    toks = jnp.asarray(rng.randint(0, 96, (B, 6)), jnp.int32)
    g = fuse_aux(params, jnp.asarray(rng.randn(B, 6, A).astype(np.float32)), cfg=CFG)
    _, cache = drafter_forward(params, cache, toks, g, jnp.zeros(B, jnp.int32), cfg=CFG)
    return cache


def test_parallel_draft_is_one_forward_over_context_then_mask_slots(params):
    tokens, aux = _inputs(0)
    count = jnp.array([1, 3, 5], jnp.int32)
    start = jnp.full(B, 6, jnp.int32)
    mask_g = fused_mask_hidden(params, cfg=CFG)
    draft = _fresh_draft(params, DraftContext(tokens, aux, count, start), top_n=3)
    g = fuse_aux(params, aux, cfg=CFG)
    for b in range(B):
        m = int(count[b])
        row_tokens = jnp.concatenate([tokens[b, :m], jnp.full(K - 1, CFG.mask_token_id, jnp.int32)])[None]
        row_g = jnp.concatenate([g[b, :m], jnp.broadcast_to(mask_g, (K - 1, mask_g.shape[0]))])[None]
        cache = _prefix(params, new_drafter_cache(CFG, B, 32))
        cache_b = jax.tree.map(lambda x, b=b: x[b : b + 1], cache)
        out, _ = drafter_forward(params, cache_b, row_tokens, row_g, start[b : b + 1], cfg=CFG)
        logp = jax.nn.log_softmax(out.logits[0, m - 1 : m - 1 + K], axis=-1)
        top = np.argsort(-np.asarray(logp), axis=-1, kind="stable")[:, :3]
        np.testing.assert_array_equal(draft.tokens[b], to_target_ids(params, jnp.asarray(top), CFG))
        np.testing.assert_allclose(draft.logprobs[b], np.take_along_axis(np.asarray(logp), top, -1), atol=1e-5)


def test_fused_mask_hidden_goes_through_the_aux_path(params):
    np.testing.assert_allclose(
        fused_mask_hidden(params, cfg=CFG), fuse_aux(params, params["mask_hidden"], cfg=CFG)[0, 0], atol=1e-6
    )


def test_sequential_draft_feeds_back_its_hidden_state_and_greedy_token(params):
    tokens, aux = _inputs(1)
    count = jnp.array([2, 5, 1], jnp.int32)
    start = jnp.full(B, 6, jnp.int32)
    draft, _ = sequential_draft(
        params, _prefix(params, new_drafter_cache(CFG, B, 32)), DraftContext(tokens, aux, count, start), cfg=CFG, K=K
    )
    g = fuse_aux(params, aux, cfg=CFG)
    for b in range(B):
        m = int(count[b])
        cache = jax.tree.map(lambda x, b=b: x[b : b + 1], _prefix(params, new_drafter_cache(CFG, B, 32)))
        out, cache = drafter_forward(params, cache, tokens[b : b + 1, :m], g[b : b + 1, :m], start[b : b + 1], cfg=CFG)
        logits, hidden = out.logits[0, -1], out.hidden[:, -1:]
        expected = []
        for k in range(K):
            tok = int(to_target_ids(params, jnp.argmax(logits)[None], CFG)[0])
            expected.append(tok)
            if k == K - 1:
                break
            out, cache = drafter_forward(params, cache, jnp.asarray([[tok]]), hidden, start[b : b + 1] + m + k, cfg=CFG)
            logits, hidden = out.logits[0, -1], out.hidden
        assert draft.tokens[b, :, 0].tolist() == expected


def test_placeholder_and_rejected_rows_are_never_visible_later(params):
    """Step 1 drafts from 3 context elements (writing 3 mask rows and padding past them); step 2 commits
    only 2 of them and continues. Its draft must equal the one from a cache that never saw step 1's
    placeholders: only the 8 committed elements."""
    tokens, aux = _inputs(2)
    mask_g = fused_mask_hidden(params, cfg=CFG)
    three = jnp.full(B, 3, jnp.int32)
    cache = _prefix(params, new_drafter_cache(CFG, B, 32))
    _, cache = parallel_draft(
        params, cache, DraftContext(tokens, aux, three, jnp.full(B, 6, jnp.int32)), mask_g, cfg=CFG, K=K
    )
    tokens2, aux2 = _inputs(3)
    two = jnp.full(B, 2, jnp.int32)
    # Step 2 re-feeds the accepted element 6, then element 7: it starts where step 1's real rows ended (6 + 1).
    after, _ = parallel_draft(
        params, cache, DraftContext(tokens2, aux2, two, jnp.full(B, 7, jnp.int32)), mask_g, cfg=CFG, K=K, top_n=2
    )
    clean = _prefix(params, new_drafter_cache(CFG, B, 32))
    _, clean = drafter_forward(
        params, clean, tokens[:, :1], fuse_aux(params, aux[:, :1], cfg=CFG), jnp.full(B, 6, jnp.int32), cfg=CFG
    )
    ref, _ = parallel_draft(
        params, clean, DraftContext(tokens2, aux2, two, jnp.full(B, 7, jnp.int32)), mask_g, cfg=CFG, K=K, top_n=2
    )
    np.testing.assert_array_equal(after.tokens, ref.tokens)
    np.testing.assert_allclose(after.logprobs, ref.logprobs, atol=1e-5)


def test_rows_are_independent(params):
    tokens, aux = _inputs(4)
    count = jnp.array([2, 4, 3], jnp.int32)
    start = jnp.array([6, 6, 6], jnp.int32)
    full = _fresh_draft(params, DraftContext(tokens, aux, count, start))
    other_tokens = tokens.at[0].set(5).at[2].set(7)
    other_aux = aux.at[0].set(0.5).at[2].set(-1.0)
    mixed = _fresh_draft(params, DraftContext(other_tokens, other_aux, jnp.array([5, 4, 1], jnp.int32), start))
    np.testing.assert_array_equal(full.tokens[1], mixed.tokens[1])


def test_each_draft_graph_compiles_once_across_accepted_counts(params):
    tokens, aux = _inputs(5)
    mask_g = fused_mask_hidden(params, cfg=CFG)
    cache = new_drafter_cache(CFG, B, 32)
    _, cache = parallel_draft(
        params,
        cache,
        DraftContext(tokens, aux, jnp.full(B, 1, jnp.int32), jnp.zeros(B, jnp.int32)),
        mask_g,
        cfg=CFG,
        K=K,
    )
    _, cache = sequential_draft(
        params, cache, DraftContext(tokens, aux, jnp.full(B, 1, jnp.int32), jnp.zeros(B, jnp.int32)), cfg=CFG, K=K
    )
    par, seq = parallel_draft._cache_size(), sequential_draft._cache_size()
    rng = np.random.RandomState(0)
    for _ in range(20):
        count = jnp.asarray(rng.randint(1, C + 1, B), jnp.int32)
        start = jnp.asarray(rng.randint(0, 20, B), jnp.int32)
        _, cache = parallel_draft(params, cache, DraftContext(tokens, aux, count, start), mask_g, cfg=CFG, K=K)
        _, cache = sequential_draft(params, cache, DraftContext(tokens, aux, count, start), cfg=CFG, K=K)
    assert parallel_draft._cache_size() == par and sequential_draft._cache_size() == seq


def test_parallel_draft_refuses_an_eagle3_drafter(params):
    cfg = CFG.replace(algorithm="eagle3", mask_token_id=None)
    with pytest.raises(ValueError, match="P-EAGLE"):
        parallel_draft(
            params,
            new_drafter_cache(cfg, B, 32),
            DraftContext(*_inputs(0), jnp.ones(B, jnp.int32), jnp.zeros(B, jnp.int32)),
            jnp.zeros(32),
            cfg=cfg,
            K=K,
        )
