"""Tree search from candidate ranks: the acceptance it computes without decoding equals what speculative
decoding measures, and the greedy growth finds the tree the ranks favour."""

from __future__ import annotations

import numpy as np
import pytest
from test_speculative import CFG, DCFG, PROMPTS, models  # noqa: F401  (a fixture)

from peagle_jax.bench import trees as T
from peagle_jax.engine.generator import Generator
from peagle_jax.errors import UserError
from peagle_jax.spec.generator import SpeculativeGenerator
from peagle_jax.spec.state import SpecStats
from peagle_jax.spec.tree import parse_tree


def test_paths_and_specs_round_trip():
    paths = T.paths_of("0,1,2,00,10,20,000")
    assert paths == {(0,), (1,), (2,), (0, 0), (1, 0), (2, 0), (0, 0, 0)}
    assert T.spec(paths) == "0,1,2,00,10,20,000"
    assert parse_tree(T.spec({(1,), (1, 3), (0,)})).size == 3


def test_a_tree_spells_its_own_spec():
    from peagle_jax.spec.tree import chain

    for spec in ("0", "0,00,000", "0,1,00,10", "0,1,2,3,4,00,01", "0,1,2,00,10,20,000"):
        assert parse_tree(spec).spec() == spec and set(parse_tree(spec).paths()) == T.paths_of(spec)
    assert parse_tree("10,1,0").spec() == "0,1,10"  # parents first, as parse_tree orders the nodes
    assert chain(3).spec() == "0,00,000" and chain(0).spec() == ""
    assert chain(7).describe() == "a chain of 7"
    assert parse_tree("0,1,2,3,4,00,01").describe() == "the tree 0,1,2,3,4,00,01 (7 drafts, 2 deep)"


def test_accepted_depth_is_the_deepest_matching_tree_path():
    W = 4  # rank 4 = not among the candidates
    ranks = np.array([[0, 0, 0], [1, 0, 2], [1, 1, 0], [4, 0, 0], [2, 0, 4], [0, 4, 0]])
    paths = T.paths_of("0,1,00,10,000")
    assert T.accepted_depths(ranks, paths, W).tolist() == [3, 2, 1, 0, 0, 1]
    assert T.accepted_depths(ranks, frozenset(), W).tolist() == [0] * 6


@pytest.mark.parametrize("tree", ["0,00,000", "0,1,00,10", "0,1,2,00,10,20,000", "1,10,100,2"])
def test_simulated_acceptance_equals_speculative_decoding(models, tree):  # noqa: F811
    """Random tiny target and drafter (accepted at every depth): greedy speculative decoding with the tree,
    and the simulation from the drafter's candidate ranks along plain decoding's answers, count the same
    target forwards, tokens and accepted drafts per depth."""
    params, dparams = models
    t, M, W = parse_tree(tree), 20, 5
    K = t.depth
    answers = Generator(CFG, params, max_seq_len=64).generate(PROMPTS, max_new_tokens=M + K, stop_token_ids=[])
    gen = SpeculativeGenerator(CFG, params, DCFG, dparams, tree=t, max_seq_len=64, adaptive=False)
    gen.spec = SpecStats(accepted_per_position=[0] * K)
    gen.generate(PROMPTS, max_new_tokens=M, stop_token_ids=[])
    paths = T.paths_of(tree)
    items = [
        (T.candidate_ranks(CFG, params, DCFG, dparams, p, a.token_ids, K=K, width=W), a.token_ids)
        for p, a in zip(PROMPTS, answers, strict=True)
    ]
    sim = T.tokens_per_step(items, paths, W, max_new_tokens=M)
    assert sim["target_forwards"] == gen.spec.target_forwards
    assert sim["acceptance_length"] == pytest.approx(gen.spec.acceptance_length, abs=1e-12)
    want = [a / gen.spec.target_forwards for a in gen.spec.accepted_per_position]
    assert sim["accepted_per_position"] == pytest.approx(want, abs=1e-12)
    assert min(gen.spec.accepted_per_position[:2]) > 0  # accepted at two depths: the comparison says something


@pytest.mark.parametrize("tree", ["0,00,000", "0,1,2,00,01,000"])
def test_simulated_acceptance_equals_sequential_eagle3_decoding(models, tree):  # noqa: F811
    """An EAGLE-3 drafter: ranks from its training-time-test passes along plain decoding's answers give what
    greedy sequential drafting with the tree accepts (forwards, tokens and accepted drafts per depth)."""
    params, dparams = models
    eagle3 = DCFG.replace(algorithm="eagle3")
    t, M, W = parse_tree(tree), 20, 5
    K = t.depth
    answers = Generator(CFG, params, max_seq_len=64).generate(PROMPTS, max_new_tokens=M + K, stop_token_ids=[])
    gen = SpeculativeGenerator(CFG, params, eagle3, dparams, tree=t, sequential=True, max_seq_len=64, adaptive=False)
    gen.spec = SpecStats(accepted_per_position=[0] * K)
    gen.generate(PROMPTS, max_new_tokens=M, stop_token_ids=[])
    ranks = [
        T.candidate_ranks(CFG, params, eagle3, dparams, p, a.token_ids, K=K, width=W)
        for p, a in zip(PROMPTS, answers, strict=True)
    ]
    parallel = [
        T.candidate_ranks(CFG, params, DCFG, dparams, p, a.token_ids, K=K, width=W)
        for p, a in zip(PROMPTS, answers, strict=True)
    ]
    assert any(not np.array_equal(r[:, 1:], q[:, 1:]) for r, q in zip(ranks, parallel, strict=True))  # other drafts
    items = [(r, a.token_ids) for r, a in zip(ranks, answers, strict=True)]
    sim = T.tokens_per_step(items, T.paths_of(tree), W, max_new_tokens=M)
    assert sim["target_forwards"] == gen.spec.target_forwards
    assert sim["acceptance_length"] == pytest.approx(gen.spec.acceptance_length, abs=1e-12)
    want = [a / gen.spec.target_forwards for a in gen.spec.accepted_per_position]
    assert sim["accepted_per_position"] == pytest.approx(want, abs=1e-12)
    assert min(gen.spec.accepted_per_position[:2]) > 0


def test_sequential_trees_hang_off_the_top_candidates():
    T.check_sequential_tree(T.paths_of("0,1,2,3,4,00,01"))
    T.check_sequential_tree(T.paths_of("0,00,000,0000,00000,000000,0000000"))
    with pytest.raises(UserError, match="tree node 10 hangs off"):
        T.check_sequential_tree(T.paths_of("0,1,10"))


def test_a_stop_token_ends_the_simulated_row():
    ranks = np.zeros((10, 2), np.int64)  # every draft accepted with a chain of 2: 3 tokens per step
    answer = [5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7]
    paths = T.paths_of("0,00")
    assert T.simulate(ranks, answer, paths, 4, max_new_tokens=10) == (3, 9, [3, 3])
    assert T.simulate(ranks, answer, paths, 4, max_new_tokens=10, stops=[8]) == (1, 3, [1, 1])  # 6, 7, 8
    assert T.simulate(ranks, answer, paths, 4, max_new_tokens=10, stops=[5]) == (0, 0, [0, 0])


def test_greedy_growth_follows_the_ranks():
    """The drafter's second candidate is right at depth 1 two times in three, its first at depth 2 after
    it: the best node is 1, then 10; a third node goes to the first candidate at depth 1."""
    rng = np.random.default_rng(0)
    n = 600
    d1 = np.where(rng.random(n) < 2 / 3, 1, 0)
    d2 = np.where(d1 == 1, 0, 3)
    ranks = np.stack([d1, d2, np.full(n, 5)], axis=1)
    answer = list(range(n + 3))
    grown = T.grow([(ranks, answer)], [1, 2, 3], K=3, width=5, max_new_tokens=n)
    assert grown[1] == {(1,)} and grown[2] == {(1,), (1, 0)} and grown[3] == {(1,), (1, 0), (0,)}


def test_dynamic_trees_take_the_most_probable_paths():
    """A confident drafter's tree goes deep, an unsure one's wide, for the same node budget."""
    sure = np.array([[0.6, 0.25, 0.15], [0.5, 0.3, 0.2], [0.9, 0.05, 0.05]])
    assert T.dynamic_paths(sure, 1) == {(0,)}
    assert T.dynamic_paths(sure, 3) == {(0,), (0, 0), (0, 0, 0)}  # .6, .3, .27 before (1,) at .25
    assert T.dynamic_paths(sure, 5) == {(0,), (0, 0), (0, 0, 0), (1,), (0, 1)}
    unsure = np.array([[0.3, 0.3, 0.3], [0.5, 0.3, 0.2], [0.9, 0.05, 0.05]])
    assert T.dynamic_paths(unsure, 3) == {(0,), (1,), (2,)}


def test_dynamic_trees_accept_what_the_tree_they_choose_accepts():
    """With the same probabilities at every root the dynamic tree is one static tree: both simulations agree,
    root by root and over whole answers."""
    rng = np.random.default_rng(1)
    N, K, W = 200, 3, 4
    ranks = rng.integers(0, W + 1, size=(N, K))
    probs_KW = np.sort(rng.dirichlet(np.ones(8), size=K)[:, :W], axis=1)[:, ::-1]
    probs = np.broadcast_to(probs_KW, (N, K, W))
    for budget in (1, 3, 7):
        paths = T.dynamic_paths(probs_KW, budget)
        assert len(paths) == budget
        assert T.dynamic_accepted_depths(ranks, probs, budget).tolist() == T.accepted_depths(ranks, paths, W).tolist()
        items, kw = [(ranks, list(range(N + K)))], {"max_new_tokens": N}
        assert T.dynamic_tokens_per_step(items, [probs], budget, **kw) == T.tokens_per_step(items, paths, W, **kw)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--width", "11"], "--width 11: must be 1..10"),
        (["--width", "4", "--trees", "0,1,5"], "uses a candidate rank >= --width 4"),
        (["--budgets", "0,3"], "--budgets '0,3'"),
        (["--budgets", "x"], "--budgets 'x'"),
        (["--trees", "0,11"], "path 11 has no parent path 1"),
    ],
)
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    assert T.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
