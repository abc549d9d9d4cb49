"""Raw log-probabilities from the graphs that emit tokens: a plain decode step, the speculative verify (chain
and tree) and plain step, and the echo prefill all report a float64 log-softmax of the plain target's
logits at the emitted token's prefix (1e-4), whatever the sampling parameters; the top ones are sorted and
agree with the chosen token's; asking for them changes no token."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peagle_jax.engine.generator import decode_step
from peagle_jax.logprobs import TOP_LOGPROBS, prefill_logprobs
from peagle_jax.models import model as M
from peagle_jax.models.config import ModelConfig
from peagle_jax.sampling import SamplingParams
from peagle_jax.spec import verify as V
from peagle_jax.spec.graphs import plain_step

CFG = ModelConfig(
    family="llama",
    vocab_size=48,  # more than TOP_LOGPROBS: the top ones are a strict subset
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
PROMPT = [5, 17, 3, 40, 9, 22, 1]
S = 64


@pytest.fixture(scope="module")
def params():
    p = M.init_params(CFG, jax.random.key(3))
    return jax.tree.map(lambda x: x * 8 if x.dtype == jnp.float32 and x.ndim > 1 else x, p)


def reference(params, seq):
    """float64 log-softmax of the plain target's logits after every prefix of ``seq``: [len(seq), V]."""
    out, _ = M.forward_jit(params, M.new_cache(CFG, 1, S), jnp.asarray([seq]), jnp.zeros(1, jnp.int32), cfg=CFG)
    x = np.asarray(out.logits[0], np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def prefilled(params, prompt):
    cache = M.new_cache(CFG, 1, S)
    _, cache = M.forward_jit(params, cache, jnp.asarray([prompt]), jnp.zeros(1, jnp.int32), cfg=CFG)
    return cache


def check(lp_P, top_ids_PZ, top_lp_PZ, ref_PV, tokens_P):
    """Each position's token log-probability and top ones against the reference rows."""
    assert top_ids_PZ.shape[-1] == TOP_LOGPROBS
    for lp, ids, tops, ref, tok in zip(lp_P, top_ids_PZ, top_lp_PZ, ref_PV, tokens_P, strict=True):
        np.testing.assert_allclose(lp, ref[tok], atol=1e-4)
        np.testing.assert_allclose(tops, ref[ids], atol=1e-4)
        assert np.all(np.diff(tops) <= 0)
        assert len(set(ids.tolist())) == len(ids)
        np.testing.assert_allclose(tops[0], ref.max(), atol=1e-4)  # the most likely token comes first
        if tok in ids:
            np.testing.assert_allclose(tops[ids.tolist().index(tok)], lp, atol=1e-6)
        else:
            assert lp <= tops[-1] + 1e-6


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_decode_step(params, temperature):
    """Plain decoding: the sampled token's raw log-probability (before temperature and top-k)."""
    sp = SamplingParams.make(1, temperature, 5, 0.9)
    cache, seq = prefilled(params, PROMPT[:-1]), list(PROMPT)
    rows = []
    for _ in range(6):
        pos = jnp.asarray([len(seq) - 1], jnp.int32)
        tok, cache, lp = decode_step(
            params, cache, jnp.asarray(seq[-1:]), pos, jnp.asarray([7], jnp.uint32), sp,
            cfg=CFG, greedy_only=temperature == 0, window=S, logprobs=True,
        )  # fmt: skip
        rows.append((float(lp.logprob[0, 0]), np.asarray(lp.top_ids[0, 0]), np.asarray(lp.top_logprobs[0, 0])))
        seq.append(int(tok[0]))
    ref = reference(params, seq)[len(PROMPT) - 1 : -1]
    check(*(np.array(c) for c in zip(*rows, strict=True)), ref, seq[len(PROMPT) :])


def greedy_continuation(params, n):
    seq = list(PROMPT)
    for _ in range(n):
        seq.append(int(np.argmax(reference(params, seq)[-1])))
    return seq[len(PROMPT) :]


@pytest.mark.parametrize("tree", ["chain", "tree"])
def test_verify(params, tree):
    """Every emitted token of a verify (accepted drafts and the bonus) carries the plain target's
    log-probability at its prefix; the tokens equal those of the same verify without log-probabilities."""
    ref_tokens = greedy_continuation(params, 5)
    root, q = jnp.asarray([PROMPT[-1]]), jnp.asarray([len(PROMPT) - 1], jnp.int32)
    if tree == "chain":
        t, drafts = V.chain(3), [[[x] for x in ref_tokens[:3]]]
    else:  # the true token is candidate 1 at depth 1, candidate 0 at depth 2
        wrong = (ref_tokens[0] + 1) % CFG.vocab_size
        t, drafts = V.parse_tree("0,1,00,10"), [[[wrong, ref_tokens[0]], [ref_tokens[1], wrong]]]
    args = (root, jnp.asarray(drafts, jnp.int32), q, jnp.zeros(1, jnp.uint32), SamplingParams.make(1))
    kw = dict(cfg=CFG, tree=t, window=S, greedy_only=True)
    out, _ = V.verify(params, prefilled(params, PROMPT[:-1]), *args, **kw, logprobs=True)
    plain, _ = V.verify(params, prefilled(params, PROMPT[:-1]), *args, **kw)
    assert plain.logprobs is None
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    n = int(out.count[0])
    assert n == t.depth + 1 and out.tokens[0, :n].tolist() == ref_tokens[:n]
    lp = out.logprobs
    ref = reference(params, PROMPT + ref_tokens[:n])[len(PROMPT) - 1 : -1]
    check(np.asarray(lp.logprob[0, :n]), np.asarray(lp.top_ids[0, :n]), np.asarray(lp.top_logprobs[0, :n]), ref,
          ref_tokens[:n])  # fmt: skip


def test_speculative_plain_step(params):
    """The plain step inside speculative decoding (verify of chain(0)) reports the same as a decode step."""
    X = len(CFG.aux_layer_ids) * CFG.hidden_size
    sp = SamplingParams.make(1, 0.8)
    tok, _, _, lp = plain_step(
        params, prefilled(params, PROMPT[:-1]), jnp.zeros((1, 4, X)), jnp.asarray(PROMPT[-1:]),
        jnp.asarray([len(PROMPT) - 1], jnp.int32), jnp.zeros(1, jnp.int32), jnp.ones(1, bool),
        jnp.asarray([11], jnp.uint32), sp, cfg=CFG, window=S, greedy_only=False, logprobs=True,
    )  # fmt: skip
    ref = reference(params, PROMPT)[-1:]
    check(np.asarray(lp.logprob[0]), np.asarray(lp.top_ids[0]), np.asarray(lp.top_logprobs[0]), ref, [int(tok[0])])


def test_prefill_echo(params):
    """A prompt prefilled in two chunks: every prompt token after the first gets its log-probability."""
    prompt = PROMPT + [30, 2, 14]
    cache, got = M.new_cache(CFG, 1, S), []
    for start, T in ((0, 6), (6, 4)):
        piece = prompt[start : start + T]
        after = prompt[start + T] if start + T < len(prompt) else 0
        out, lp, cache = prefill_logprobs(
            params, cache, jnp.asarray([piece]), jnp.asarray([len(piece)]), jnp.asarray([start], jnp.int32),
            jnp.asarray([after]), cfg=CFG, window=S,
        )  # fmt: skip
        got.append(jax.tree.map(lambda x: np.asarray(x[0]), lp))
    lps = [np.concatenate(parts) for parts in zip(*got, strict=True)]
    ref = reference(params, prompt)
    check(lps[0][:-1], lps[1][:-1], lps[2][:-1], ref[:-1], prompt[1:])
    np.testing.assert_allclose(out.logits[0], np.asarray(M.forward_jit(
        params, M.new_cache(CFG, 1, S), jnp.asarray([prompt]), jnp.zeros(1, jnp.int32), cfg=CFG)[0].logits[0, -1]),
        atol=1e-4)  # fmt: skip
