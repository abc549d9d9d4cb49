"""bf16 on the CPU: products stay in bf16 (XLA's bf16 kernel), the KV cache is written in place (stored as
its bits), and on the tiny models speculative decoding in bf16 reproduces plain bf16 decoding token for token."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_speculative import CFG, DCFG, PROMPTS, _scaled

from peagle_jax import ops
from peagle_jax.engine.generator import Generator, decode_step
from peagle_jax.models import cache as C
from peagle_jax.models import model as M
from peagle_jax.sampling import SamplingParams
from peagle_jax.spec import verify as V
from peagle_jax.spec.generator import SpeculativeGenerator


def _bf16(tree):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, tree)


@pytest.mark.parametrize("rows", [1, 3, 17, ops.SMALL_ROWS + 1])
@pytest.mark.parametrize("in_axes", [1, 2])
def test_bf16_linear_equals_float32_accumulation(rows, in_axes):
    rng = np.random.default_rng(rows)
    w_shape = (6, 16) if in_axes == 1 else (6, 4, 4)
    w = jnp.asarray(rng.standard_normal(w_shape, np.float32)).astype(jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((rows, *w_shape[1:]), np.float32)).astype(jnp.bfloat16)
    got = jax.jit(ops.linear, static_argnums=2)(w, x, in_axes)
    assert got.shape == (rows, 6) and got.dtype == jnp.bfloat16
    w64 = np.asarray(w.astype(jnp.float32), np.float64).reshape(6, -1)
    want = np.asarray(x.astype(jnp.float32), np.float64).reshape(rows, -1) @ w64.T
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=1e-2, atol=1e-2)
    f32 = ops.linear(w, x, in_axes, preferred_element_type=jnp.float32)
    assert f32.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(f32), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_bf16_products_do_not_convert_the_weights(rows):
    """Every small product multiplies the bf16 weight itself: no f32 copy of W is made per call (what XLA
    does for a 1-row bf16 product, or for ``W @ x^T``, which is why ``linear`` pads 1 row to 4)."""
    w = jnp.ones((96, 32), jnp.bfloat16)
    text = jax.jit(ops.linear).lower(w, jnp.ones((rows, 32), jnp.bfloat16)).compile().as_text()
    assert "f32[96,32]" not in text and "f32[32,96]" not in text, text


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (8192, 576)])
def test_a_rows_bf16_product_does_not_depend_on_the_other_rows(shape):
    """Bit for bit, with f32 outputs: a 1-token decode step and a verify of several tokens (or a step over
    more busy rows) compute the same products for the same row."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.float32).astype(jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((17, shape[1])), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(lambda w, x: ops.linear(w, x, preferred_element_type=jnp.float32))
    one = np.asarray(f(w, x[:1]))[0]
    for rows in (2, 4, 5, 8, 9, 16, 17):
        np.testing.assert_array_equal(np.asarray(f(w, x[:rows]))[0], one)


def test_bf16_cache_is_stored_as_bits_and_read_back_exactly():
    cache = C.KVCache.zeros(2, 2, 8, 2, 4, jnp.bfloat16)
    assert cache.k[0].dtype == jnp.uint16
    new = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 2, 4)), jnp.float32)
    out = C.write_rows(cache.k[0], new, jnp.asarray([0, 5]))
    assert out.dtype == jnp.uint16
    values = C.read(out)
    assert values.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(values[0, :, 0:3].transpose(1, 0, 2)), np.asarray(new[0].astype(jnp.bfloat16))
    )
    np.testing.assert_array_equal(
        np.asarray(values[1, :, 5:8].transpose(1, 0, 2)), np.asarray(new[1].astype(jnp.bfloat16))
    )
    assert not np.asarray(values[0, :, 3:]).any() and not np.asarray(values[1, :, :5]).any()
    # A training cache keeps bf16 values: gradients flow through it (an integer bitcast has none).
    grad_cache = C.KVCache.zeros(1, 1, 4, 2, 4, jnp.bfloat16, bits=False).k[0]
    assert grad_cache.dtype == jnp.bfloat16

    def total(new):
        return C.read(C.write_rows(grad_cache, new, jnp.asarray([0]))).astype(jnp.float32).sum()

    grad = jax.grad(total)(jnp.ones((1, 2, 2, 4), jnp.float32))
    np.testing.assert_array_equal(np.asarray(grad), np.ones((1, 2, 2, 4), np.float32))
    f32 = C.KVCache.zeros(1, 1, 4, 2, 4, jnp.float32)
    assert f32.k[0].dtype == jnp.float32 and C.read(f32.k[0]) is f32.k[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_step_writes_the_cache_in_place(dtype):
    """No cache-sized write in f32: on a bf16 cache XLA's CPU compiler would convert the whole cache to f32
    around each write, a pass over every layer's cache per step."""
    cfg = CFG.replace(dtype=dtype)
    params = M.init_params(cfg, jax.random.key(0))
    params = _bf16(params) if dtype == "bfloat16" else params
    S = 512
    cache = C.KVCache.zeros(cfg.num_layers, 1, S, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype)
    text = (
        decode_step.lower(
            params,
            cache,
            jnp.zeros(1, jnp.int32),
            jnp.zeros(1, jnp.int32),
            jnp.zeros(1, jnp.uint32),
            SamplingParams.make(1),
            cfg=cfg,
            greedy_only=True,
            window=128,
        )
        .compile()
        .as_text()
    )
    shape = rf"\[1,{cfg.num_kv_heads},{S},{cfg.head_dim}\]"
    writes = re.findall(rf"= (\w+){shape}\S* (?:dynamic-update-slice|scatter)\(", text)
    assert writes and set(writes) == {"u16" if dtype == "bfloat16" else "f32"}, writes


@pytest.fixture(scope="module")
def bf16_models():
    from peagle_jax.drafter.model import init_drafter_params

    params = _scaled(M.init_params(CFG, jax.random.key(1)), 30)
    dparams = _scaled(init_drafter_params(DCFG, jax.random.key(2)), 30)
    return _bf16(params), _bf16(dparams)


@pytest.mark.parametrize("kw", [dict(k=3), dict(tree="0,1,00,10,000"), dict(k=3, sequential=True)])
def test_bf16_speculative_equals_plain_greedy(bf16_models, kw):
    params, dparams = bf16_models
    cfg, dcfg = CFG.replace(dtype="bfloat16"), DCFG.replace(layer=DCFG.layer.replace(dtype="bfloat16"))
    plain = Generator(cfg, params, max_seq_len=64).generate(PROMPTS, max_new_tokens=24, stop_token_ids=[])
    kw = dict(kw, tree=V.parse_tree(kw["tree"])) if "tree" in kw else kw
    gen = SpeculativeGenerator(cfg, params, dcfg, dparams, max_seq_len=64, **kw)
    results = gen.generate(PROMPTS, max_new_tokens=24, stop_token_ids=[])
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert gen.spec.accepted_per_position[0] > 0  # drafts were accepted: acceptance was exercised
