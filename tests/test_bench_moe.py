"""``python -m peagle_jax.bench.moe`` end to end at tiny widths: both dispatches timed at each token count,
their bytes from XLA's cost analysis against the active-parameter bound, and bad flags as one-line errors."""

from __future__ import annotations

import json

import pytest

from peagle_jax.bench import moe as bench_moe


@pytest.mark.parametrize("dtype,itemsize", [("float32", 4), ("bfloat16", 2)])
def test_bench_moe_times_and_sizes_both_dispatches(tmp_path, capsys, dtype, itemsize):
    out = tmp_path / "moe.json"
    tokens = [1, 2, 8]
    argv = ["--models", "tiny-gpt-oss,tiny-qwen3-moe", "--tokens", ",".join(map(str, tokens)), "--rounds", "2"]
    assert bench_moe.main([*argv, "--dtype", dtype, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert (result["dtype"], result["layers"], result["rounds"]) == (dtype, 1, 2)
    assert [m["name"] for m in result["models"]] == ["tiny-gpt-oss", "tiny-qwen3-moe"]
    for model in result["models"]:
        spec = bench_moe.Spec(**{k: model[k] for k in ("name", "family", "hidden", "expert_width", "experts", "top_k")})
        assert [r["tokens"] for r in model["results"]] == tokens
        for r in model["results"]:
            assert set(r["ms"]) == set(bench_moe.DISPATCHES) and min(r["ms"].values()) > 0
            assert abs(r["gather_over_dense"] - r["ms"]["gather"] / r["ms"]["dense"]) < 1e-9
            assert r["active_bound_bytes"] == spec.active_params(r["tokens"]) * itemsize
            assert r["all_bytes"] == spec.all_params() * itemsize == model["all_bytes"]
            assert min(r["bytes"].values()) >= r["active_bound_bytes"] * 0.99  # nothing reads less than the bound
            assert r["skipped"] == {} and r["auto"] in bench_moe.DISPATCHES
        one = model["results"][0]
        assert one["active_bound_bytes"] < one["all_bytes"] and one["auto"] == "gather"
        assert one["bytes"]["gather"] < one["bytes"]["dense"]  # at 1 token gather reads k of E experts
        assert f"### {model['name']}:" in table
    assert "| tokens | dense | gather | gather / dense |" in table


def test_a_variant_over_the_memory_cap_is_analysed_but_not_run(tmp_path):
    out = tmp_path / "moe.json"
    argv = ["--models", "tiny-gpt-oss", "--tokens", "4", "--rounds", "1", "--max-temp-gib", "0", "--json", str(out)]
    assert bench_moe.main(argv) == 0
    (r,) = json.loads(out.read_text())["models"][0]["results"]
    assert set(r["skipped"]) == {"dense", "gather"} and r["ms"] == {"dense": None, "gather": None}
    assert r["gather_over_dense"] is None and min(r["bytes"].values()) > 0


def test_bad_flags_are_one_line_errors(capsys):
    assert bench_moe.main(["--models", "gpt-oss-7b"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown --models gpt-oss-7b")
    assert bench_moe.main(["--tokens", "0"]) == 2
    assert "error: --tokens" in capsys.readouterr().err


def test_slice_overcount_removes_the_unread_experts_of_a_converted_slice():
    """A bf16 expert sliced for a float32 product: the cost analysis counts all 8 experts' bytes, the slice
    reads one; a slice of the parameter itself is already counted at the slice."""
    import jax
    import jax.numpy as jnp

    sliced = jax.jit(lambda w, i: jax.lax.dynamic_index_in_dim(w.astype(jnp.float32), i) * 2)
    for dtype, expected in ((jnp.bfloat16, 2 * 7 * 64 * 32), (jnp.float32, 0)):
        compiled = sliced.lower(jnp.ones((8, 64, 32), dtype), jnp.int32(3)).compile()
        assert bench_moe.slice_overcount(compiled.as_text()) == expected
