"""The training pipeline as several processes (the TPU-pod path) on simulated CPU devices joined over loopback:
2 processes x 2 devices train exactly as 1 process x 4 (losses at every step, evaluation, the exported
drafter), a kill -9 of one process stops the other within the heartbeat, and a run resumes from checkpoints
written by another number of processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "train" / "configs" / "tiny.yaml"
SMALL = [
    "data.max_prompts=16",
    "optim.save_every=3",
    "optim.warmup_steps=1",
    "run.eval_every=3",
    "run.eval_batches=1",
    "run.tensorboard=false",
    "run.progress=false",
    "mesh.fsdp=2",
    "mesh.heartbeat_s=10",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(out: Path, processes: int, overrides: list[str]) -> list[subprocess.Popen]:
    """``processes`` processes of 4 / processes simulated CPU devices each, training into ``out``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 // processes}"
    cmd = [sys.executable, str(ROOT / "train" / "train.py"), "--config", str(TINY), "--output", str(out)]
    cmd += SMALL + overrides
    if processes > 1:
        cmd += [f"mesh.coordinator_address=127.0.0.1:{_free_port()}", f"mesh.num_processes={processes}"]
    procs = []
    for i in range(processes):
        log = open(out.parent / f"{out.name}-{len(list(out.parent.glob(out.name + '-*.log')))}.log", "w")
        extra = [f"mesh.process_id={i}"] if processes > 1 else []
        procs.append(subprocess.Popen(cmd + extra, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    return procs


def _run(out: Path, processes: int, overrides: list[str]) -> None:
    procs = _start(out, processes, overrides)
    codes = [p.wait(timeout=600) for p in procs]
    assert codes == [0] * processes, _logs(out)


def _logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.parent.glob(out.name + "-*.log")))


def _losses(out: Path, name: str) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / name).read_text().splitlines())]


def _same_run(a: Path, b: Path) -> None:
    """Equal losses at every step and every evaluation, and equal exported drafter tensors (fp32, 1e-5)."""
    for name in ("metrics.jsonl", "eval.jsonl"):
        la, lb = _losses(a, name), _losses(b, name)
        assert [s for s, _ in la] == [s for s, _ in lb], name
        # 1e-5 of the run's loss scale: late losses are ~1e-3 and differ by reduction order in the last bits
        xa, xb = np.array([x for _, x in la]), np.array([x for _, x in lb])
        np.testing.assert_allclose(xa, xb, rtol=1e-5, atol=1e-5 * np.abs(xb).max(), err_msg=name)
    ta, tb = load_file(str(a / "drafter" / "model.safetensors")), load_file(str(b / "drafter" / "model.safetensors"))
    assert sorted(ta) == sorted(tb)
    for key in ta:
        np.testing.assert_allclose(ta[key].astype(np.float64), tb[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_two_processes_equal_one_survive_a_kill_and_resume(tmp_path):
    """P-EAGLE: 1 x 4 devices uninterrupted, against 2 x 2 whose second process is killed (-9) mid-run:
    the first stops with JAX's error within the heartbeat, and both restarted finish with the same losses
    and drafter as the uninterrupted run."""
    steps = ["optim.total_steps=30"]
    _run(tmp_path / "one", 1, steps)
    two = tmp_path / "two"
    procs = _start(two, 2, steps)
    deadline = time.monotonic() + 300
    while not (two / "checkpoints" / "6").is_dir():
        assert time.monotonic() < deadline and procs[0].poll() is None, _logs(two)
        time.sleep(0.05)
    procs[1].kill()
    killed = time.monotonic()
    code = procs[0].wait(timeout=120)
    waited = time.monotonic() - killed
    assert code != 0, _logs(two)
    assert waited < 60, f"the surviving process took {waited:.0f} s to stop"
    # JAX names the dead task one of two ways, depending on whether the survivor's error poll or its
    # shutdown barrier sees the missed heartbeats first (the barrier's stack trace can push the first
    # message out of the log's tail, so the whole log is read here)
    survivor = (tmp_path / "two-0.log").read_text()
    assert "another task died" in survivor or "Task 1 heartbeat timeout" in survivor, _logs(two)
    procs[1].wait()
    _run(two, 2, steps)
    assert "resumed from step" in _logs(two)
    _same_run(tmp_path / "one", two)


@pytest.mark.slow
def test_checkpoints_move_between_process_counts_eagle3(tmp_path):
    """EAGLE-3: 1 x 4 uninterrupted against 1 x 4 for 2 steps, 2 x 2 for 2 more, 1 x 4 to the end."""
    steps = ["optim.total_steps=6", "optim.save_every=2", "run.eval_every=2", "optim.objective=eagle3"]
    _run(tmp_path / "one", 1, steps)
    moved = tmp_path / "moved"
    for processes in (1, 2, 1):
        _run(moved, processes, [*steps, "run.stop_after=2"])
    assert _logs(moved).count("resumed from step") == 2
    _same_run(tmp_path / "one", moved)


def test_multi_process_settings_are_checked(monkeypatch):
    from peagle_jax.models.config import ConfigError
    from peagle_jax.train import mesh as meshlib
    from peagle_jax.train.recipe import MeshConfig

    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert not meshlib.multi_process(MeshConfig())
    assert meshlib.multi_process(MeshConfig(distributed=True))
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert meshlib.process_settings(MeshConfig()) == ("10.0.0.1:1234", 4, 3)
    assert meshlib.process_settings(MeshConfig(process_id=1)) == ("10.0.0.1:1234", 4, 1)
    monkeypatch.setenv("JAX_PROCESS_ID", "x")
    with pytest.raises(ConfigError, match=r"\$JAX_PROCESS_ID='x' is not an integer"):
        meshlib.process_settings(MeshConfig())
    monkeypatch.delenv("JAX_PROCESS_ID")
    with pytest.raises(ConfigError, match="mesh.process_id not set"):
        meshlib.initialize(MeshConfig())
    with pytest.raises(ConfigError, match="mesh.process_id must be below mesh.num_processes"):
        MeshConfig(num_processes=2, process_id=2)
    with pytest.raises(ConfigError, match="mesh.heartbeat_s must be >= 1"):
        MeshConfig(heartbeat_s=0)
