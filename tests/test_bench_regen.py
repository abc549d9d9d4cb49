"""``python -m peagle_jax.bench.regen`` refuses bad flags with one line before loading anything."""

from __future__ import annotations

import pytest

from peagle_jax.bench.regen import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slot-buckets", "regen,fine"], "--slot-buckets regen,fine: expected regen and/or serving"),
        (["--batch", "-1"], "--batch must be >= 0, got -1"),
        (["--prompts", "0"], "--prompts must be >= 1, got 0"),
        (["--slots", "8,x"], "--slots '8,x': expected comma-separated integers"),
        (["--slots", "8,0"], "--slots '8,0': every value must be >= 1"),
    ],
)
def test_bad_flags_are_one_error_line(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and message in captured.err and captured.out == ""
