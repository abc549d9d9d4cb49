"""The plain generator: greedy equals a step-by-step reference, batches equal single rows, no recompiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peagle_jax.engine import generator as engine
from peagle_jax.engine.generator import Generator, RequestError
from peagle_jax.models import model as M
from peagle_jax.models.config import ModelConfig

CFG = ModelConfig(
    family="llama",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


@pytest.fixture(scope="module")
def params():
    # Larger weights than the init's so that greedy continuations are not one repeated token.
    return jax.tree.map(lambda x: x * 5 if x.ndim > 1 else x, M.init_params(CFG, jax.random.key(1)))


def _reference_greedy(params, prompt, n):
    """Recompute the whole sequence each step with an uncached forward: the simplest possible decoder."""
    toks = list(prompt)
    for _ in range(n):
        out, _ = M.forward_jit(params, M.new_cache(CFG, 1, 64), jnp.asarray([toks]), jnp.zeros(1, jnp.int32), cfg=CFG)
        toks.append(int(np.argmax(out.logits[0, -1])))
    return toks[len(prompt) :]


def test_greedy_matches_reference_with_mixed_lengths_and_chunked_prefill(params):
    gen = Generator(CFG, params, max_seq_len=64, prefill_buckets=(4, 8))
    prompts = [list(range(1, 12)), [5, 6, 7], [40, 41, 42, 43, 44]]  # 11 tokens: prefilled in chunks of 8
    results = gen.generate(prompts, max_new_tokens=10, stop_token_ids=[])
    for p, r in zip(prompts, results, strict=True):
        assert r.token_ids == _reference_greedy(params, p, 10)
        assert r.finish_reason == "length"


def test_max_seq_len_not_a_multiple_of_the_prefill_chunk(params):
    gen = Generator(CFG, params, max_seq_len=50, prefill_buckets=(8, 16))
    prompt = list(range(1, 41))  # chunks at 0, 16, 32; the last one padded to 16 slots past max_seq_len
    assert gen.generate([prompt], max_new_tokens=10, stop_token_ids=[])[0].token_ids == _reference_greedy(
        params, prompt, 10
    )


def test_batch_equals_single_rows_with_sampling(params):
    gen = Generator(CFG, params, max_seq_len=64)
    prompts = [[3, 4, 5, 6], [7, 8], [9, 10, 11]]
    kw = dict(
        max_new_tokens=8,
        temperature=[0.0, 0.9, 1.3],
        top_k=[0, 20, 0],
        top_p=[1.0, 0.9, 0.8],
        seed=[0, 1, 2],
        stop_token_ids=[],
    )
    batch = gen.generate(prompts, **kw)
    for i, p in enumerate(prompts):
        single = gen.generate(
            [p], **{k: (v[i] if isinstance(v, list) and k != "stop_token_ids" else v) for k, v in kw.items()}
        )
        assert single[0].token_ids == batch[i].token_ids


def test_stop_token_ends_only_its_row(params):
    gen = Generator(CFG, params, max_seq_len=64)
    free = gen.generate([[5, 6, 7], [40, 41]], max_new_tokens=6, stop_token_ids=[])
    stop = free[0].token_ids[2]
    res = gen.generate([[5, 6, 7], [40, 41]], max_new_tokens=6, stop_token_ids=[stop])
    assert res[0].token_ids == free[0].token_ids[: free[0].token_ids.index(stop) + 1]
    assert res[0].finish_reason == "stop"
    cut = free[1].token_ids.index(stop) + 1 if stop in free[1].token_ids else 6
    assert res[1].token_ids == free[1].token_ids[:cut]


def test_no_recompilation_within_a_bucket(params):
    gen = Generator(CFG, params, max_seq_len=64, prefill_buckets=(16, 32))
    gen.generate([[1, 2, 3]], max_new_tokens=3)  # warm: one prefill (bucket 16) and one decode graph
    prefills, decodes = M.prefill._cache_size(), engine.decode_step._cache_size()
    for n in (1, 5, 9, 16):
        gen.generate([list(range(1, n + 1))], max_new_tokens=4, temperature=0.0)
    assert M.prefill._cache_size() == prefills
    assert engine.decode_step._cache_size() == decodes
    gen.generate([list(range(1, 20))], max_new_tokens=2)  # bucket 32: exactly one new prefill graph
    assert M.prefill._cache_size() == prefills + 1
    assert engine.decode_step._cache_size() == decodes


@pytest.mark.parametrize(
    "prompts,kwargs,message",
    [
        ([[]], {"max_new_tokens": 4}, "empty"),
        ([[1] * 60], {"max_new_tokens": 10}, "max_seq_len"),
        ([[1, 500]], {"max_new_tokens": 4}, "outside the vocabulary"),
        ([[1]], {"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_requests_are_refused(params, prompts, kwargs, message):
    gen = Generator(CFG, params, max_seq_len=64)
    with pytest.raises(RequestError, match=message):
        gen.generate(prompts, **kwargs)


def test_a_one_row_cache_is_attended_whole_without_copies(params):
    """A decode step whose window is every slot of a one-row fp32 cache made XLA's CPU compiler copy each
    layer's K and V cache (engine.ONE_ROW_PAD). The generator's one-row fp32 caches have the pad, so the top
    window is a slice of them, and the compiled step copies no cache array; bf16 ones do not need it."""
    import re

    gen = Generator(CFG, params, max_seq_len=40)
    W = gen.window_buckets[-1]
    assert W == gen.num_slots and gen.cache_slots(2) == gen.num_slots

    def ops_on_the_cache(slots):
        text = (
            engine.decode_step.lower(
                params,
                M.new_cache(CFG, 1, slots),
                jnp.zeros(1, jnp.int32),
                jnp.full(1, 5, jnp.int32),
                jnp.zeros(1, jnp.uint32),
                engine.SamplingParams.make(1),
                cfg=CFG,
                greedy_only=True,
                window=W,
            )
            .compile()
            .as_text()
        )
        shape = rf"\[1,{CFG.num_kv_heads},{slots},{CFG.head_dim}\]"
        return re.findall(rf"= \w+{shape}\S* (\S+)\(", text)

    assert Generator(CFG.replace(dtype="bfloat16"), None, max_seq_len=40).cache_slots(1) == gen.num_slots
    assert "copy" in ops_on_the_cache(gen.num_slots)  # what the pad avoids
    assert gen.cache_slots(1) == gen.num_slots + engine.ONE_ROW_PAD
    assert "copy" not in ops_on_the_cache(gen.cache_slots(1))
