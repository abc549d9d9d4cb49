"""A training run that gets SIGTERM (a preempted TPU VM, pod or job) saves the step it is on and exits 143, in
one process and, through JAX's preemption service, in every process of a multi-process run at the same step;
the same command then resumes there."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest
from test_train_multiprocess import _logs, _run, _start  # the tiny recipe's processes on simulated devices

STEPS = "optim.total_steps=1000"  # far more than the test waits for: only SIGTERM ends the run


def _terminate_after_steps(out, procs, which: int, steps: int = 3) -> int:
    """SIGTERM to process ``which`` once ``steps`` steps are on record; returns the step the run saved."""
    deadline = time.monotonic() + 300
    metrics = out / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < steps:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), _logs(out)
        time.sleep(0.05)
    procs[which].send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [128 + signal.SIGTERM] * len(procs), _logs(out)
    found = re.search(r"stopped by SIGTERM after step (\d+) of 1000 \(saved\)", _logs(out))
    assert found, _logs(out)
    return int(found[1])


def _saved_steps(out) -> list[int]:
    return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_saves_the_current_step_and_the_run_resumes_there(tmp_path, processes):
    """One process: its own SIGTERM handler. Two: SIGTERM to the second only, and both stop at one step."""
    out = tmp_path / "run"
    procs = _start(out, processes, [STEPS])
    step = _terminate_after_steps(out, procs, which=processes - 1)
    # The step the signal found (the periodic checkpoints come every 3 steps here), every step before it on record.
    assert step >= 3 and _saved_steps(out)[-1] == step
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(step))
    _run(out, processes, [STEPS, "run.stop_after=1"])
    assert f"resumed from step {step}" in _logs(out) and _saved_steps(out)[-1] == step + 1
