"""ops.attention: both score forms equal a float64 reference, and the compiled form keeps the keys as the dot's
left operand. (That speculative decoding still emits plain decoding's tokens is tested end to end.)"""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from serve_fixtures import write_tiny_model

from peagle_jax import ops
from peagle_jax.bench import attention as bench_attention


def _inputs(T, S, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, T, 6, 8)).astype(dtype)  # 6 query heads over 2 kv heads
    k = rng.standard_normal((2, 2, S, 8)).astype(dtype)
    v = rng.standard_normal((2, 2, S, 8)).astype(dtype)
    visible = rng.random((2, T, S)) < 0.6
    visible[:, :, 0] = True
    return q, k, v, visible


def _reference(q, k, v, visible):
    B, T, N, H = q.shape
    G = k.shape[1]
    kk = np.repeat(np.asarray(k, np.float64), N // G, axis=1)  # [B, N, S, H]
    vv = np.repeat(np.asarray(v, np.float64), N // G, axis=1)
    s = np.einsum("btnh,bnsh->bnts", np.asarray(q, np.float64), kk) / math.sqrt(H)
    s = np.where(visible[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnts,bnsh->btnh", p, vv)


@pytest.mark.parametrize("form", ["q @ K^T", "K @ q^T", "bf16 K @ q^T", "bf16 q @ K^T", None])
@pytest.mark.parametrize("T", [1, 5])
def test_attention_forms_equal_reference(form, T):
    q, k, v, visible = _inputs(T, 40)
    got = jax.jit(ops.attention, static_argnames="form")(q, k, v, visible, form=form)
    np.testing.assert_allclose(np.asarray(got), _reference(q, k, v, visible), rtol=1e-5, atol=1e-5)


def test_unknown_form_is_refused():
    with pytest.raises(ValueError, match="unknown attention form"):
        ops.attention(*_inputs(1, 4), form="K^T @ q")


def test_attention_form_by_rows():
    assert ops.attention_form(1) == ops.attention_form(ops.SMALL_ROWS) == "K @ q^T"
    assert ops.attention_form(1, jnp.bfloat16) == ops.attention_form(ops.SMALL_ROWS, jnp.bfloat16) == "bf16 K @ q^T"
    assert ops.attention_form(ops.SMALL_ROWS + 1) == ops.attention_form(ops.SMALL_ROWS + 1, jnp.bfloat16) == "q @ K^T"


@pytest.mark.parametrize("form", [None, "bf16 q @ K^T"])
@pytest.mark.parametrize("T", [1, 5])
def test_bf16_kernel_forms_equal_reference_in_bf16(T, form):
    q, k, v, visible = _inputs(T, 40, seed=T)
    attend = jax.jit(ops.attention, static_argnames="form")
    got = attend(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), visible, form=form)
    want = _reference(*(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in (q, k, v)), visible)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05, atol=0.05)


def test_bf16_rows_do_not_depend_on_the_other_rows():
    """A row's bf16 attention is the same bit for bit whatever else shares its product: alone (a decode step),
    among the queries of a verify, or with other rows of the batch; what makes a decode step and a verify of
    the same tokens agree."""
    q, k, v, visible = (jnp.asarray(x, jnp.bfloat16) if x.dtype != bool else x for x in _inputs(6, 48, seed=3))
    attend = jax.jit(ops.attention)
    whole = np.asarray(attend(q, k, v, visible), np.float32)
    for t in range(6):
        alone = attend(q[:1, t : t + 1], k[:1], v[:1], visible[:1, t : t + 1])
        np.testing.assert_array_equal(np.asarray(alone, np.float32), whole[:1, t : t + 1])


@pytest.mark.parametrize("T", [1, 8])
def test_compiled_bf16_scores_keep_the_keys_as_left_operand_in_bf16(T):
    """The bf16 scores' dot takes the bf16 keys as its left operand, producing ``[.., S, Z]`` (Z: the query
    rows padded), with no conversion of the key window to f32 before it."""
    q, k, v, visible = (jnp.asarray(x, jnp.bfloat16) if x.dtype != bool else x for x in _inputs(T, 64))
    text = jax.jit(ops.attention).lower(q, k, v, visible).compile().as_text()
    Z = max(4, ops.padded_rows(3 * T))
    dots = re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} dot\(", text)
    assert sorted(dots) == sorted([f"2,2,64,{Z}", f"2,2,{Z},8"])
    assert not re.search(r"f32\[2,2,64,8\]\{[\d,]*\} convert\(", text)  # no key or value window in f32


@pytest.mark.parametrize("T", [1, 8])
def test_compiled_scores_keep_the_keys_as_left_operand(T):
    """The scores' dot must produce ``[.., S, R*T]`` (keys streamed in place), not ``[.., R*T, S]``, which is
    what XLA folds an unguarded transpose back into."""
    q, k, v, visible = _inputs(T, 64)

    def dots(form):
        text = jax.jit(ops.attention, static_argnames="form").lower(q, k, v, visible, form=form).compile().as_text()
        return sorted(re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} dot\(", text))

    M = 3 * T  # query rows per kv head
    assert dots(None) == dots("K @ q^T") == sorted([f"2,2,64,{M}", f"2,2,{M},8"])
    assert dots("q @ K^T") == sorted([f"2,2,{M},64", f"2,2,{M},8"])


def test_bench_attention_times_every_form(tmp_path, capsys):
    model = write_tiny_model(tmp_path / "target")
    out = tmp_path / "attention.json"
    argv = ["--model", str(model), "--windows", "16,32", "--queries", "1,3", "--rounds", "2", "--rows", "2"]
    argv += ["--json", str(out)]
    assert bench_attention.main(argv) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [(r["window"], r["queries"]) for r in result["results"]] == [(16, 1), (16, 3), (32, 1), (32, 3)]
    for r in result["results"]:
        assert set(r["ms"]) == {"q @ K^T", "K @ q^T", "bf16 q @ K^T", "bf16 K @ q^T"} and min(r["ms"].values()) > 0
        best_other = min(t for f, t in r["ms"].items() if f != "K @ q^T")
        assert abs(r["vs_best_other"] - r["ms"]["K @ q^T"] / best_other) < 1e-9
        assert abs(r["ratio"] - r["ms"]["K @ q^T"] / r["ms"]["q @ K^T"]) < 1e-9 and r["picks"] == "K @ q^T"
    assert "| window W | queries T |" in table and "| 32 | 3 |" in table
    assert bench_attention.main(["--model", str(model), "--windows", "0"]) == 2
    assert "error: --windows" in capsys.readouterr().err
    assert bench_attention.main(["--model", str(model), "--rows", "0"]) == 2
    assert "--rows must be >= 1, got 0" in capsys.readouterr().err
    assert bench_attention.main(["--model", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
