"""``python -m peagle_jax.bench.steps`` end to end on a tiny model: every step length timed against the plain
engine's step, at each row count."""

from __future__ import annotations

import json

import pytest
from serve_fixtures import write_tiny_drafter, write_tiny_model

from peagle_jax.bench import steps as bench_steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_steps_times_every_step_length_at_each_row_count(tmp_path, capsys, dtype):
    model = write_tiny_model(tmp_path / "target")
    drafter = write_tiny_drafter(tmp_path / "drafter", k=2)
    out = tmp_path / "steps.json"
    argv = ["--model", str(model), "--drafter", str(drafter), "--rows", "1,2", "--steps", "4"]
    assert bench_steps.main([*argv, "--max-seq-len", "256", "--dtype", dtype, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["dtype"] == dtype and result["k"] == 2 and [r["rows"] for r in result["results"]] == [1, 2]
    for r in result["results"]:
        assert r["plain_ms"] > 0 and list(r["k"]) == ["0", "1", "2"]
        assert r["k"]["0"]["tokens_per_row_step"] == 1.0  # a plain step: one token per row
        for v in r["k"].values():
            assert v["step_ms"] > 0 and 1.0 <= v["tokens_per_row_step"] <= 3.0
            assert abs(v["throughput_over_plain"] - v["tokens_per_row_step"] / v["step_over_plain"]) < 1e-9
    assert "| rows | plain step | K'=0 | K'=1 | K'=2 |" in table and "| 2 |" in table
    assert bench_steps.main([*argv[:4], "--rows", "0"]) == 2
    assert "error: --rows" in capsys.readouterr().err


def test_bench_steps_times_a_tree_and_refuses_bad_flags(tmp_path, capsys):
    model = write_tiny_model(tmp_path / "target")
    drafter = write_tiny_drafter(tmp_path / "drafter", k=2)
    out = tmp_path / "steps.json"
    argv = ["--model", str(model), "--drafter", str(drafter), "--rows", "1", "--steps", "3", "--max-seq-len", "256"]
    assert bench_steps.main([*argv, "--tree", "0,1,00", "--json", str(out)]) == 0
    assert "tree 0,1,00 (depth 2)" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["tree"] == "0,1,00" and result["k"] == 2 and list(result["results"][0]["k"]) == ["0", "1", "2"]
    assert 1.0 <= result["results"][0]["k"]["2"]["tokens_per_row_step"] <= 3.0
    assert bench_steps.main([*argv, "--tree", "0,00,2x"]) == 2
    assert "error: --tree" in capsys.readouterr().err
    assert bench_steps.main([*argv, "--tree", "0,1", "--k", "1"]) == 2
    assert "not both" in capsys.readouterr().err
