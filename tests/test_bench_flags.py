"""Bad flags of the benchmarks that take comma-separated values are one line ``error: ...`` on stderr and exit
status 2, before anything loads (``errors.comma_ints`` and friends); and ``bench.draft`` runs at a tiny size."""

from __future__ import annotations

import json

import pytest

from peagle_jax import errors
from peagle_jax.bench import draft, grammar, mtbench, sampling


@pytest.mark.parametrize(
    ("main", "argv", "message"),
    [
        (draft.main, ["--draft-vocab", "64,x"], "--draft-vocab '64,x': expected comma-separated integers"),
        (draft.main, ["--draft-vocab", "64,"], "--draft-vocab '64,': expected comma-separated items"),
        (draft.main, ["--max-k", "0"], "--max-k must be >= 1, got 0"),
        (draft.main, ["--context", "-1"], "--context must be >= 0, got -1"),
        (mtbench.main, ["--ks", "1,x"], "--ks '1,x': expected comma-separated integers"),
        (mtbench.main, ["--ks", "0"], "--ks '0': every value must be >= 1"),
        (mtbench.main, ["--temperatures", "0.7,0"], "--temperatures: the first must be 0"),
        (mtbench.main, ["--temperatures", "0,hot"], "--temperatures '0,hot': expected comma-separated numbers"),
        (mtbench.main, ["--speed-ks", "3;7"], "--speed-ks '3;7': expected comma-separated integers"),
        (grammar.main, ["--rows", "1,,4"], "--rows '1,,4': expected comma-separated items without empty ones"),
        (grammar.main, ["--rounds", "0"], "--rounds must be >= 1, got 0"),
        (sampling.main, ["--top-p", "0.9,1.5"], "--top-p '0.9,1.5': every value must be in (0, 1]"),
        (sampling.main, ["--vocab", "1"], "--vocab must be >= 2, got 1"),
    ],
)
def test_a_bad_flag_is_one_error_line(main, argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and message in captured.err, captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""


def test_comma_ints_checks_the_minimum():
    assert errors.comma_ints(" 3, 7 ", "--k", minimum=1) == [3, 7]
    with pytest.raises(errors.UserError, match=r"--k '3,-1': every value must be >= 0, e.g. 1,2,3"):
        errors.comma_ints("3,-1", "--k", minimum=0)
    with pytest.raises(errors.UserError, match=r"--rows must be >= 1, got 0"):
        errors.at_least(1, {"--rounds": 2, "--rows": 0})


def test_the_draft_bench_runs(tmp_path, capsys):
    out = tmp_path / "draft.json"
    argv = ["--max-k", "2", "--layers", "1", "--draft-vocab", "256", "--rounds", "2", "--json", str(out)]
    assert draft.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["draft_vocab"], r["K"]) for r in rows] == [(256, 1), (256, 2)]
    assert all(r["parallel_ms"] > 0 and r["sequential_ms"] > 0 and r["one_pass_ms"] > 0 for r in rows)
    assert "| 256 | 2 |" in capsys.readouterr().out
