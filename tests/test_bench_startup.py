"""``python -m peagle_jax.bench.startup`` end to end on the tiny served model: a cold and a warm start of one
setting, each timed to ready, to its first answer and to its last graph; bad flags are one-line errors."""

from __future__ import annotations

import json

from serve_fixtures import write_tiny_model

from peagle_jax.bench import startup


def test_cold_and_warm_starts_are_measured(tmp_path, capsys):
    model = write_tiny_model(tmp_path / "tiny")
    out = tmp_path / "startup.json"
    setting = f"tiny=--model {model} --max-batch 2 --max-seq-len 256"
    assert startup.main(["--setting", setting, "--modes", "background", "--max-tokens", "4", "--json", str(out)]) == 0
    cold, warm = json.loads(out.read_text())["results"]
    assert (cold["cache"], warm["cache"]) == ("cold", "warm")
    for run in (cold, warm):
        assert run["setting"] == "tiny" and run["compile"] == "background" and run["completion_tokens"] == 4
        assert 0 < run["ready_s"] <= run["first_answer_s"] and run["ready_s"] <= run["all_s"]
        assert 0 < run["graphs_before_ready"] < run["graphs"] and run["compile_s"] > 0
    assert cold["graphs"] == warm["graphs"] and cold["graphs_before_ready"] == warm["graphs_before_ready"]
    # the warm start loads what the cold one compiled (the background graphs: both ran all of them)
    assert cold["executables_loaded"] == 0 and cold["executables_compiled"] > 0
    assert warm["executables_compiled"] == 0 and warm["executables_loaded"] == cold["executables_compiled"]
    assert "| tiny | background | cold |" in capsys.readouterr().out


def test_bad_flags_are_one_line_errors(capsys):
    assert startup.main(["--modes", "later"]) == 2
    assert capsys.readouterr().err.startswith("error: --modes 'later'")
    assert startup.main(["--setting", "no-equals-sign"]) == 2
    assert "NAME=FLAGS" in capsys.readouterr().err
