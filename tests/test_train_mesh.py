"""Sharded training on 8 simulated CPU devices equals one device; checkpoints move between meshes.

The device count of a JAX process is fixed when JAX starts, so the check runs in a fresh process
(tests/mesh_train_check.py) with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from peagle_jax.models.config import ConfigError
from peagle_jax.train.mesh import leaf_spec, make_mesh


def test_sharded_step_equals_single_device_and_checkpoints_move_between_meshes():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    script = Path(__file__).with_name("mesh_train_check.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-3000:]


def test_mesh_errors_and_specs():
    with pytest.raises(ConfigError, match="devices"):
        make_mesh(2, 4)  # one device here
    with pytest.raises(ConfigError, match=">= 1"):
        make_mesh(1, 0)
    assert make_mesh(-1, 1).shape == {"data": 1, "fsdp": 1}
    assert tuple(leaf_spec((576, 49152), 4)) == (None, "fsdp")
    assert tuple(leaf_spec((4, 576), 4)) == ()  # small: replicated
    assert tuple(leaf_spec((1536, 575), 4)) == ("fsdp", None)
    assert tuple(leaf_spec((1535, 575), 4)) == ()  # indivisible: replicated
