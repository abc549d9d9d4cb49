"""The sampler's filters, checked against their definitions, its draws by distribution, and its no-filter
shortcut (with ``python -m peagle_jax.bench.sampling``)."""

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


def _sorted_reference(logits_BV, params: SamplingParams):
    """The sort-based filter this module used before the sort-free one (the definition, written with a
    sort over the vocabulary): kept here to check that the two filter identically."""
    V = logits_BV.shape[-1]
    temp_B1 = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    scaled_BV = logits_BV.astype(jnp.float32) / temp_B1
    sorted_BV = -jnp.sort(-scaled_BV, axis=-1)
    k_B = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, V), V)
    kth_B1 = jnp.take_along_axis(sorted_BV, (k_B - 1)[:, None], axis=-1)
    ranks_V = jnp.arange(V, dtype=jnp.int32)[None, :]
    sorted_BV = jnp.where(ranks_V < k_B[:, None], sorted_BV, -jnp.inf)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_BV = (before_BV < params.top_p[:, None]) | (ranks_V == 0)
    cutoff_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    threshold_B1 = jnp.maximum(kth_B1, cutoff_B1)
    return jnp.where(scaled_BV >= threshold_B1, scaled_BV, -jnp.inf)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("V", [7, 1000, 49152])
def test_sort_free_filter_equals_the_sorted_definition(ties, V):
    """Random logits (with many ties when ``ties``: integers, and -0.0 next to 0.0), random per-row
    temperature, top-k and top-p: the sort-free filter keeps exactly the tokens the sorted one keeps."""
    rng = np.random.RandomState(V + ties)
    B = 64
    if ties:
        logits = rng.randint(-3, 4, (B, V)).astype(np.float32)
        logits[:, : V // 3] *= -1  # -0.0 where 0
    else:
        logits = (rng.randn(B, V) * rng.uniform(0.5, 4, (B, 1))).astype(np.float32)
    temperature = rng.choice([0.0, 0.3, 1.0, 1.7], B)
    top_k = rng.choice([0, 1, 2, 5, 50, V - 1, V, V + 3], B)
    top_p = rng.choice([0.05, 0.3, 0.5, 0.9, 0.999], B)
    params = SamplingParams.make(B, temperature, top_k, top_p)
    new = np.asarray(jax.jit(processed_logits)(jnp.asarray(logits), params))
    ref = np.asarray(jax.jit(_sorted_reference)(jnp.asarray(logits), params))
    # Equal everywhere, except where a token's preceding mass equals top_p up to float32 rounding (the two
    # sum the same probabilities in different orders): there the float64 mass decides, and the sort-free
    # filter must agree with it.
    differ = np.argwhere(np.isfinite(new) != np.isfinite(ref))
    assert len(differ) <= 2, differ
    for b, v in differ:
        scaled = logits[b].astype(np.float64) / (temperature[b] if temperature[b] > 0 else 1.0)
        k = min(top_k[b], V) if top_k[b] > 0 else V
        top = np.sort(scaled)[::-1][:k]
        mass_before = np.exp(top[top > scaled[v]] - top[0]).sum() / np.exp(top - top[0]).sum()
        assert abs(mass_before - top_p[b]) < 1e-6, (b, v, mass_before, top_p[b])
        assert np.isfinite(new[b, v]) == (mass_before < top_p[b])
    same = np.isfinite(new) == np.isfinite(ref)
    np.testing.assert_array_equal(new[same], ref[same])


def test_top_p_one_keeps_all_that_top_k_kept():
    """``top_p = 1`` is off exactly, even where a float cumulative sum would reach 1 before the tail."""
    rng = np.random.RandomState(3)
    logits = jnp.asarray((rng.randn(8, 49152) * 6).astype(np.float32))
    for k in (0, 100):
        out = np.asarray(processed_logits(logits, SamplingParams.make(8, 1.0, k, 1.0)))
        assert (np.isfinite(out).sum(-1) == (49152 if k == 0 else k)).all()


def _batch_logits(B=6, V=300):
    """Logits with ties, -inf entries and a row of equal values."""
    x = np.random.RandomState(3).randint(-20, 20, (B, V)).astype(np.float32) / 4.0
    x[1, :50] = -np.inf
    x[2] = 1.5
    return jnp.asarray(x)


@pytest.mark.parametrize(
    "top_k,top_p",
    [
        ([0] * 6, [1.0] * 6),  # no row filters: the branch that skips the searches
        ([0, 0, 0, 5, 0, 0], [1.0] * 6),  # one row's top-k makes the whole batch search
        ([0] * 6, [1.0, 1.0, 0.9, 1.0, 1.0, 1.0]),
    ],
)
def test_the_no_filter_shortcut_changes_no_logit(top_k, top_p):
    """On the CPU a batch in which no row filters skips the searches (a lax.cond); every row's logits equal
    the branch-free graph's (what Neuron runs) bit for bit, whether or not another row filters."""
    from peagle_jax.platform import static_graphs

    logits = _batch_logits()
    temperature = [0.0, 0.7, 1.0, 1.3, 2.0, 1.0]
    params = SamplingParams(jnp.asarray(temperature), jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p))
    branching = jax.jit(processed_logits)
    text = branching.lower(logits, params).as_text()
    assert "stablehlo.case" in text
    got = np.asarray(branching(logits, params))
    with static_graphs():
        static = jax.jit(processed_logits)
        assert "stablehlo.case" not in static.lower(logits, params).as_text()
        want = np.asarray(static(logits, params))
    np.testing.assert_array_equal(got, want)
    if not any(top_k) and min(top_p) == 1.0:  # nothing filtered: every finite logit kept, only scaled
        temp = np.where(np.asarray(temperature) > 0, temperature, 1.0)[:, None]
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(np.asarray(logits)))
        np.testing.assert_allclose(got, np.asarray(logits) / temp, rtol=1e-6)  # XLA divides within 1 ulp


def test_bench_sampling_times_both_samplers(tmp_path, capsys):
    """``python -m peagle_jax.bench.sampling`` on a small vocabulary: each row count and top_p timed with
    and without the shortcut; bad flags are one error line."""
    import json

    from peagle_jax.bench import sampling as bench_sampling

    out = tmp_path / "sampling.json"
    argv = ["--rows", "1,3", "--vocab", "500", "--top-p", "1,0.5", "--rounds", "2", "--json", str(out)]
    assert bench_sampling.main(argv) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [(r["rows"], r["top_p"]) for r in result["results"]] == [(1, 1.0), (1, 0.5), (3, 1.0), (3, 0.5)]
    for r in result["results"]:
        assert set(r["ms"]) == {"branch-free", "branching"} and min(r["ms"].values()) > 0
        assert r["ratio"] == pytest.approx(r["ms"]["branching"] / r["ms"]["branch-free"])
    assert "| rows | top_p | branch-free | branching |" in table and "| 3 | 0.5 |" in table
    for bad in (["--rows", "0"], ["--top-p", "1.5"], ["--rows", "a"]):
        assert bench_sampling.main(bad) == 2
        assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize("temperature", [[0.0] * 6, [0.0, 0.7, 0.0, 1.0, 0.0, 0.0]])
def test_one_sampling_graph_serves_greedy_batches_where_graphs_branch(temperature):
    """On the CPU the sampling graph branches to the greedy path when no row samples, so the greedy-only
    graph is never compiled (``greedy_graph`` is false, ``greedy_modes`` one mode); a branch-free graph
    (Neuron) has both. Every row's token equals the branch-free sampling graph's, and an all-greedy batch
    gets the argmax."""
    from peagle_jax.platform import static_graphs
    from peagle_jax.sampling import greedy_graph, greedy_modes
    from peagle_jax.spec.verify import _node_choices

    logits = _batch_logits()
    params = SamplingParams.make(6, temperature, 0, 1.0)
    seeds, positions = jnp.arange(6, dtype=jnp.uint32), jnp.full(6, 9, jnp.int32)
    assert not greedy_graph(temperature) and greedy_modes() == (False,)
    branching = jax.jit(lambda x: sample(x, params, seeds, positions))
    assert "stablehlo.case" in branching.lower(logits).as_text()
    got = np.asarray(branching(logits))

    def choices(x):  # verify's per-node tokens, one node per row
        return np.asarray(jax.jit(lambda y: _node_choices(y, params, seeds, y.argmax(-1), False))(x[:, None]))

    nodes = choices(logits)
    with static_graphs():
        assert greedy_graph(temperature) == (max(temperature) == 0) and greedy_modes() == (True, False)
        static = jax.jit(lambda x: sample(x, params, seeds, positions))
        assert "stablehlo.case" not in static.lower(logits).as_text()
        want = np.asarray(static(logits))
        want_nodes = choices(logits)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(nodes, want_nodes)
    greedy = np.asarray(argmax_first(logits, axis=-1))
    rows = np.asarray(temperature) == 0
    np.testing.assert_array_equal(got[rows], greedy[rows])
    assert max(temperature) == 0 or not np.array_equal(got, greedy)  # a sampling row drew (seeded: it differs)
