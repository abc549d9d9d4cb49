"""The Neuron lint: every rule fires on a small function built to trip it, and not on clean ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from peagle_jax.neuron.lint import RULES, lint_stablehlo
from peagle_jax.ops import argmax_first

X = jax.ShapeDtypeStruct((2, 2048), jnp.float32)
N = jax.ShapeDtypeStruct((), jnp.int32)
WIDE = jax.ShapeDtypeStruct((2, 49152), jnp.float32)


def neuron_text(f, *args):
    return export.export(jax.jit(f), platforms=["neuron"])(*args).mlir_module()


def rules(text):
    return {f.rule for f in lint_stablehlo(text)}


CLEAN = {
    "elementwise and plain reductions": (lambda x: jnp.sum(jnp.exp(x), -1) + jnp.max(x, -1), X),
    "fori_loop with static bounds": (lambda x: jax.lax.fori_loop(0, 5, lambda i, c: c * 2, x), X),
    "scan of static length": (lambda x: jax.lax.scan(lambda c, _: (c + 1, None), x, None, length=3)[0], X),
    "argmax over a small axis": (lambda x: jnp.argmax(x, 0), X),
    "top-k with small k over the vocabulary": (lambda x: jax.lax.top_k(x, 4), WIDE),
    "sort of 16384": (lambda x: jnp.sort(x, -1), jax.ShapeDtypeStruct((2, 16384), jnp.float32)),
    "argmax_first over the vocabulary": (argmax_first, WIDE),
}


@pytest.mark.parametrize("name", list(CLEAN))
def test_clean_functions_have_no_findings(name):
    f, *args = CLEAN[name]
    assert lint_stablehlo(neuron_text(f, *args)) == []


TRIPS = {
    "dynamic-shape": (lambda x: x * 2, jax.ShapeDtypeStruct(export.symbolic_shape("b, 4"), jnp.float32)),
    "control-flow": (lambda x, n: jax.lax.cond(n > 0, lambda: x, lambda: -x), X, N),
    "dynamic-while": (
        lambda x, n: jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 2), (0, x))[1],
        X,
        N,
    ),
    "variadic-reduce": (lambda x: jnp.argmax(x, -1), X),
    "large-sort": (lambda x: jnp.sort(x, -1), jax.ShapeDtypeStruct((2, 16385), jnp.float32)),
    "threefry": (lambda x: x + jax.random.uniform(jax.random.key(0), x.shape), X),
}


@pytest.mark.parametrize("rule", list(TRIPS))
def test_each_rule_fires(rule):
    f, *args = TRIPS[rule]
    assert rule in rules(neuron_text(f, *args))


def test_top_k_above_the_limit():
    found = lint_stablehlo(neuron_text(lambda x: jax.lax.top_k(x, 16385), WIDE))
    assert [f.rule for f in found] == ["large-sort"] and "k = 16385" in found[0].message


def test_while_with_a_data_bound_fires_but_a_static_one_does_not():
    dynamic = neuron_text(lambda x, n: jax.lax.fori_loop(0, n, lambda i, c: c * 2, x), X, N)
    assert "dynamic-while" in rules(dynamic)


def test_int64():
    with jax.enable_x64(True):
        text = neuron_text(lambda x: x + 1, jax.ShapeDtypeStruct((4,), jnp.int64))
    assert rules(text) == {"int64"}


def test_host_callback():
    def f(x):
        return jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    # jax.export refuses a callback for neuron outright; the lint catches it in any lowering's text.
    with pytest.raises(Exception, match="not supported on neuron"):
        neuron_text(f, X)
    assert "host-callback" in rules(jax.jit(f).lower(X).as_text())


def test_unknown_custom_call():
    def f(x):
        return jax.ffi.ffi_call("my_kernel", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    assert rules(jax.jit(f).lower(X).as_text()) == {"custom-call"}


def test_every_rule_is_tested():
    tested = set(TRIPS) | {"int64", "host-callback", "custom-call", "large-sort", "dynamic-while"}
    assert tested == set(RULES)


def test_findings_name_their_line():
    text = neuron_text(lambda x: jnp.argmax(x, -1), X)
    (finding,) = lint_stablehlo(text)
    assert "stablehlo.reduce" in text.splitlines()[finding.line - 1]
