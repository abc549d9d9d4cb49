"""Training and inference agree: what the P-EAGLE objective trains the element (anchor a, depth d) to
predict is exactly what ``parallel_draft`` drafts at depth d + 1 when drafting from anchor a, for every
depth up to K, after the drafter's cache was filled with the context before a (as decoding fills it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from test_draft import CFG as DCFG

from peagle_jax.drafter.draft import DraftContext, drafter_prefill, fused_mask_hidden, parallel_draft, to_target_ids
from peagle_jax.drafter.model import init_drafter_params, new_drafter_cache
from peagle_jax.train.objective import PEagleBatch, element_logits


def test_training_elements_predict_what_parallel_draft_drafts():
    K, T = 6, 40
    rng = np.random.default_rng(0)
    params = init_drafter_params(DCFG, jax.random.key(0))
    params = jax.tree.map(lambda x: x * 8 if x.dtype == jnp.float32 and x.ndim > 1 else x, params)
    params["d2t"] = jnp.asarray(rng.integers(0, 57, DCFG.draft_vocab_size), jnp.int32)  # a reduced draft vocab
    X = DCFG.num_aux * DCFG.target_hidden_size
    tokens = jnp.asarray(rng.integers(0, 96, (1, T)), jnp.int32)
    aux = jnp.asarray(rng.standard_normal((1, T, X)), jnp.float32)
    anchors = [3, 11, 20, 30]
    anchor = np.concatenate([np.arange(T)] + [np.full(K - 1, a) for a in anchors])[None].astype(np.int32)
    depth = np.concatenate([np.zeros(T)] + [np.arange(1, K)] * len(anchors))[None].astype(np.int32)
    Y = anchor.shape[1]
    batch = PEagleBatch(
        tokens,
        aux,
        jnp.zeros((1, T, 32), jnp.float32),  # the target's states only enter the loss, not the logits
        jnp.ones((1, T), jnp.int32),
        jnp.zeros((1, T), jnp.int32),
        jnp.asarray(anchor),
        jnp.asarray(depth),
        jnp.ones((1, Y), bool),
    )
    train_logits, _ = element_logits(params, batch, cfg=DCFG, num_depths=K)
    mask_g = fused_mask_hidden(params, cfg=DCFG)
    for i, a in enumerate(anchors):
        rows = [a] + [T + i * (K - 1) + d for d in range(K - 1)]  # elements (a, 0), (a, 1), ..., (a, K - 1)
        want = jax.nn.log_softmax(train_logits[0, jnp.asarray(rows)], axis=-1)
        cache = new_drafter_cache(DCFG, 1, 64)
        cache = drafter_prefill(params, cache, tokens[:, :a], aux[:, :a], jnp.zeros(1, jnp.int32), cfg=DCFG)
        ctx = (tokens[:, a : a + 1], aux[:, a : a + 1], jnp.ones(1, jnp.int32), jnp.full(1, a, jnp.int32))
        draft, _ = parallel_draft(params, cache, DraftContext(*ctx), mask_g, cfg=DCFG, K=K, top_n=3)
        top_lp, top_ids = jax.lax.top_k(want, 3)
        np.testing.assert_array_equal(np.asarray(draft.tokens[0]), np.asarray(to_target_ids(params, top_ids, DCFG)))
        np.testing.assert_allclose(np.asarray(draft.logprobs[0]), np.asarray(top_lp), rtol=1e-4, atol=1e-4)
        assert len(set(np.asarray(top_ids[:, 0]).tolist())) > 1  # the depths draft different tokens
