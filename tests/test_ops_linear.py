"""ops.linear: equal to ``x @ W^T`` in every form it picks, and the form it picks survives XLA's CPU compiler."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peagle_jax import ops


def _reference(w, x, in_axes):
    n_in = int(np.prod(w.shape[w.ndim - in_axes :]))
    out = np.asarray(x, np.float64).reshape(-1, n_in) @ np.asarray(w, np.float64).reshape(-1, n_in).T
    return out.reshape(*x.shape[: x.ndim - in_axes], *w.shape[: w.ndim - in_axes])


@pytest.mark.parametrize("rows", [1, 3, 5, 17, ops.SMALL_ROWS, ops.SMALL_ROWS + 1])
@pytest.mark.parametrize("in_axes", [1, 2])
def test_linear_equals_reference(rows, in_axes):
    rng = np.random.default_rng(rows)
    w_shape = (6, 5) if in_axes == 1 else (6, 3, 4)
    x = jnp.asarray(rng.standard_normal((rows, *w_shape[1:]), np.float32))
    w = jnp.asarray(rng.standard_normal(w_shape, np.float32))
    got = jax.jit(ops.linear, static_argnums=2)(w, x, in_axes)
    assert got.shape == (rows, 6)
    np.testing.assert_allclose(np.asarray(got), _reference(w, x, in_axes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [2, ops.SMALL_ROWS + 1])
def test_gradients_equal_plain_product(rows):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((7, 5), np.float32))
    x = jnp.asarray(rng.standard_normal((rows, 5), np.float32))

    def loss(f):
        return lambda w, x: jnp.sum(jnp.tanh(f(w, x)))

    got = jax.grad(loss(ops.linear), argnums=(0, 1))(w, x)
    want = jax.grad(loss(lambda w, x: x @ w.T), argnums=(0, 1))(w, x)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


def test_bfloat16_with_float32_accumulation():
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((8, 16), np.float32)).astype(jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((3, 16), np.float32)).astype(jnp.bfloat16)
    got = ops.linear(w, x, preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), _reference(w.astype(jnp.float32), x.astype(jnp.float32), 1), rtol=1e-5)


def test_padded_rows():
    assert [ops.padded_rows(m) for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 100)] == [1, 2, 4, 4, 8, 8, 16, 16, 17, 100]


@pytest.mark.parametrize("rows", [2, 4, 5, 16, 20])
def test_compiled_product_keeps_weight_as_left_operand(rows):
    """A few rows feeding the next layer (a verify's or a small batch's forward): the compiled dot must
    produce ``[out, rows]`` (W streamed in place; rows padded to :func:`ops.padded_rows`), not
    ``[rows, out]`` (W repacked on every call), which is what XLA turns the unguarded ``(W @ x^T)^T`` into."""
    w1 = jnp.ones((96, 32), jnp.float32)
    w2 = jnp.ones((32, 96), jnp.float32)

    def two_layers(w1, w2, x):
        return ops.linear(w2, jax.nn.silu(ops.linear(w1, x)))

    text = jax.jit(two_layers).lower(w1, w2, jnp.ones((rows, 32))).compile().as_text()
    shapes = re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} dot\(", text)
    padded = ops.padded_rows(rows)
    assert sorted(shapes) == sorted([f"96,{padded}", f"32,{padded}"]), shapes
