"""The sampler's filters, checked against their definitions, and its draws by distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from peagle_jax.ops import argmax_first
from peagle_jax.sampling import SamplingParams, processed_logits, sample, uniforms


def test_argmax_first_matches_numpy_including_ties():
    x = np.random.RandomState(0).randint(0, 5, (50, 33)).astype(np.float32)
    np.testing.assert_array_equal(argmax_first(jnp.asarray(x)), np.argmax(x, axis=-1))


def test_filters_follow_temperature_then_top_k_then_top_p():
    logits = jnp.asarray([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])

    def kept(t, k, p):
        return np.isfinite(np.asarray(processed_logits(logits, SamplingParams.make(1, t, k, p))))[0]

    assert kept(1.0, 3, 1.0).tolist() == [True, True, True, False, False, False]
    # top-p after top-k: renormalised over the 3 kept, probs ~ .665 .245 .090; 0.8 needs two tokens
    assert kept(1.0, 3, 0.8).tolist() == [True, True, False, False, False, False]
    # a high temperature flattens the distribution, so top-p 0.8 needs more tokens
    assert kept(10.0, 0, 0.8).sum() == 5
    assert kept(1.0, 0, 1.0).all()
    out = np.asarray(processed_logits(logits, SamplingParams.make(1, 2.0, 0, 1.0)))
    np.testing.assert_allclose(out, np.asarray(logits) / 2.0)


def test_greedy_rows_take_the_argmax():
    logits = jnp.asarray(np.random.RandomState(1).randn(4, 50).astype(np.float32))
    toks = sample(logits, SamplingParams.make(4, 0.0), jnp.arange(4, dtype=jnp.uint32), jnp.zeros(4, jnp.int32))
    np.testing.assert_array_equal(toks, np.argmax(np.asarray(logits), -1))


def test_draws_follow_the_filtered_distribution():
    """Chi-square: 4000 draws at temperature 0.7, top-k 4, top-p 0.9 against the analytic distribution."""
    logits = jnp.asarray([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5]])
    params = SamplingParams.make(1, 0.7, 4, 0.9)
    probs = np.asarray(jax.nn.softmax(processed_logits(logits, params)))[0]
    n = 4000
    draw = jax.jit(jax.vmap(lambda pos: sample(logits, params, jnp.full(1, 7, jnp.uint32), pos[None])[0]))
    toks = np.asarray(draw(jnp.arange(n, dtype=jnp.int32)))
    counts = np.bincount(toks, minlength=6)
    support = probs > 0
    assert counts[~support].sum() == 0
    p64 = probs[support].astype(np.float64)
    expected = p64 / p64.sum() * counts.sum()
    _, pvalue = stats.chisquare(counts[support], expected)
    assert pvalue > 1e-3


@pytest.mark.parametrize("t,k,p", [(-1.0, 0, 1.0), (1.0, -2, 1.0), (1.0, 0, 0.0), (1.0, 0, 1.5)])
def test_bad_sampling_args(t, k, p):
    from peagle_jax.sampling import check_sampling_args

    with pytest.raises(ValueError):
        check_sampling_args(t, k, p)


def test_uniforms_are_uniform_and_independent_of_the_batch():
    u = np.asarray(uniforms(jnp.arange(64, dtype=jnp.uint32), jnp.full(64, 5, jnp.int32), 1000))
    assert 0 < u.min() and u.max() < 1
    _, pvalue = stats.kstest(u.ravel(), "uniform")
    assert pvalue > 1e-3
    assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 0.01
    alone = np.asarray(uniforms(jnp.asarray([3], jnp.uint32), jnp.asarray([5], jnp.int32), 1000))
    np.testing.assert_array_equal(alone[0], u[3])
