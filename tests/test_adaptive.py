"""The adaptive draft length: it picks the K' with the most expected tokens per second from what it measured."""

from __future__ import annotations

import numpy as np
import pytest

from peagle_jax.spec.adaptive import AdaptiveK


def _drive(policy, rows, step_s, accept, steps, rng):
    """Run ``steps`` steps: a step of K' costs ``step_s[K']``; each depth is accepted with rate ``accept``."""
    chosen = []
    for _ in range(steps):
        k = policy.choose(rows)
        counts = []
        for _ in range(rows):
            c = 1
            while c <= k and rng.random() < accept:
                c += 1
            counts.append(c)
        policy.record(rows, k, step_s[k], counts)
        chosen.append(k)
    return chosen


@pytest.mark.parametrize(
    "step_s,accept,best",
    [
        ({0: 1.0, 1: 2.0, 3: 2.6}, 0.3, 0),  # a CPU: a verify costs 2-2.6 plain steps, little is accepted
        ({0: 1.0, 1: 1.1, 3: 1.3}, 0.8, 3),  # an accelerator: a verify costs about a plain step
        ({0: 1.0, 1: 1.2, 3: 2.5}, 0.5, 1),  # only the short chain pays
    ],
)
def test_adaptive_k_picks_the_fastest_step_length(step_s, accept, best):
    policy = AdaptiveK([0, 1, 3], explore_every=16)
    chosen = _drive(policy, 4, step_s, accept, 1200, np.random.default_rng(0))
    tail = chosen[100:]
    assert max(set(tail), key=tail.count) == best
    if best == 3:
        # Every other step drafts K = 3; the plain step is re-timed once per 64 steps.
        assert all(k in (0, 3) for k in tail)
        plain_at = [i for i, k in enumerate(tail) if k == 0]
        assert len(tail) // 64 - 1 <= len(plain_at) <= len(tail) // 64 + 1
        assert min(np.diff(plain_at)) >= 63
    else:
        # The longest K' keeps being measured (so the estimate stays current): first after 16 steps times
        # how much slower it is, then twice as long after each exploration that changed nothing, up to 16 x 16.
        at = [i for i, k in enumerate(chosen) if k == 3][policy.min_samples + 1 :]  # the explorations
        gaps = np.diff(at)
        assert len(gaps) >= 5 and gaps.max() <= 16 * 16 + 1 and gaps[-1] >= 16 * 16 - 1
        assert all(b >= min(1.6 * a, 16 * 16 - 1) for a, b in zip(gaps[:-1], gaps[1:], strict=True))
        assert sum(k == 3 for k in chosen[-512:]) <= 3  # ~0.4% of the steps once backed off
    assert abs(policy.acceptance()[0] - accept) < 0.1


def test_exploring_backs_off_and_starts_over_when_drafting_pays():
    """After a long run where drafting lost (explorations backed off to every 256 steps), the traffic turns
    predictable and a verify cheap: the next exploration sees it, and the policy drafts from then on."""
    policy, rng = AdaptiveK([0, 1, 3], explore_every=16), np.random.default_rng(1)
    _drive(policy, 4, {0: 1.0, 1: 2.0, 3: 2.6}, 0.2, 800, rng)
    assert policy.backoff >= 4
    chosen = _drive(policy, 4, {0: 1.0, 1: 1.1, 3: 1.3}, 0.95, 800, rng)
    first = chosen.index(3)  # within the backed-off interval; it narrows the gap, so the next ones come soon
    assert first <= 16 * 16 + 1 and policy.backoff == 0
    assert sum(k == 3 for k in chosen[first + 200 :]) >= 0.95 * len(chosen[first + 200 :])


def test_adaptive_k_times_every_candidate_and_drops_the_first_sample():
    policy = AdaptiveK([0, 2], explore_every=1000)
    first = []
    for _ in range(6):
        k = policy.choose(1)
        first.append(k)
        policy.record(1, k, 100.0 if policy.seen.get((1, k), 0) == 0 else 1.0 + k, [1])
    assert first == [0, 0, 0, 2, 2, 2]
    assert policy.step_s == {(1, 0): 1.0, (1, 2): 3.0}  # the 100 s compile dropped
    assert policy.snapshot()["step_ms"]["1x2"] == 3000.0


def test_a_new_row_bucket_times_the_plain_step_and_scales_the_others():
    """At 8 rows only the plain step is timed; K' = 2 is estimated from its cost relative to a plain step at
    the nearest bucket that timed both (3x at 4 rows, not 2x at 1 row), until it has its own times there."""
    policy = AdaptiveK([0, 2], explore_every=1000)
    for k in (0, 0, 0, 2, 2, 2):
        assert policy.choose(1) == k
        policy.record(1, k, {0: 1.0, 2: 2.0}[k], [1])
    for k in (0, 0, 0):  # 4 rows: K' = 2 is not tried, its time is scaled from 1 row (2x plain)
        assert policy.choose(4) == k
        policy.record(4, k, 2.0)
    assert policy.step_time(4, 2) == pytest.approx(4.0) and policy.choose(4) == 0
    for _ in range(3):  # e.g. exploring: now K' = 2 has its own times at 4 rows
        policy.record(4, 2, 6.0, [1])
    for _ in range(3):
        assert policy.choose(8) == 0
        policy.record(8, 0, 5.0)
    assert policy.step_time(8, 2) == pytest.approx(15.0) and policy.step_time(16, 2) is None
    assert policy.choose(8) == 0  # nothing accepted: 1 token per 5 s beats about 1.2 per 15 s
    for _ in range(3):
        policy.record(8, 2, 7.0, [3])
    assert policy.step_time(8, 2) == pytest.approx(7.0)  # its own times win once it has them


def test_acceptance_estimate_is_conditional_per_depth():
    policy = AdaptiveK([0, 3], decay=1.0)
    # 10 rows: 5 accept nothing, 3 accept depth 1 only, 2 accept all three drafts.
    policy.record(1, 3, 1.0, [1] * 5 + [2] * 3 + [4] * 2)
    np.testing.assert_allclose(policy.tries, [10, 5, 2])
    np.testing.assert_allclose(policy.accepts, [5, 2, 2])
    assert policy.expected_tokens(0) == 1.0
    p = policy.acceptance()
    assert policy.expected_tokens(3) == pytest.approx(1 + p[0] + p[0] * p[1] + p[0] * p[1] * p[2])
    with pytest.raises(ValueError):
        AdaptiveK([])


def test_adaptive_generator_stream_equals_plain_decoding():
    """``SpeculativeGenerator(adaptive=True)`` (what ``generate`` runs by default): greedy and sampled outputs
    of a batch equal plain decoding, while its steps mix plain steps and drafts."""
    import jax
    from test_serve_slots import CFG, DCFG, MAX_SEQ, _scaled

    from peagle_jax.drafter.model import init_drafter_params
    from peagle_jax.engine.generator import Generator
    from peagle_jax.models import model as M
    from peagle_jax.spec.generator import SpeculativeGenerator

    params = _scaled(M.init_params(CFG, jax.random.key(1)), 30)
    dparams = _scaled(init_drafter_params(DCFG, jax.random.key(2)), 30)
    prompts = [[1, 2, 3, 4, 1, 2], [3, 4, 1], [0, 0, 1, 1, 2, 4, 4]]
    plain = Generator(CFG, params, max_seq_len=MAX_SEQ)
    spec = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=MAX_SEQ, adaptive=True)
    for kw in (dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=4)):
        want = [r.token_ids for r in plain.generate(prompts, max_new_tokens=40, stop_token_ids=[], **kw)]
        got = [r.token_ids for r in spec.generate(prompts, max_new_tokens=40, stop_token_ids=[], **kw)]
        assert got == want
    assert spec.spec.plain_forwards > 0 and spec.spec.target_forwards > 0
    assert {k for (_, k) in spec.policy.seen} == {0, 3}  # a plain step or the draft (DEFAULT_CHAINS: none)


class _Scripted:
    """A stand-in policy that plays a fixed sequence of step lengths (then plain steps) and keeps what it
    was told."""

    def __init__(self, script):
        self.script, self.candidates, self.recorded = list(script), (0, 1, 3), []

    def choose(self, rows):
        return self.script.pop(0) if self.script else 0

    def record(self, rows, k, seconds, counts=()):
        self.recorded.append((k, seconds))


def test_plain_runs_overlap_the_host_and_keep_every_token():
    """Runs of plain steps launch the next step on the unread token of the last (as the plain engine does):
    outputs still equal plain decoding with stop tokens, rows finishing at different steps, drafts in
    between and the drafter's context flushed every 16 queued elements; each step's time is recorded."""
    import jax
    from test_serve_slots import CFG, DCFG, MAX_SEQ, _scaled

    from peagle_jax.drafter.model import init_drafter_params
    from peagle_jax.engine.generator import Generator
    from peagle_jax.models import model as M
    from peagle_jax.spec.generator import SpeculativeGenerator

    params = _scaled(M.init_params(CFG, jax.random.key(1)), 30)
    dparams = _scaled(init_drafter_params(DCFG, jax.random.key(2)), 30)
    prompts = [[1, 2, 3, 4, 1, 2], [3, 4, 1], [0, 0, 1, 1, 2, 4, 4]]
    plain = Generator(CFG, params, max_seq_len=MAX_SEQ)
    spec = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=MAX_SEQ, adaptive=True, chains=[1])
    overlapped = []
    launch = spec.launch_plain

    def spy(*args, root=None, **kw):
        overlapped.append(root is not None)
        return launch(*args, root=root, **kw)

    spec.launch_plain = spy
    script = [0] * 18 + [3, 0, 0, 1] + [0] * 5 + [3, 3]
    # Greedy with stop token 4: row 2 stops after 2 tokens, row 1 after 27, row 0 after 36 (of 6 ids).
    for kw in (dict(temperature=0.0, stop_token_ids=[4]), dict(temperature=0.9, top_p=0.9, seed=4)):
        kw = dict(stop_token_ids=[], max_new_tokens=45) | kw
        want = [r.token_ids for r in plain.generate(prompts, **kw)]
        spec.policy = _Scripted(script)
        got = [r.token_ids for r in spec.generate(prompts, **kw)]
        assert got == want
        assert [len(t) for t in got] == ([36, 27, 2] if kw["stop_token_ids"] else [45] * 3)
        assert [k for k, _ in spec.policy.recorded].count(3) == 3
        assert all(s > 0 for _, s in spec.policy.recorded)
    assert sum(overlapped) > len(overlapped) / 2  # most plain steps were launched before the last was read
    assert not all(overlapped)


def test_load_changes_do_not_restart_the_back_off():
    """A server's load moves between row buckets, where drafting loses by different margins (a speculative
    step costs more over a plain one at 16 rows than at 4). Moving to the bucket where it loses by less is
    not drafting catching up: the explorations keep backing off to every 16 x 16 steps."""
    policy, rng = AdaptiveK([0, 1, 3], explore_every=16), np.random.default_rng(2)
    costs = {16: {0: 1.0, 1: 1.8, 3: 2.9}, 4: {0: 1.0, 1: 1.35, 3: 1.8}}
    chosen = []
    for i in range(80):
        chosen += _drive(policy, (16, 4)[i % 2], costs[(16, 4)[i % 2]], 0.25, 50, rng)
    late = chosen[2000:]
    assert sum(k == 3 for k in late) <= len(late) / (16 * 16) + 2  # one exploration per 256 steps


def test_an_untimed_step_teaches_acceptance_only():
    """``record(..., seconds=None)`` (the server's step after an admission, whose interval holds a prefill):
    the acceptance counts are learnt, the step time and the timed-sample count are not."""
    policy = AdaptiveK([0, 3])
    for _ in range(3):
        policy.record(1, 3, 0.03, [4])
    before = (policy.step_s[(1, 3)], policy.seen[(1, 3)])
    tries, accepts = policy.tries[0], policy.accepts[0]
    policy.record(1, 3, None, [1, 1])  # two rows that reached depth 1 and rejected it
    assert (policy.step_s[(1, 3)], policy.seen[(1, 3)]) == before
    assert policy.tries[0] == pytest.approx(tries * 0.99 + 2) and policy.accepts[0] == pytest.approx(accepts * 0.99)


def test_a_stale_plain_time_is_re_timed_while_drafting():
    """The warm-up timed the plain step at 2 s (the machine was busy then), so drafting looked faster; plain
    steps really take 1 s and drafting loses (1.42 tokens per 1.6 s). While drafting, the policy re-times
    the plain step after 64 steps, takes its new time as is, and goes back to plain steps."""
    policy, rng = AdaptiveK([0, 1, 3], explore_every=16), np.random.default_rng(3)
    for k, s in ((0, 2.0), (1, 1.5), (3, 1.6)):  # the warm-up's calibration
        for _ in range(policy.min_samples + 1):
            policy.record(4, k, s)
    step_s = {0: 1.0, 1: 1.5, 3: 1.6}
    chosen = _drive(policy, 4, step_s, 0.3, 600, rng)
    assert chosen[0] != 0  # it drafts at first
    assert policy.step_s[(4, 0)] == pytest.approx(1.0, rel=0.05)
    first_plain = chosen.index(0)  # the first re-time: its time replaces the stale 2 s at once
    assert first_plain <= 65
    tail = chosen[first_plain:]
    assert tail.count(0) >= 0.97 * len(tail)  # plain from then on, but for the explorations of K = 3


def test_a_tree_timed_too_slow_in_the_warm_up_is_corrected_by_an_exploration():
    """The warm-up timed the tree at 2 s (a burst of noise), so a chain of 1 looked best; the tree really
    takes 1.25 s and is the fastest (1.67 tokens per step against 1.35 for the chain of 1 at 1.2 s). The
    first exploration, within 64 steps of the warm-up, is smoothed in (2 s -> 1.85 s); the next, 64+ steps
    after the tree last ran, replaces its time as is, and the policy drafts the tree from then on. Smoothed
    in at a fifth per exploration (1.73 s after two), the tree would have kept losing, with the
    explorations backing off, for hundreds of steps more."""
    policy = AdaptiveK([0, 1, 3], shared=False, decay=1.0)
    for k, s in ((0, [1.0] * 5), (1, [1.2] * 5), (3, [2.0] * 5)):
        policy.calibrate(1, k, s)
    for k, p in ((1, [0.35]), (3, [0.55, 0.2, 0.1])):  # acceptance known (counts that do not move)
        tries, accepts = policy._counts[policy._group(k)]
        tries[: len(p)], accepts[: len(p)] = 1e6, 1e6 * np.asarray(p)
    assert policy.expected_tokens(3) == pytest.approx(1.671, rel=1e-3)
    step_s, chosen, times = {0: 1.0, 1: 1.2, 3: 1.25}, [], []
    for _ in range(300):
        k = policy.choose(1)
        policy.record(1, k, step_s[k])
        chosen.append(k)
        times.append(policy.step_time(1, 3))
    explored = [i for i, k in enumerate(chosen) if k == 3]
    first, second = explored[:2]
    assert first < 64 and times[first] == pytest.approx(1.85)  # smoothed in
    assert second - first >= 64 and times[second] == pytest.approx(1.25)  # replaced
    assert chosen[:first].count(1) == first  # the chain of 1 before
    after = chosen[second:]  # the tree, but for the plain step's re-timing every 64 steps
    assert all(k in (0, 3) for k in after) and after.count(0) <= len(after) // 64 + 1


def test_explore_due_follows_the_exploration_interval_without_side_effects():
    """``explore_due`` says whether :meth:`choose` would explore now (a shorter K' winning, the backed-off
    interval passed), without counting a step or moving the schedule; never while the longest K' wins."""
    policy = AdaptiveK([0, 3], explore_every=16, decay=1.0)
    policy.calibrate(1, 0, [1.0] * 5)
    policy.calibrate(1, 3, [2.0] * 5)
    policy.tries[:], policy.accepts[:] = 10.0, 2.0  # drafting loses: E(3) ~ 1.25 tokens per 2 s
    assert not policy.explore_due(1)
    chosen = []
    while 3 not in chosen:
        state = (policy.steps, policy.explored, policy.backoff)
        due = policy.explore_due(1)
        assert (policy.steps, policy.explored, policy.backoff) == state  # no side effects
        chosen.append(policy.choose(1))
        assert due == (chosen[-1] == 3)  # due exactly when the next choice explores
    assert len(chosen) > 16 and not policy.explore_due(1)
    policy.tries[:], policy.accepts[:] = 10.0, 9.0  # drafting wins: nothing to explore
    assert policy.pays(1) and not policy.explore_due(1)


def test_drafting_must_win_by_the_margin():
    """Drafting expected 3% faster than plain steps: within the margin (5%), so plain steps are chosen; 10%
    faster: it drafts."""
    for ratio, want in ((1.03, 0), (1.10, 3)):
        policy = AdaptiveK([0, 3], explore_every=10**6, decay=1.0)
        for _ in range(policy.min_samples + 1):
            policy.record(1, 0, 1.0)
            policy.record(1, 3, 1.0, [1])  # one row accepting nothing ...
        policy.tries[:], policy.accepts[:] = 1e6, 0.0
        policy.tries[0], policy.accepts[0] = 1e6, 1e6 * (ratio - 1)  # ... then p1 = ratio - 1, deeper nothing
        policy.accepts[1:] = 0.0
        assert policy.expected_tokens(3) == pytest.approx(ratio, rel=1e-3)
        assert policy.choose(1) == want


def test_a_tree_keeps_its_own_acceptance():
    """A tree with three candidates at depth 1 is accepted there 44% of the time, a chain of 1 27%. With
    acceptance shared between the candidates (right for chains, whose depth d does not depend on K'), the
    chain-of-1 steps drag the tree's estimate down and the policy settles on them; a tree's own counts
    (``adaptive_policy`` of a tree: ``shared=False``) find that the tree emits the most per second."""
    from peagle_jax.spec.adaptive import adaptive_policy
    from peagle_jax.spec.tree import chain, parse_tree

    step_s = {0: 1.0, 1: 1.15, 3: 1.25}
    rates = {1: [0.27], 3: [0.44, 0.12, 0.1]}

    def drive(policy, steps, rng):
        chosen = []
        for _ in range(steps):
            k = policy.choose(4)
            counts = []
            for _ in range(4):
                c = 1
                while c <= k and rng.random() < rates[k][c - 1]:
                    c += 1
                counts.append(c)
            policy.record(4, k, step_s[k], counts)
            chosen.append(k)
        return chosen

    assert adaptive_policy(chain(3)).shared and not adaptive_policy(parse_tree("0,1,2,00,10,20,000")).shared
    tail = drive(AdaptiveK([0, 1, 3], shared=False), 1500, np.random.default_rng(5))[500:]
    assert tail.count(3) >= 0.9 * len(tail)
    policy = AdaptiveK([0, 1, 3], shared=False)
    drive(policy, 500, np.random.default_rng(6))
    assert abs(policy.acceptance(3)[0] - 0.44) < 0.1 and abs(policy.acceptance(1)[0] - 0.27) < 0.15
    shared = drive(AdaptiveK([0, 1, 3]), 1500, np.random.default_rng(5))[500:]
    assert shared.count(3) < 0.5 * len(shared)  # what the shared estimate did


def test_only_synced_rows_count_towards_drafting():
    """``pays`` answers whether drafting beats plain steps with every drafter current (True while a time is
    unknown); ``choose`` scales the expected accepted tokens by the synced fraction of the rows: with a
    quarter of them synced a step that pays for all loses, and with none it runs plain steps without exploring."""
    policy = AdaptiveK([0, 3], explore_every=4, decay=1.0)
    assert policy.pays(4)
    for _ in range(policy.min_samples + 1):
        policy.record(4, 0, 1.0)
        policy.record(4, 3, 1.5, [1])
    policy.tries[:], policy.accepts[:] = 1e6, 0.8e6  # E(3) = 1 + .8 + .64 + .512 = 2.95 tokens in 1.5 plain steps
    assert policy.expected_tokens(3) == pytest.approx(2.952, rel=1e-3)
    assert policy.expected_tokens(3, synced=0.25) == pytest.approx(1.488, rel=1e-3)
    assert policy.pays(4) and policy.choose(4) == 3 and policy.choose(4, synced=0.5) == 3  # 1.98 / 1.5 > 1.05
    assert policy.choose(4, synced=0.25) == 0  # 1.49 / 1.5 < 1.05
    assert [policy.choose(4, synced=0.0) for _ in range(40)] == [0] * 40  # no explorations either
    assert policy.pays(4)  # the verdict for the rows' drafters kept current does not move
    policy.record(4, 3, 4.0, [1])
    for _ in range(20):
        policy.record(4, 3, 4.0)
    assert not policy.pays(4)  # 2.95 / 4 < 1.05 / 1


def test_calibration_takes_the_median_of_the_warm_up_steps():
    """A warm-up burst that slowed one of the tree's timed steps 3x does not make drafting look dearer: the
    calibrated time is the median of its steps (a single sample, as the first record after the dropped one,
    would have kept most of the burst), and later steps are smoothed into it as usual."""
    policy = AdaptiveK([0, 3], explore_every=10**6, decay=1.0)
    policy.calibrate(1, 0, [1.0, 1.02, 0.98, 1.01, 0.99])
    policy.calibrate(1, 3, [3.6, 1.2, 1.21, 1.19, 1.2])
    assert policy._timed(1, 3) and policy.step_time(1, 3) == pytest.approx(1.2)
    assert policy.step_time(1, 0) == pytest.approx(1.0)
    policy.record(1, 3, 2.2)  # a served step: smoothed in (weight 0.2), not replacing the median
    assert policy.step_time(1, 3) == pytest.approx(1.4)
    for _ in range(200):
        policy.record(1, 3, None, [2, 2, 1, 2])  # 3 of 4 rows accept the first draft
    assert policy.choose(1) == 3  # 1.75+ tokens per 1.4 s beats 1 per 1.0 s (with the margin)
    with pytest.raises(ValueError, match="at least one"):
        policy.calibrate(1, 0, [])


def test_no_exploration_where_even_full_acceptance_loses():
    """At 8 rows the tree (depth 2: at most 3 tokens per step) costs 3.6 plain steps, so it cannot win
    whatever is accepted: the policy never explores it there (nor asks for a synced admission), while at
    1 row, where it costs 1.3 plain steps, it keeps exploring it as before."""
    policy = AdaptiveK([0, 1, 2], shared=False, explore_every=16, decay=1.0)
    costs = {8: {0: 1.0, 1: 1.5, 2: 3.6}, 1: {0: 1.0, 1: 1.15, 2: 1.3}}
    for rows, times in costs.items():
        for k, s in times.items():
            policy.calibrate(rows, k, [s] * 5)
    for k in (1, 2):  # acceptance too low for drafting to pay at either load
        tries, accepts = policy._counts[policy._group(k)]
        tries[:k], accepts[:k] = 1e6, 1e5
    assert not policy._could_win(8, 1.05) and policy._could_win(1, 1.05)
    for rows, want in ((8, 0), (1, 5)):
        chosen, due = [], []
        for _ in range(600):
            due.append(policy.explore_due(rows))
            chosen.append(policy.choose(rows))
            policy.record(rows, chosen[-1], costs[rows][chosen[-1]], [1] if chosen[-1] else ())
        explored = chosen.count(2)
        assert explored == sum(due) and (explored == 0 if want == 0 else explored >= want), (rows, explored)
        assert set(chosen) <= {0, 2}


@pytest.mark.parametrize("prior_weight,settles_on_tree", [(8.0, True), (1.0, False)])
def test_an_unlucky_start_does_not_lock_the_tree_out(prior_weight, settles_on_tree):
    """The step times a serving benchmark's warm-up calibrated at one row (plain 30.6 ms, a chain of 1
    37.9 ms, the tree 36.9 ms); the tree is really accepted at depth 1 60% of the time (then 23%), a chain
    of 1 37%: the tree emits the most per second. Its first three steps are rejected (a short first request).
    With the prior worth 8 rows the tree keeps running and learns its real rate; worth one row (the former
    prior) its estimate fell so low that a chain of 1 and plain steps won for the rest of the run."""
    policy = AdaptiveK([0, 1, 2], shared=False, prior_weight=prior_weight)
    step_s = {0: 0.0306, 1: 0.0379, 2: 0.0369}
    for k, s in step_s.items():
        policy.calibrate(1, k, [s] * 5)
    rates, rng, chosen = {1: [0.37], 2: [0.6, 0.23]}, np.random.default_rng(7), []
    for _ in range(400):
        k = policy.choose(1)
        unlucky = k and sum(1 for j in chosen if j) < 3  # the first three drafted steps reject all
        c = 1
        while k and c <= k and not unlucky and rng.random() < rates[k][c - 1]:
            c += 1
        policy.record(1, k, step_s[k], [c] if k else ())
        chosen.append(k)
    assert chosen[0] == 2  # the prior: the tree first
    tail = chosen[100:]
    assert (tail.count(2) >= 0.8 * len(tail)) == settles_on_tree, {k: tail.count(k) for k in (0, 1, 2)}
