"""``python -m peagle_jax.bench.train --sweep`` end to end at a small shape: P-EAGLE's and EAGLE-3's steps side by
side; bad sweep entries are refused with a message."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from peagle_jax.bench import train as bench_train


def test_sweep_times_both_objectives_side_by_side(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    argv = ["--sweep", "1:64:3,1:64:2:eagle3", "--batch-size", "1", "--seq-len", "256", "--rounds", "1", "--block", "2"]
    assert bench_train.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["layers"], r["draft_vocab"], r["k_train"], r["objective"]) for r in rows] == [
        (1, 64, 3, "peagle"),
        (1, 64, 2, "eagle3"),
    ]
    assert rows[0]["vs_first"] == 1.0 and all(r["block"] == 2 for r in rows)
    for r in rows:
        assert r["step_s"] > 0 and r["loss_tokens_per_s"] == pytest.approx(round(0.55 * 256) / r["step_s"])
        assert r["gflops"] == pytest.approx(r["gflop"] / r["step_s"])
    # the count covers at least the LM head's three products (forward and both gradients) over the answer
    # positions (P-EAGLE shape 1:64:3: D = 576, 64 draft ids, 141 answer positions of 256)
    assert rows[0]["gflop"] > 3 * 2 * 141 * 576 * 64 / 1e9
    assert "| 1 | 64 | 2 | eagle3 |" in capsys.readouterr().out


@pytest.mark.parametrize("entry", ["2:8192", "2:8192:4:medusa", "0:8192:4", "two:8192:4"])
def test_bad_sweep_entries_are_refused(capsys, entry):
    with pytest.raises(SystemExit) as exit_:
        bench_train.main(["--sweep", entry])
    assert exit_.value.code == 2
    assert f"--sweep entry {entry!r}" in capsys.readouterr().err


def test_flop_count_is_xla_s_count_of_the_products():
    # a lone product's count is 2 M K N, which is what the step's GFLOP/s rests on
    lowered = jax.jit(lambda a, b: a @ b).lower(jnp.ones((16, 32)), jnp.ones((32, 64)))
    assert bench_train._gflop(lowered) == pytest.approx(2 * 16 * 32 * 64 / 1e9)
    assert bench_train.lone_product_gflops(16, 32, 64, "bfloat16", repeats=2) > 0


def test_a_block_times_every_step_but_the_first():
    calls = []
    times = bench_train.timed_block(lambda: calls.append(1), 3)
    assert len(calls) == 3 and len(times) == 2 and all(t >= 0 for t in times)
    calls.clear()
    assert len(bench_train.timed_block(lambda: calls.append(1), 1)) == 1 and len(calls) == 1


def test_a_block_of_no_steps_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_train.main(["--block", "0"])
    assert exit_.value.code == 2
    assert "--block must be at least 1, got 0" in capsys.readouterr().err
