"""Learning curves of several runs on one plot (``python -m peagle_jax.train.curve RUN RUN``): the target answers
once, each run's curve lands in its directory, and a curve already measured for the same drafters and settings
is read instead of measured again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SHIPPED = Path(__file__).resolve().parents[1] / "peagle_jax" / "drafter" / "shipped"


def _run(root: Path, drafter: str, step: int) -> Path:
    """A run directory holding one export of a shipped drafter at ``step`` and its metrics."""
    run = root / drafter
    shutil.copytree(SHIPPED / drafter, run / "drafters" / f"step-{step}", ignore=shutil.ignore_patterns("README.md"))
    lines = [json.dumps({"step": s, "loss_tokens": 100 + s}) for s in range(step)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_two_runs_on_one_plot_and_measured_once(tmp_path, monkeypatch, capsys):
    from peagle_jax.train import curve

    a, b = _run(tmp_path, "smollm2-peagle", 3), _run(tmp_path, "smollm2-eagle3", 2)
    calls = []
    answers = curve.held_out_answers
    monkeypatch.setattr(curve, "held_out_answers", lambda *x: calls.append(x) or answers(*x))
    argv = [str(a), str(b), "--questions", "4", "--max-new-tokens", "8"]
    argv += ["--json", str(tmp_path / "both.json"), "--plot", str(tmp_path / "both.png")]
    assert curve.main(argv) == 0
    assert len(calls) == 1  # one set of held-out answers for both runs
    both = json.loads((tmp_path / "both.json").read_text())["runs"]
    assert list(both) == [str(a), str(b)]
    for run, step, tokens in ((a, 3, 303), (b, 2, 201)):
        res = both[str(run)]
        assert res == json.loads((run / "curve.json").read_text())
        assert [(p["step"], p["tokens"]) for p in res["points"]] == [(step, tokens)]
        for r in res["points"][0]["trees"].values():
            assert 1.0 <= r["acceptance_length"] <= 8.0
            assert r["acceptance_length"] == pytest.approx(1 + sum(r["accepted_per_position"]))
        assert (run / "curve.png").stat().st_size > 1000
    assert (tmp_path / "both.png").stat().st_size > 1000
    assert f"### {a}" in capsys.readouterr().out

    def refuse(*x):
        raise AssertionError("measured again")

    monkeypatch.setattr(curve, "held_out_answers", refuse)
    assert curve.main(argv) == 0  # both curves read, the combined ones written again
    assert json.loads((tmp_path / "both.json").read_text())["runs"] == both
    with pytest.raises(AssertionError, match="measured again"):  # other settings
        curve.main([str(a), "--questions", "4", "--max-new-tokens", "9"])
    shutil.copy(SHIPPED / "smollm2-peagle" / "model.safetensors", b / "drafters" / "step-2" / "model.safetensors")
    with pytest.raises(AssertionError, match="measured again"):  # a re-exported drafter
        curve.main(argv)


def test_curve_refuses_a_run_named_twice(tmp_path, capsys):
    from peagle_jax.train.curve import main

    assert main([str(tmp_path), str(tmp_path)]) == 2
    assert "named twice" in capsys.readouterr().err


def test_a_reference_drafter_is_measured_on_the_same_answers(tmp_path, capsys):
    # the run's one export is the shipped drafter itself, so the reference must measure exactly what it does
    from peagle_jax.train import curve

    run = _run(tmp_path, "smollm2-peagle", 2)
    argv = [str(run), "--questions", "4", "--max-new-tokens", "8", "--reference", "smollm2-peagle"]
    assert curve.main([*argv, "--reference", str(SHIPPED / "smollm2-eagle3")]) == 0
    res = json.loads((run / "curve.json").read_text())
    refs = res["references"]
    assert list(refs) == ["smollm2-peagle", str(SHIPPED / "smollm2-eagle3")]
    assert refs["smollm2-peagle"]["trees"] == res["points"][0]["trees"]
    assert refs["smollm2-peagle"]["drafter_sha256"] != refs[str(SHIPPED / "smollm2-eagle3")]["drafter_sha256"]
    out = capsys.readouterr().out
    assert refs["smollm2-peagle"]["label"] == "shipped smollm2-peagle"
    assert refs[str(SHIPPED / "smollm2-eagle3")]["label"] == "shipped smollm2-eagle3"
    assert "| reference |" in out and "| shipped smollm2-peagle |" in out
    assert curve.main(argv[:5]) == 0  # read again without references: none recorded
    assert "references" not in json.loads((run / "curve.json").read_text())


@pytest.mark.parametrize(
    ("ref", "message"),
    [("no-such-drafter", "no shipped drafter 'no-such-drafter'"), ("some/dir", "no drafter there")],
)
def test_a_bad_reference_is_refused_before_measuring(tmp_path, capsys, ref, message):
    from peagle_jax.train import curve

    run = _run(tmp_path, "smollm2-peagle", 2)
    assert curve.main([str(run), "--reference", ref]) == 2
    assert message in capsys.readouterr().err
    assert not (run / "curve.json").exists()
