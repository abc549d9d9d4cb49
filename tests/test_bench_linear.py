"""``python -m peagle_jax.bench.linear`` end to end on a tiny model: both product forms timed at each row count,
over every weight matrix of the model, and the form ops.linear picks."""

from __future__ import annotations

import json

import jax
import pytest
from serve_fixtures import write_tiny_model

from peagle_jax import ops
from peagle_jax.bench import linear as bench_linear


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_linear_times_both_forms_at_each_row_count(tmp_path, capsys, dtype):
    model = write_tiny_model(tmp_path / "target")
    out = tmp_path / "linear.json"
    rows = [1, 3, ops.SMALL_ROWS + 1]
    argv = ["--model", str(model), "--rows", ",".join(map(str, rows)), "--rounds", "2", "--json", str(out)]
    assert bench_linear.main([*argv, "--dtype", dtype]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [r["rows"] for r in result["results"]] == rows
    small = "W @ x^T" if dtype == "float32" else "bf16 kernel, >= 4 rows"
    assert result["dtype"] == dtype and [r["picks"] for r in result["results"]] == [small, small, "x @ W^T"]
    for r in result["results"]:
        assert set(r["ms"]) == {"x @ W^T", "W @ x^T", "ops.linear"} and min(r["ms"].values()) > 0
        assert abs(r["ratio"] - r["ms"]["W @ x^T"] / r["ms"]["x @ W^T"]) < 1e-9
    assert "| rows M | x @ W^T |" in table and f"| {ops.SMALL_ROWS + 1} |" in table
    assert bench_linear.main(["--model", str(model), "--rows", "0"]) == 2
    assert "error: --rows" in capsys.readouterr().err


def test_matrices_cover_every_projection_and_the_lm_head(tmp_path):
    from peagle_jax.checkpoint import load_target_any

    cfg, params = load_target_any(write_tiny_model(tmp_path / "target"))
    mats = bench_linear._matrices(params)
    assert not cfg.tie_word_embeddings  # the tiny model has its own lm_head: the embedding is not a product
    per_layer = 4  # qkv_proj, o_proj, gate_up_proj, down_proj
    assert len(mats) == cfg.num_layers * per_layer + 1
    assert all(w.ndim == 2 for w in mats)
    products = [x for x in jax.tree.leaves(params) if x.ndim >= 2]
    assert sum(w.size for w in mats) == sum(x.size for x in products) - params["embed_tokens"].size
    assert any(w.shape == params["lm_head"]["weight"].shape for w in mats)
