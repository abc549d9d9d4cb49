"""The device recipe end to end at tiny scale on the CPU: pipeline, drafters exported along the way, the
held-out MT-Bench learning curve, the card."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_device_recipe_writes_drafter_card_and_curve(tmp_path):
    from peagle_jax.train.curve import cumulative_tokens
    from peagle_jax.train.device import main

    out = tmp_path / "dev"
    argv = ["--output", str(out), "--config", "train/configs/tiny.yaml", "--questions", "4"]
    argv += ["--max-new-tokens", "12", "run.export_steps=10,25", "run.progress=false", "data.regen_slots=8"]
    assert main(argv) == 0
    res = json.loads((out / "curve.json").read_text())
    assert [p["step"] for p in res["points"]] == [10, 25, 40]
    tokens = [p["tokens"] for p in res["points"]]
    assert tokens == [cumulative_tokens(out)[s] for s in (10, 25, 40)] and tokens == sorted(set(tokens))
    for p in res["points"]:
        for tree in ("0,1,2,3,4,00,01", "0,00,000,0000,00000,000000,0000000"):
            r = p["trees"][tree]
            assert r["target_forwards"] > 0 and 1.0 <= r["acceptance_length"] <= 8.0
            # tokens per forward = 1 + the accepted drafts per position, summed
            assert r["acceptance_length"] == pytest.approx(1 + sum(r["accepted_per_position"]))
    assert (out / "curve.png").stat().st_size > 1000
    card = (out / "drafter" / "README.md").read_text()
    assert "## Learning curve (held-out MT-Bench)" in card and "| 25 |" in card
    assert json.loads((out / "device.json").read_text())["device"] == "cpu"
    assert (out / "drafters" / "step-10" / "config.json").is_file()


def test_bad_input_is_one_error_line(tmp_path, capsys):
    from peagle_jax.train.curve import main

    assert main([str(tmp_path)]) == 2
    assert "no exported drafters" in capsys.readouterr().err
    from peagle_jax.models.config import ConfigError
    from peagle_jax.train.recipe import RunConfig

    with pytest.raises(ConfigError, match="run.export_steps must be comma-separated steps"):
        RunConfig(export_steps="10,x")
