"""The slot engine: a request's output does not depend on what the other slots do (equal to the batch
generators' output for the same prompt, greedy and seeded sampling, plain and speculative), cancelled and
finished requests free their slot at once, and nothing compiles after the warm-up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peagle_jax.drafter import draft as D
from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.model import init_drafter_params
from peagle_jax.engine.generator import Generator, RequestError, decode_step, sample_jit
from peagle_jax.logprobs import first_logprobs
from peagle_jax.models import model as M
from peagle_jax.models.config import ModelConfig
from peagle_jax.serve import slots as S
from peagle_jax.serve import warmup as W
from peagle_jax.serve.slots import SlotEngine, SlotRequest, merge_roots, put_row
from peagle_jax.spec import stepper as SP
from peagle_jax.spec import verify as V
from peagle_jax.spec.adaptive import AdaptiveK
from peagle_jax.spec.generator import SpeculativeGenerator
from peagle_jax.spec.graphs import flush_context, fused_step, plain_step
from peagle_jax.spec.plan import StepKey

# A 6-token vocabulary and large weights, as in test_speculative: drafts are then accepted at every depth.
CFG = ModelConfig(
    family="llama",
    vocab_size=6,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    eos_token_ids=(5,),
)
DCFG = DrafterConfig(
    layer=CFG.replace(num_layers=1, aux_layer_ids=(0,)), algorithm="peagle", mask_token_id=5, own_embedding=False
)
MAX_SEQ = 64
# (prompt, max_new_tokens, temperature, top_k, top_p, seed, stop ids)
REQUESTS = [
    ([1, 2, 3, 4, 1, 2, 3, 4, 0, 1, 2], 20, 0.0, 0, 1.0, 0, []),
    ([3, 4, 1], 9, 0.0, 0, 1.0, 0, []),
    ([0, 0, 1, 1, 2], 30, 0.9, 0, 1.0, 7, []),
    ([2] * 20, 14, 0.0, 0, 1.0, 0, [3]),
    ([4, 3], 25, 1.3, 3, 0.9, 11, []),
    ([1, 1, 1, 2, 2, 2, 3], 17, 0.0, 0, 1.0, 0, [5]),
    ([0, 4, 2, 1, 3], 40, 0.7, 0, 0.8, 3, []),
    ([3], 6, 0.0, 0, 1.0, 0, []),
]


def _scaled(tree, s):
    return jax.tree.map(lambda x: x * s if x.dtype == jnp.float32 and x.ndim > 1 else x, tree)


@pytest.fixture(scope="module")
def models():
    return _scaled(M.init_params(CFG, jax.random.key(1)), 30), _scaled(init_drafter_params(DCFG, jax.random.key(2)), 30)


def _reference(gen, r):
    prompt, n, t, k, p, seed, stops = r
    res = gen.generate([prompt], max_new_tokens=n, temperature=t, top_k=k, top_p=p, seed=seed, stop_token_ids=stops)
    return res[0].token_ids


def _run(engine, requests, arrive_every=2, cancel=None, logprobs=None):
    """Admit requests as slots free up (at most one new request every ``arrive_every`` steps), step until
    all end. ``cancel`` = (request index, after how many of its tokens). Returns tokens and finish reasons;
    ``logprobs`` (a list) gets each request's token log-probabilities (the events')."""
    reqs = [SlotRequest(p, n, t, k, tp, seed, stops) for p, n, t, k, tp, seed, stops in requests]
    out = {r.id: [] for r in reqs}
    lps = {r.id: [] for r in reqs}
    finish = {}
    waiting = list(reqs)
    step = 0
    while waiting or engine.active:
        admitted = []
        if waiting and engine.free and step % arrive_every == 0:
            admitted.append(engine.admit(waiting.pop(0)))
        for ev in admitted + engine.step():
            assert (ev.logprobs is None) == (not engine.logprobs)
            out[ev.request.id] += ev.tokens
            lps[ev.request.id] += ev.logprobs or []
            finish[ev.request.id] = ev.finish_reason
        if cancel is not None:
            target = reqs[cancel[0]]
            if target.id not in finish or finish[target.id] is None:
                if len(out[target.id]) >= cancel[1]:
                    assert engine.cancel(target.id).finish_reason == "cancelled"
                    finish[target.id] = "cancelled"
                    assert engine.cancel(target.id) is None
        step += 1
        assert step < 1000
    if logprobs is not None:
        logprobs += [lps[r.id] for r in reqs]
    return [out[r.id] for r in reqs], [finish[r.id] for r in reqs]


@pytest.mark.parametrize("max_batch", [1, 3])
def test_plain_slots_equal_generator(models, max_batch, monkeypatch):
    """Also covers the overlapped plain steps: most are launched on the unread tokens of the last, and
    requests admitted meanwhile feed their first token from the host (merge_roots)."""
    params, _ = models
    gen = Generator(CFG, params, max_seq_len=MAX_SEQ)
    engine = SlotEngine(gen, max_batch)
    merges = []
    monkeypatch.setattr(S, "merge_roots", lambda *a: merges.append(a) or merge_roots(*a))
    outs, finish = _run(engine, REQUESTS, cancel=(6, 4))
    for i, r in enumerate(REQUESTS):
        ref = _reference(gen, r)
        if i == 6:  # cancelled after 4 tokens: a prefix of its full output
            assert finish[i] == "cancelled" and outs[i] == ref[: len(outs[i])] and len(outs[i]) < len(ref)
            continue
        assert outs[i] == ref, i
        assert finish[i] == ("stop" if ref[-1] in (r[6] or ()) else "length")
    assert engine.active == 0 and engine.free == max_batch
    assert engine.overlapped > engine.steps_by_k[0] // 2 and (max_batch == 1 or merges)


@pytest.mark.parametrize("speculative", [False, True])
def test_the_choices_of_one_request_share_its_prefill(models, speculative, monkeypatch):
    """n = 3 choices of one prompt (a request group, other seeds) run one prefill; each equals the same
    request run alone with its seed. A group admitted while slots run out waits and still shares it."""
    params, dparams = models
    plain = Generator(CFG, params, max_seq_len=MAX_SEQ)
    gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=MAX_SEQ) if speculative else plain
    engine = SlotEngine(gen, 2)
    name = "prefill_both" if speculative else "prefill"
    calls = []
    real = getattr(type(gen), name)
    monkeypatch.setattr(type(gen), name, lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    prompt = [1, 2, 3, 4, 0, 1]
    group = [SlotRequest(prompt, 12, 0.9, 0, 1.0, 5 + j, [], group=77, group_size=3) for j in range(3)]
    out = {r.id: [] for r in group}
    waiting = list(group)
    while waiting or engine.active:
        if waiting and engine.free:
            ev = engine.admit(waiting.pop(0))
            out[ev.request.id] += ev.tokens
        for ev in engine.step():
            out[ev.request.id] += ev.tokens
    assert len(calls) == 1 and engine._group is None
    for j, r in enumerate(group):
        assert out[r.id] == _reference(plain, (prompt, 12, 0.9, 0, 1.0, 5 + j, [])), j


@pytest.mark.parametrize("adaptive", [False, True])
def test_outputs_do_not_change_while_graphs_come_online(models, adaptive):
    """A server's start: the engine compiled only the first tasks (admissions and, adaptive, the plain step at
    the smallest window); a shadow engine, on another thread, compiles the rest into the shared jit caches.
    Until then an adaptive engine's drafting steps run plain; a step whose graphs are missing (a plain one, or
    a drafting one where plain steps are not served) waits for them, asking the compiler to take them next,
    rather than compiling them on the engine's thread. Requests running across that moment equal plain
    decoding."""
    import threading
    import time

    params, dparams = models
    plain = Generator(CFG, params, max_seq_len=MAX_SEQ)
    gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=MAX_SEQ)
    engine = SlotEngine(gen, 4, adaptive=adaptive)
    tasks = engine.warmup_tasks()
    first, rest = W.first_tasks(tasks, gen.window_buckets[0])
    assert first and rest and len(first) + len(rest) == len(tasks)
    assert all(t.rows == 1 and not t.tree.depth for t in first if isinstance(t, StepKey))
    drafting = {t for t in rest if isinstance(t, StepKey) and t.tree.depth}
    assert drafting and all(t in tasks for t in drafting)
    engine.compiling.update(rest)
    engine.warmup(tasks=first, calibrate=False)
    queue = W.TaskQueue(rest)
    asked = []
    engine.on_missing = lambda task: asked.append(task) or queue.urgent(task)

    reqs = [SlotRequest(p, n, t, k, tp, seed, stops) for p, n, t, k, tp, seed, stops in REQUESTS]
    out = {r.id: [] for r in reqs}
    waiting, steps = list(reqs), 0

    def advance():
        nonlocal steps
        if waiting and engine.free and engine.admission_ready(waiting[0]):
            ev = engine.admit(waiting.pop(0))
            out[ev.request.id] += ev.tokens
        for ev in engine.step():
            out[ev.request.id] += ev.tokens
        if engine.waiting_for is not None:  # its graph compiles on the other thread
            time.sleep(0.005)
        else:
            steps += 1
        assert steps < 2000

    for _ in range(4):
        advance()
    assert set(engine.steps_by_k) <= {0}  # nothing drafts before its graphs are compiled
    shadow = engine.shadow()
    assert shadow.compiling is engine.compiling and shadow.gen.spec is not gen.spec
    compiler = threading.Thread(target=shadow.warmup, kwargs=dict(tasks=queue))
    compiler.start()
    while compiler.is_alive() and (waiting or engine.active):
        advance()
    compiler.join()
    assert not engine.compiling and asked  # the adaptive engine waits for plain steps only, the other drafts
    assert {t.tree.depth > 0 for t in asked if isinstance(t, StepKey)} == {not adaptive}
    if adaptive:
        engine.adopt_times(shadow.policy)
        advance()
        assert all(engine.policy._timed(r, k) for r in engine.row_buckets for k in (0, 3))
    waiting += [SlotRequest(p, n, t, k, tp, seed, stops) for p, n, t, k, tp, seed, stops in REQUESTS[:3]]
    out.update({r.id: [] for r in waiting})
    reqs += waiting
    while waiting or engine.active:
        advance()
    assert [out[r.id] for r in reqs] == [_reference(plain, r) for r in REQUESTS + REQUESTS[:3]]
    if not adaptive:
        assert engine.steps_by_k.get(3, 0) > 0  # the tree drafts once its graphs are in


@pytest.mark.parametrize("speculative", [False, True])
def test_synchronous_steps_equal_generators(models, speculative):
    """``overlap = False`` (``serve --sync-steps``): every step is read by the call that launched it, outputs
    unchanged."""
    params, dparams = models
    plain = Generator(CFG, params, max_seq_len=MAX_SEQ)
    gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=MAX_SEQ) if speculative else plain
    engine = SlotEngine(gen, 3, load_k=[(1, 0)] if speculative else ())
    engine.overlap = False
    outs, _ = _run(engine, REQUESTS, cancel=(6, 4))
    assert outs[:6] == [_reference(plain, r) for r in REQUESTS[:6]]
    assert engine.overlapped == 0 and engine.steps_by_k[0] > 0


@pytest.mark.parametrize(
    "k,tree,sequential,fused", [(3, None, False, False), (None, "0,1,00,10", False, True), (2, None, True, False)]
)
def test_speculative_slots_equal_generators(models, k, tree, sequential, fused):
    params, dparams = models
    plain = Generator(CFG, params, max_seq_len=MAX_SEQ)
    spec = SpeculativeGenerator(
        CFG,
        params,
        DCFG,
        dparams,
        k=k,
        tree=V.parse_tree(tree) if tree else None,
        sequential=sequential,
        fused=fused,
        max_seq_len=MAX_SEQ,
    )
    engine = SlotEngine(spec, 3)
    outs, _ = _run(engine, REQUESTS, arrive_every=1)
    for i, r in enumerate(REQUESTS):
        assert outs[i] == _reference(plain, r), i
        assert outs[i] == _reference(spec, r), i
    assert spec.spec.target_forwards > 0 and sum(spec.spec.accepted_per_position) > 0


@pytest.mark.parametrize("fused,sequential", [(False, False), (True, True)])
def test_smaller_k_under_load_equals_generators(models, fused, sequential):
    """With 2 busy slots steps draft 2 tokens, with 3 one; outputs stay those of plain decoding."""
    params, dparams = models
    plain = Generator(CFG, params, max_seq_len=MAX_SEQ)
    spec = SpeculativeGenerator(
        CFG, params, DCFG, dparams, k=3, fused=fused, sequential=sequential, max_seq_len=MAX_SEQ
    )
    engine = SlotEngine(spec, 3, load_k=[(3, 1), (2, 2)])
    assert engine.tree_for(1) is None and engine.tree_for(2).depth == 2 and engine.tree_for(3).depth == 1
    outs, _ = _run(engine, REQUESTS, arrive_every=1)
    for i, r in enumerate(REQUESTS):
        assert outs[i] == _reference(plain, r), i
    assert set(engine.steps_by_k) == {1, 2, 3}
    for bad in ([(2, 4)], [(0, 1)], [(2, -1)]):
        with pytest.raises(RequestError):
            SlotEngine(spec, 3, load_k=bad)
    with pytest.raises(RequestError):
        SlotEngine(plain, 3, load_k=[(2, 1)])
    with pytest.raises(RequestError):
        SlotEngine(plain, 3, adaptive=True)
    with pytest.raises(RequestError):
        SlotEngine(spec, 3, load_k=[(2, 1)], adaptive=True)


@pytest.mark.parametrize("fused,sequential", [(False, False), (True, True)])
def test_plain_steps_in_a_speculative_engine_equal_generators(models, fused, sequential):
    """K' = 0 (a plain step) under load, and every step length forced in turn (so that runs of more than
    K + 1 plain steps fill the draft context and make_room writes it): outputs stay those of plain decoding,
    greedy and sampled, and the drafter still accepts after the plain steps."""
    params, dparams = models
    plain = Generator(CFG, params, max_seq_len=MAX_SEQ)
    spec = SpeculativeGenerator(
        CFG, params, DCFG, dparams, k=3, fused=fused, sequential=sequential, max_seq_len=MAX_SEQ
    )
    engine = SlotEngine(spec, 3, load_k=[(2, 0)])
    assert engine.describe() == "speculative, a chain of 3 per step (plain steps from 2 active)"
    outs, _ = _run(engine, REQUESTS, arrive_every=1)
    refs = [_reference(plain, r) for r in REQUESTS]
    assert outs == refs
    assert engine.steps_by_k[0] > 0 and engine.steps_by_k[3] > 0 and engine.overlapped > 0
    assert spec.spec.plain_forwards > 0

    class Forced(SlotEngine):
        """Steps cycle through 6 plain steps, a chain of 1, 2 plain steps, the full chain."""

        pattern = [0] * 6 + [1, 0, 0, 3]

        def step(self, tree=None):
            k = self.pattern[sum(self.steps_by_k.values()) % len(self.pattern)]
            return super().step(V.chain(k) if k < 3 else spec.tree)

    spec.spec = type(spec.spec)(accepted_per_position=[0] * 3)
    engine = Forced(spec, 3)
    outs, _ = _run(engine, REQUESTS, arrive_every=1)
    assert outs == refs
    assert engine.steps_by_k[0] > 6 * engine.steps_by_k[3]
    assert spec.spec.accepted_per_position[0] > 0


def test_plain_steps_write_the_drafter_cache_a_draft_would(models):
    """The committed drafter-cache slots hold the same keys and values whether drafts wrote them (K = 3
    steps) or make_room did (plain steps only: a flush whenever the 16-slot queue is full; or 6 plain steps
    then a draft, which first flushes the 7 queued elements it cannot read): the drafter sees the same
    context after plain steps. Two rows admitted two steps apart, so that their queues fill at different
    steps."""
    params, dparams = models
    spec = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=MAX_SEQ)
    assert spec.Q == 16

    class Mixed(SlotEngine):
        def step(self, tree=None):
            return super().step(spec.tree if sum(self.steps_by_k.values()) % 7 == 6 else V.chain(0))

    engines = [SlotEngine(spec, 2, load_k=[(1, 0)]), Mixed(spec, 2), SlotEngine(spec, 2)]
    for engine in engines:
        engine.admit(SlotRequest([1, 2, 3, 4, 0], 40, stop_token_ids=[]))
        for _ in range(2):
            engine.step()
        engine.admit(SlotRequest([1, 3, 2], 40, stop_token_ids=[]))
        while engine.state.ctx_start[:2].min() < 25:
            engine.step()
    assert set(engines[0].steps_by_k) == {0} and set(engines[1].steps_by_k) == {0, 3}
    assert engines[0].overlapped > engines[0].steps_by_k[0] // 2  # plain steps overlap, except before a flush
    assert set(engines[2].steps_by_k) == {3}
    for b in range(2):
        committed = min(int(e.state.ctx_start[b]) for e in engines)
        rows = [jax.tree.map(lambda x, b=b, n=committed: np.asarray(x[b, :, :n]), e.drafter.cache) for e in engines]
        for other in rows[:2]:
            for x, y in zip(jax.tree.leaves(other), jax.tree.leaves(rows[2]), strict=True):
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-3)
                assert np.abs(x).max() > 1.0  # real keys and values, not an empty cache


class _Verdict(AdaptiveK):
    """A policy whose verdict the test sets: while ``drafting`` steps draft the whole tree (where a busy row
    is synced), else they are plain."""

    drafting = False

    def pays(self, rows):
        return self.drafting

    def choose(self, rows, synced=1.0):
        self.steps += 1
        return 3 if self.drafting and synced > 0 else 0


def test_lazy_drafter_under_load(models, monkeypatch):
    """Where drafting does not pay, requests are admitted without the drafter prefill and full context queues
    are dropped rather than flushed: no drafter work at all. Once it pays, each unsynced row with enough
    tokens left (resync_min_left) is re-seeded (one per step): its drafter cache then holds what a drafter kept
    current all along holds, its drafts are accepted again, and outputs stay those of plain decoding."""
    params, dparams = models
    plain = Generator(CFG, params, max_seq_len=96)
    spec = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=96)
    work = {"flush_context": 0, "drafter_prefill": 0}
    for name in work:
        real = getattr(SP, name)

        def counted(*a, name=name, real=real, **kw):
            work[name] += 1
            return real(*a, **kw)

        monkeypatch.setattr(SP, name, counted)
    # (prompt, max_new_tokens, temperature, seed): the last has fewer than resync_min_left (64) tokens left
    # when drafting pays again, so it is never re-seeded.
    requests = [([1, 2, 3, 4, 0], 90, 0.0, 0), ([1, 3, 2], 92, 0.8, 4), ([4, 4, 1, 0], 60, 0.0, 0)]
    runs = {}
    for lazy in (True, False):
        engine = SlotEngine(spec, 3, adaptive=True)
        engine.policy = _Verdict([0, 1, 3])
        reqs = [SlotRequest(p, n, t, seed=seed, stop_token_ids=[]) for p, n, t, seed in requests]
        out = {r.id: [] for r in reqs}
        for r in reqs:
            ev = engine.admit(r)
            out[r.id] += ev.tokens
        if lazy:
            assert engine.unsynced_admits == 3 and not engine.state.synced[:3].any()
            assert work == {"flush_context": 0, "drafter_prefill": 0}
        engine.policy.drafting = not lazy
        steps = 0
        while engine.state.ctx_start[:2].min() < 40:  # rows 0 and 1 still run when it ends
            if lazy and steps == 20:  # 20 plain steps read, 21 launched (queues filled and were dropped)
                assert work == {"flush_context": 0, "drafter_prefill": 0} and engine.steps_by_k == {0: 21}
                assert engine.overlapped >= 18 and (engine.state.ctx_count[:3] <= spec.Q).all()  # 21 elements queued
                engine.policy.drafting = True
            for ev in engine.step():
                out[ev.request.id] += ev.tokens
            steps += 1
            assert steps < 60
        runs[lazy] = engine, [out[r.id] for r in reqs]
    (engine, outs), (kept, kept_outs) = runs[True], runs[False]
    refs = [_reference(plain, (p, n, t, 0, 1.0, seed, [])) for p, n, t, seed in requests]
    for out, kept_out, ref in zip(outs, kept_outs, refs, strict=True):
        assert len(out) > 25 and out == ref[: len(out)] and kept_out == ref[: len(kept_out)]
    assert engine.resyncs == 2 and list(engine.state.synced[:3]) == [True, True, False]
    assert engine.steps_by_k[3] > 0 and spec.spec.accepted_per_position[0] > 0
    for b in range(2):  # the re-seeded rows' committed drafter context, against the engine that kept it
        n = int(min(engine.state.ctx_start[b], kept.state.ctx_start[b]))
        assert n >= 40
        for x, y in zip(jax.tree.leaves(engine.drafter.cache), jax.tree.leaves(kept.drafter.cache), strict=True):
            np.testing.assert_allclose(np.asarray(x[b, :, :n]), np.asarray(y[b, :, :n]), rtol=1e-4, atol=1e-3)


class _FixedTimes(AdaptiveK):
    """A policy that sees the same step time for each K' on every step (this machine's noise left out)."""

    SECONDS = {0: 1.0, 1: 1.1, 3: 1.15}

    def record(self, rows, k, seconds, counts=()):
        super().record(rows, k, None if seconds is None else self.SECONDS[k], counts)


def test_a_lazy_engine_still_measures_acceptance(models):
    """Unlucky first drafts put the acceptance estimate below break-even, so drafting does not pay and
    requests are admitted without the drafter (lazy). With no synced row, no step explores, so nothing would
    ever be learnt again: plain steps for the server's whole life (seen in a benchmark, where a server's
    first request was a raw completion its drafter guessed badly). When an exploration is due, an admission
    keeps its drafter current instead, and the exploration measures the acceptance on it."""
    params, dparams = models
    plain = Generator(CFG, params, max_seq_len=96)
    spec = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=96)
    engine = SlotEngine(spec, 1, adaptive=True)
    policy = engine.policy = _FixedTimes([0, 1, 3], decay=1.0)
    for k, t in _FixedTimes.SECONDS.items():
        policy.calibrate(1, k, [t] * 5)
    policy.tries[:], policy.accepts[:] = 24.0, 0.0  # 24 rejected first drafts: E(3) = 1.14 tokens per 1.15 s
    assert not policy.pays(1) and not policy.explore_due(1)
    requests = [([1, 2, 3, 4, 0], 60), ([1, 3, 2], 40)]
    first, second = (SlotRequest(p, n, stop_token_ids=[]) for p, n in requests)
    out = {first.id: engine.admit(first).tokens, second.id: []}
    assert engine.unsynced_admits == 1
    while engine.active:
        for ev in engine.step():
            out[ev.request.id] += ev.tokens
    assert engine.steps_by_k == {0: 59}  # no synced row: plain steps only, nothing explored
    assert policy.explore_due(1) and not policy.pays(1)
    out[second.id] += engine.admit(second).tokens
    assert engine.unsynced_admits == 1 and engine.state.synced[0]  # kept current for the exploration
    while engine.active:
        for ev in engine.step():
            out[ev.request.id] += ev.tokens
    assert engine.steps_by_k[3] >= 1 and policy.tries[0] > 24.0  # explored on the synced row, and learnt
    refs = [_reference(plain, (p, n, 0.0, 0, 1.0, 0, [])) for p, n in requests]
    assert [out[first.id], out[second.id]] == refs


def test_adaptive_k_equals_generators_and_measures(models):
    params, dparams = models
    plain = Generator(CFG, params, max_seq_len=MAX_SEQ)
    spec = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=MAX_SEQ)
    default = "speculative, each step drafts 0/3 deep (a plain step or a chain of 3)"
    assert SlotEngine(spec, 3, adaptive=True).describe().startswith(default)
    for bad in ([3], [0], [1, 4]):  # a chain the step length picks is shorter than the draft
        with pytest.raises(RequestError, match="chain length"):
            SlotEngine(spec, 3, adaptive=True, chains=bad)
    engine = SlotEngine(spec, 3, adaptive=True, chains=[1])
    described = "speculative, each step drafts 0/1/3 deep (a plain step, a chain of 1 or a chain of 3)"
    assert engine.describe().startswith(described)
    outs, _ = _run(engine, REQUESTS, arrive_every=1)
    assert outs == [_reference(plain, r) for r in REQUESTS]
    assert set(engine.steps_by_k) == {0, 1, 3}  # each candidate is timed before the policy chooses
    seen = engine.policy.snapshot()
    timed = {tuple(int(x) for x in key.split("x")) for key in seen["step_ms"]}  # (rows, K')
    buckets = {r for r, _ in timed}
    # The first row bucket times every candidate; the others at least the plain step (the rest is scaled).
    assert any({(r, 0), (r, 1), (r, 3)} <= timed for r in buckets) and all((r, 0) in timed for r in buckets)
    assert len(seen["acceptance"]) == 3
    # The policy's depth-1 acceptance estimate follows what the speculative steps accepted.
    measured = spec.spec.accepted_per_position[0] / spec.spec.target_forwards
    assert engine.policy.tries[0] > 0 and abs(engine.policy.acceptance()[0] - measured) < 0.15


def test_bad_requests_are_refused_and_leave_the_slots_alone(models):
    params, _ = models
    engine = SlotEngine(Generator(CFG, params, max_seq_len=MAX_SEQ), 2)
    for bad in (
        SlotRequest([], 4),
        SlotRequest([1] * 60, 10),
        SlotRequest([9], 4),
        SlotRequest([1], 0),
        SlotRequest([1], 4, temperature=-1.0),
        SlotRequest([1], 4, top_p=0.0),
    ):
        with pytest.raises(RequestError):
            engine.admit(bad)
    assert engine.active == 0
    with pytest.raises(RequestError):
        SlotEngine(engine.gen, 0)


def warm_engine_parts(models, speculative):
    """(generator, the jitted graphs its slot engine calls, load thresholds) for the no-compile tests."""
    params, dparams = models
    if speculative:
        gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=MAX_SEQ)
        graphs = (M.prefill, sample_jit, put_row, V.verify, D.parallel_draft, D.drafter_prefill, fused_step)
        return gen, graphs + (plain_step, flush_context, merge_roots), [(3, 2), (4, 0)]
    gen = Generator(CFG, params, max_seq_len=MAX_SEQ)
    return gen, (M.prefill, sample_jit, put_row, decode_step, merge_roots), []


@pytest.mark.parametrize("speculative,logprobs", [(False, False), (True, False), (False, True), (True, True)])
def test_no_compiles_after_warmup(models, speculative, logprobs):
    gen, graphs, load_k = warm_engine_parts(models, speculative)
    graphs += (first_logprobs,) if logprobs else ()
    engine = SlotEngine(gen, 4, load_k=load_k, logprobs=logprobs)
    assert engine.row_buckets == (1, 2, 4)
    assert [engine.rows_for(np.arange(4) == i) for i in range(4)] == [1, 2, 4, 4]
    calls = []
    engine.warmup(progress=lambda done, total: calls.append((done, total)))
    assert calls[-1][0] == calls[-1][1] and engine.active == 0
    before = [g._cache_size() for g in graphs]
    long = [([1, 2] * 20, 20, 0.0, 0, 1.0, 0, []), ([3] * 2, 61, 0.8, 2, 0.9, 5, [])]
    _run(engine, REQUESTS + long, arrive_every=1, cancel=(1, 2))
    assert [g._cache_size() for g in graphs] == before
    if speculative:
        assert set(engine.steps_by_k) == {0, 2, 3}


def test_no_compiles_after_warmup_adaptive(models):
    params, dparams = models
    gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=MAX_SEQ)
    graphs = (M.prefill, sample_jit, put_row, V.verify, D.parallel_draft, D.drafter_prefill, plain_step, merge_roots)
    engine = SlotEngine(gen, 4, adaptive=True, chains=[1])  # a chain of 1 too: its graphs are warmed up as well
    engine.warmup()
    policy = engine.policy
    assert policy.steps == 0 and engine.steps_by_k == {} and gen.spec.steps == 0
    # After compiling, the warm-up timed every step length at every row bucket (compile times dropped), so
    # the policy chooses among known costs from the first request; acceptance is left to the traffic.
    assert all(policy._timed(r, k) for r in engine.row_buckets for k in (0, 1, 3))
    assert all(policy.step_time(r, k) > 0 for r in engine.row_buckets for k in (0, 1, 3))
    assert not policy.tries.any()
    before = [g._cache_size() for g in graphs]
    long = [([1, 2] * 20, 20, 0.0, 0, 1.0, 0, []), ([3] * 2, 61, 0.8, 2, 0.9, 5, [])]
    _run(engine, REQUESTS + long, arrive_every=1, cancel=(1, 2))
    assert [g._cache_size() for g in graphs] == before


def _log_softmax64(params, seq):
    """float64 log-softmax of the plain target's logits after every prefix of ``seq``: [len(seq), V]."""
    out, _ = M.forward_jit(params, M.new_cache(CFG, 1, MAX_SEQ), jnp.asarray([seq]), jnp.zeros(1, jnp.int32), cfg=CFG)
    x = np.asarray(out.logits[0], np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("mode", ["plain", "chain", "tree", "adaptive"])
def test_logprobs_are_the_targets_with_and_without_speculation(models, mode):
    """With log-probabilities on, every emitted token (admission, plain and speculative steps) carries the
    float64 log-softmax of the plain target's logits at its prefix (1e-4; raw: before temperature, top-k and
    top-p), and the top ones, sorted; the tokens are still plain decoding's."""
    params, dparams = models
    plain = Generator(CFG, params, max_seq_len=MAX_SEQ)
    if mode == "plain":
        gen = Generator(CFG, params, max_seq_len=MAX_SEQ)
    else:
        tree = V.parse_tree("0,1,00,10") if mode == "tree" else None
        gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=None if tree else 3, tree=tree, max_seq_len=MAX_SEQ)
    engine = SlotEngine(gen, 3, logprobs=True, adaptive=mode == "adaptive")
    lps = []
    outs, _ = _run(engine, REQUESTS, arrive_every=1, logprobs=lps)
    for i, r in enumerate(REQUESTS):
        assert outs[i] == _reference(plain, r), i
        ref = _log_softmax64(params, r[0] + outs[i])[len(r[0]) - 1 : -1]
        assert len(lps[i]) == len(outs[i])
        for tok, (lp, top), row in zip(outs[i], lps[i], ref, strict=True):
            ids, values = [t for t, _ in top], np.array([v for _, v in top])
            np.testing.assert_allclose(lp, row[tok], atol=1e-4)
            np.testing.assert_allclose(values, row[ids], atol=1e-4)
            assert sorted(ids) == list(range(CFG.vocab_size)) and np.all(np.diff(values) <= 0)
            assert values[ids.index(tok)] == lp
    if mode != "plain":
        assert sum(gen.spec.accepted_per_position) > 0


@pytest.mark.parametrize("speculative", [False, True])
def test_echo_prompt_logprobs(models, speculative):
    """An echo admission's event carries the prompt's log-probabilities (every token after the first), from
    the prefill itself, across prefill chunks; the first token and the cache are those of a plain admission."""
    params, dparams = models
    kw = dict(max_seq_len=MAX_SEQ, prefill_buckets=(4, 8))  # a 19-token prompt: chunks of 8, 8 and 4
    gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, **kw) if speculative else Generator(CFG, params, **kw)
    engine = SlotEngine(gen, 2, logprobs=True)
    prompt = [1, 2, 3, 4, 0, 1, 2, 3, 4, 4, 3, 2, 1, 0, 0, 1, 2, 3, 4]
    ev = engine.admit(SlotRequest(prompt, 6, 0.8, 0, 1.0, 9, [], echo=True))
    assert ev.prompt_logprobs is not None and len(ev.prompt_logprobs) == len(prompt) - 1
    ref = _log_softmax64(params, prompt + ev.tokens)
    for tok, (lp, top), row in zip(prompt[1:], ev.prompt_logprobs, ref[: len(prompt) - 1], strict=True):
        np.testing.assert_allclose(lp, row[tok], atol=1e-4)
        np.testing.assert_allclose([v for _, v in top], row[[t for t, _ in top]], atol=1e-4)
    np.testing.assert_allclose(ev.logprobs[0][0], ref[len(prompt) - 1][ev.tokens[0]], atol=1e-4)
    out = ev.tokens + [t for _ in range(20) for e in engine.step() for t in e.tokens]
    assert out == _reference(Generator(CFG, params, max_seq_len=MAX_SEQ), (prompt, 6, 0.8, 0, 1.0, 9, []))
    assert engine.admit(SlotRequest(prompt, 1, stop_token_ids=[])).prompt_logprobs is None  # no echo asked
