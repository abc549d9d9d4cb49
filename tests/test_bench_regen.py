"""``python -m peagle_jax.bench.regen`` refuses bad flags with one line before loading anything."""

from __future__ import annotations

import pytest

from peagle_jax.bench.regen import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slot-buckets", "regen,fine"], "--slot-buckets 'regen,fine': expected regen and/or serving"),
        (["--batch", "-1"], "--batch >= 0"),
        (["--prompts", "0"], "--prompts and --max-new-tokens must be >= 1"),
        (["--slots", "8,x"], "--slots '8,x': expected comma-separated integers"),
    ],
)
def test_bad_flags_are_one_error_line(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(argv)
