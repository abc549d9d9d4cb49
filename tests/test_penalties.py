"""presence_penalty, frequency_penalty and logit_bias: the slot engine's plain decoding equals a host
reference (the target's logits after each prefix, adjusted on the host in numpy), speculative decoding
(chains, trees, fused, the adaptive step length) equals plain decoding token for token in batches mixing
penalized and free rows, greedy and seeded sampling; a tree node's logits are those of a plain step after
its path; rows without penalties are untouched; bad values are refused; nothing compiles after warm-up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_serve_slots import CFG, DCFG, MAX_SEQ, REQUESTS, _reference, _scaled, warm_engine_parts

from peagle_jax.drafter.model import init_drafter_params
from peagle_jax.engine.generator import Generator, RequestError, sample_jit
from peagle_jax.logit_rules import LogitRules, count_tokens, start_row, step_logits, tree_logits
from peagle_jax.models import model as M
from peagle_jax.sampling import SamplingParams
from peagle_jax.serve.slots import SlotEngine, SlotRequest
from peagle_jax.spec import verify as V
from peagle_jax.spec.generator import SpeculativeGenerator

# Penalized and free rows, greedy and sampled; the bias bans EOS (5) in one and favours a token in another.
PENALIZED = [
    dict(prompt=[1, 2, 3, 4, 1, 2], max_new_tokens=20, presence_penalty=1.5, frequency_penalty=0.5),
    dict(prompt=[3, 4, 1], max_new_tokens=15),
    dict(
        prompt=[0, 0, 1],
        max_new_tokens=25,
        temperature=0.9,
        seed=7,
        frequency_penalty=1.0,
        logit_bias={5: -100.0, 2: 3.0},
    ),  # fmt: skip
    dict(prompt=[2] * 10, max_new_tokens=18, logit_bias={1: 2.5}, presence_penalty=-1.0),
    dict(prompt=[4, 3], max_new_tokens=22, temperature=1.2, top_k=3, seed=3, presence_penalty=2.0),
    dict(prompt=[0, 4, 2, 1, 3], max_new_tokens=30, temperature=0.7, top_p=0.8, seed=3, frequency_penalty=-0.7),
]


@pytest.fixture(scope="module")
def models():
    return _scaled(M.init_params(CFG, jax.random.key(1)), 30), _scaled(init_drafter_params(DCFG, jax.random.key(2)), 30)


def _run(engine, requests):
    reqs = [SlotRequest(stop_token_ids=[], **r) for r in requests]
    out = {r.id: [] for r in reqs}
    waiting = list(reqs)
    while waiting or engine.active:
        events = [engine.admit(waiting.pop(0))] if waiting and engine.free else []
        for ev in events + engine.step():
            out[ev.request.id] += ev.tokens
    return [out[r.id] for r in reqs]


def _host_reference(params, r) -> list[int]:
    """Plain decoding with the penalties applied on the host: the target's logits after the whole prefix (one
    forward), adjusted in numpy float32, then the library's sampler on them (greedy: argmax)."""
    seq, out = list(r["prompt"]), []
    sampling = SamplingParams.make(1, r.get("temperature", 0.0), r.get("top_k", 0), r.get("top_p", 1.0))
    bias = np.zeros(CFG.vocab_size, np.float32)
    for tok, value in r.get("logit_bias", {}).items():
        bias[tok] = value
    presence, frequency = np.float32(r.get("presence_penalty", 0.0)), np.float32(r.get("frequency_penalty", 0.0))
    for _ in range(r["max_new_tokens"]):
        o, _ = M.forward_jit(params, M.new_cache(CFG, 1, MAX_SEQ), jnp.asarray([seq]), jnp.zeros(1, jnp.int32), cfg=CFG)
        counts = np.bincount(out, minlength=CFG.vocab_size).astype(np.float32)
        adjusted = (np.asarray(o.logits[0, -1], np.float32) + bias) - (presence * (counts > 0) + frequency * counts)
        seed = jnp.asarray([r.get("seed", 0)], jnp.uint32)
        position = jnp.asarray([len(seq)])
        tok = int(sample_jit(jnp.asarray(adjusted[None]), sampling, seed, position, greedy_only=False)[0])
        seq.append(tok)
        out.append(tok)
    return out


def test_plain_decoding_equals_the_host_reference(models):
    params, _ = models
    outs = _run(SlotEngine(Generator(CFG, params, max_seq_len=MAX_SEQ), 3, rules=True), PENALIZED)
    for i, r in enumerate(PENALIZED):
        assert outs[i] == _host_reference(params, r), i
    assert 5 not in outs[2] and outs[3] == [1] * 18  # the bias bans EOS; a negative presence repeats a favoured token
    # The penalties change outputs (against the same requests without them), and a free row is untouched.
    free = _run(SlotEngine(Generator(CFG, params, max_seq_len=MAX_SEQ), 3), [dict(prompt=r["prompt"],
        max_new_tokens=r["max_new_tokens"], **{k: r[k] for k in ("temperature", "top_k", "top_p", "seed") if k in r})
        for r in PENALIZED])  # fmt: skip
    assert all(outs[i] != free[i] for i in (0, 2, 3, 4, 5)) and outs[1] == free[1]


@pytest.mark.parametrize(
    "spec", [dict(k=3), dict(tree="0,1,00,10"), dict(tree="0,1,2,00,10,000", fused=True), dict(k=3, adaptive=True)]
)
def test_speculative_equals_plain_with_penalties(models, spec):
    params, dparams = models
    plain = _run(SlotEngine(Generator(CFG, params, max_seq_len=MAX_SEQ), 3, rules=True), PENALIZED)
    kw = dict(spec)
    tree, adaptive = kw.pop("tree", None), kw.pop("adaptive", False)
    gen = SpeculativeGenerator(
        CFG, params, DCFG, dparams, tree=V.parse_tree(tree) if tree else None, max_seq_len=MAX_SEQ, **kw
    )
    engine = SlotEngine(gen, 3, rules=True, adaptive=adaptive)
    assert _run(engine, PENALIZED) == plain
    assert sum(gen.spec.accepted_per_position) > 0
    # Requests without penalties on a penalties engine: the outputs of plain decoding without them.
    assert _run(engine, [dict(prompt=r[0], max_new_tokens=r[1]) for r in REQUESTS[:3]]) == [
        _reference(Generator(CFG, params, max_seq_len=MAX_SEQ), (*r[:2], 0.0, 0, 1.0, 0, [])) for r in REQUESTS[:3]
    ]


def test_a_tree_node_sees_the_counts_of_its_path():
    """tree_logits at every node equals step_logits with the committed counts plus the node's drafted path and
    the node's grammar mask; an inactive row (zero penalties and bias, no grammar) keeps its logits bit for
    bit."""
    tree = V.parse_tree("0,1,2,00,01,10,000,001,0000")
    B, T, Vocab = 3, tree.size + 1, 7
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(B, T, Vocab)), jnp.float32)
    tokens = rng.integers(0, 3, size=(B, T)).astype(np.int32)  # few distinct tokens: repeats on paths
    counts = rng.integers(0, 3, size=(B, Vocab)).astype(np.int32)
    bias = rng.normal(size=(B, Vocab)).astype(np.float32)
    bias[2] = 0
    allowed = np.full((B, T, 1), -1, np.int32)  # row 0 has a grammar: a random mask per node (token 0 allowed)
    allowed[0, :, 0] = rng.integers(0, 2**7, size=T) | 1
    pen = LogitRules(
        jnp.asarray([0.7, -1.3, 0.0]), jnp.asarray([0.4, 1.9, 0.0]), jnp.asarray([True, True, False]),
        jnp.asarray(bias), jnp.asarray(counts), jnp.asarray(allowed), jnp.asarray([True, False, False]),
        jnp.zeros((B, T - 1), jnp.int32),
    )  # fmt: skip
    got = np.asarray(jax.jit(tree_logits, static_argnums=2)(logits, jnp.asarray(tokens), tree, pen))
    bits = (allowed[0, :, 0][:, None] >> np.arange(Vocab)) & 1
    assert np.all(np.isneginf(got[0]) == (bits == 0))
    anc, depths = tree.ancestors(), (0, *tree.depths)
    for i in range(T):
        path = [int(anc[i, d]) for d in range(depths[i])]
        c = counts.copy()
        for b in range(B):
            for node in path:
                c[b, tokens[b, node]] += 1
        want = step_logits(
            logits[:, i], pen._replace(counts=jnp.asarray(c), allowed=jnp.asarray(allowed[:, i : i + 1]))
        )
        np.testing.assert_array_equal(got[:, i], np.asarray(want), err_msg=f"node {i}")
    np.testing.assert_array_equal(got[2], np.asarray(logits[2]))
    # A step where no row is active: the logits unchanged.
    off = pen._replace(active=jnp.zeros(B, bool), constrained=jnp.zeros(B, bool))
    np.testing.assert_array_equal(np.asarray(tree_logits(logits, jnp.asarray(tokens), tree, off)), np.asarray(logits))


def test_counts_and_row_starts():
    counts = jnp.zeros((3, 5), jnp.int32)
    counts = count_tokens(counts, np.array([[1, 1, 4], [2, 0, 0]], np.int32), np.array([3, 1], np.int32))
    np.testing.assert_array_equal(np.asarray(counts), [[0, 2, 0, 0, 1], [0, 0, 1, 0, 0], [0] * 5])
    counts, bias = start_row(counts, jnp.ones((3, 5)), jnp.int32(0), jnp.int32(3), np.full(5, 0.5, np.float32))
    np.testing.assert_array_equal(np.asarray(counts)[0], [0, 0, 0, 1, 0])
    np.testing.assert_array_equal(np.asarray(bias), [[0.5] * 5, [1] * 5, [1] * 5])


@pytest.mark.parametrize(
    "bad,message",
    [
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
        (dict(frequency_penalty=-3.0), "frequency_penalty must be in [-2, 2]"),
        (dict(logit_bias={6: 1.0}), "token id 6 is outside the vocabulary 0..5"),
        (dict(logit_bias={1: 101.0}), "token 1's bias must be in [-100, 100]"),
    ],
)
def test_bad_values_are_refused(models, bad, message):
    params, _ = models
    engine = SlotEngine(Generator(CFG, params, max_seq_len=MAX_SEQ), 2, rules=True)
    with pytest.raises(RequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        engine.admit(SlotRequest([1, 2], 3, **bad))
    assert engine.active == 0
    with pytest.raises(RequestError, match="takes no presence/frequency penalties"):
        SlotEngine(Generator(CFG, params, max_seq_len=MAX_SEQ), 2).admit(SlotRequest([1], 3, logit_bias={1: 1.0}))


@pytest.mark.parametrize("speculative", [False, True])
def test_no_compiles_after_warmup_with_penalties(models, speculative):
    gen, graphs, load_k = warm_engine_parts(models, speculative)
    graphs += (count_tokens, start_row)
    engine = SlotEngine(gen, 4, load_k=load_k, rules=True, logprobs=True)
    engine.warmup()
    before = [g._cache_size() for g in graphs]
    _run(engine, PENALIZED + [dict(prompt=[1, 2] * 20, max_new_tokens=20, logit_bias={3: 1.0})])
    assert [g._cache_size() for g in graphs] == before
