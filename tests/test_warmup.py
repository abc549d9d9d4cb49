"""Ahead-of-time compilation: after ``warmup`` for a request size, serving such a request compiles nothing
(plain and speculative, separate and fused graphs), across several attention windows."""

from __future__ import annotations

import itertools

import jax
import pytest

from peagle_jax.drafter import draft as D
from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.model import init_drafter_params
from peagle_jax.engine import generator as engine
from peagle_jax.models import model as M
from peagle_jax.models.config import ModelConfig
from peagle_jax.spec import verify as V
from peagle_jax.spec.generator import SpeculativeGenerator
from peagle_jax.spec.graphs import flush_context, fused_step, plain_step

CFG = ModelConfig(
    family="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
DCFG = DrafterConfig(layer=CFG.replace(num_layers=1, aux_layer_ids=(0,)), algorithm="peagle", mask_token_id=5)
GRAPHS = (
    M.prefill,
    engine.decode_step,
    engine.sample_jit,
    V.verify,
    D.parallel_draft,
    D.drafter_prefill,
    fused_step,
    plain_step,
    flush_context,
)


def sizes():
    return [g._cache_size() for g in GRAPHS]


@pytest.mark.parametrize("kind", ["plain", "speculative", "fused", "adaptive", "adaptive-fused"])
def test_nothing_compiles_after_warmup(kind):
    params = M.init_params(CFG, jax.random.key(0))
    if kind == "plain":
        gen = engine.Generator(CFG, params, max_seq_len=160)
    else:
        dparams = init_drafter_params(DCFG, jax.random.key(1))
        fused, adaptive = kind.endswith("fused"), kind.startswith("adaptive")
        chains = [1] if adaptive else None  # a chain of 1 too: its graphs are warmed up as well
        gen = SpeculativeGenerator(
            CFG, params, DCFG, dparams, k=3, fused=fused, adaptive=adaptive, chains=chains, max_seq_len=160
        )
    prompt, new = [1, 2, 3, 4, 5], 140  # the context crosses the 128-slot window bucket
    gen.warmup(1, len(prompt), new, greedy_only=True)
    if kind.startswith("adaptive"):  # every step length in every window, with flushes before drafts
        lengths = itertools.cycle([0, 0, 0, 0, 0, 1, 3])
        gen.policy.choose = lambda rows: next(lengths)
    before = sizes()
    (result,) = gen.generate([prompt], max_new_tokens=new, stop_token_ids=[])
    assert len(result.token_ids) == new
    assert sizes() == before


def test_window_buckets_change_the_graphs_not_the_outputs():
    """Fewer attention windows (serve --window-buckets): the steps attend over the whole cache, compile only
    its window's graphs after the warm-up, and emit what the default windows emit."""
    params = M.init_params(CFG, jax.random.key(0))
    dparams = init_drafter_params(DCFG, jax.random.key(1))
    prompt, new = [1, 2, 3, 4, 5], 140  # crosses the default 128-slot window

    def run(window_buckets):
        gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=160, window_buckets=window_buckets)
        gen.warmup(1, len(prompt), new, greedy_only=True)
        before = sizes()
        (result,) = gen.generate([prompt], max_new_tokens=new, stop_token_ids=[])
        assert sizes() == before
        return gen.window_buckets, result.token_ids

    windows, tokens = run(None)
    assert windows[0] == 128
    one_window, same = run(())
    assert one_window == (windows[-1],)
    assert same == tokens


def test_adaptive_warmup_times_every_step_length():
    """With the adaptive step length, the warm-up leaves a policy that already knows each step length's
    cost at the request's batch (after compiling), and nothing about acceptance."""
    params = M.init_params(CFG, jax.random.key(0))
    dparams = init_drafter_params(DCFG, jax.random.key(1))
    gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, adaptive=True, max_seq_len=160)
    gen.warmup(3, 5, 20, greedy_only=True)
    policy = gen.policy
    assert policy.steps == 0 and gen.spec.steps == 0 and not policy.tries.any()
    assert {key for key in policy.step_s} == {(4, 0), (4, 3)}  # batch 3 runs in the 4-row bucket
    assert all(policy._timed(4, k) for k in (0, 3))
    assert policy.choose(4) in (0, 3) and policy.steps == 1
    (result,) = gen.generate([[1, 2, 3, 4, 5]], max_new_tokens=20, stop_token_ids=[])
    assert len(result.token_ids) == 20
