"""Tensor parallelism on 8 simulated CPU devices: TP = 1, 2, 4, 8 give the tokens of the unsharded model,
plain and speculative (parallel, fused, sharded drafter), greedy; the TP decode step exports for neuron
and passes the lint. The devices must be configured before
jax starts, so the check runs in a subprocess (``tests/tp_check.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peagle_jax.errors import UserError
from peagle_jax.models.config import ModelConfig
from peagle_jax.sharding import check_tp, param_spec

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tp_runs():
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "tp_check.py")], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_every_tp_gives_the_same_tokens(tp_runs):
    assert tp_runs["devices"] == 8
    reference = tp_runs["runs"]["none"]["plain"]
    assert all(len(t) == 12 for t in reference)
    for tp, runs in tp_runs["runs"].items():
        for name in ("plain", "parallel", "fused", "sharded_drafter"):
            if name in runs:
                assert runs[name] == reference, (tp, name)
    sharded = {name for tp, runs in tp_runs["runs"].items() if tp not in ("none", "1") for name in runs}
    assert {"plain", "parallel", "fused", "sharded_drafter"} <= sharded


def test_weights_and_cache_are_split_over_kv_heads(tp_runs):
    for tp in (1, 2, 4, 8):
        runs = tp_runs["runs"][str(tp)]
        assert runs["qkv_shard_shape"] == [8 // tp, 4, 8, 64]  # [G / TP, R + 2, H, D]
        assert runs["cache_sharded_on_kv_heads"]


def test_the_sharded_decode_step_exports_clean_for_neuron(tp_runs):
    assert tp_runs["tp8_neuron_export"] == {"devices": 8, "findings": []}


def test_tp_must_divide_the_kv_heads():
    smollm2 = ModelConfig(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
    )
    check_tp(3, num_kv_heads=smollm2.num_kv_heads, intermediate_size=smollm2.intermediate_size)
    with pytest.raises(UserError, match="must divide the target's 3 kv heads"):
        check_tp(2, num_kv_heads=smollm2.num_kv_heads, intermediate_size=smollm2.intermediate_size)


def test_partition_specs_by_name():
    import jax
    from jax.sharding import PartitionSpec as P

    from peagle_jax.models import model

    cfg = ModelConfig(
        family="qwen3",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qkv_bias=True,
        mlp_bias=True,
        qk_norm=True,
    )
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    specs = {jax.tree_util.keystr(p): param_spec(p, x) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    layer = "['layers.0']"
    assert specs[f"{layer}['self_attn']['qkv_proj']['weight']"] == P("tp", None, None, None)
    assert specs[f"{layer}['self_attn']['qkv_proj']['bias']"] == P("tp", None, None)
    assert specs[f"{layer}['self_attn']['o_proj']['weight']"] == P(None, "tp", None)
    assert specs[f"{layer}['mlp']['gate_up_proj']['weight']"] == P(None, "tp", None)
    assert specs[f"{layer}['mlp']['down_proj']['weight']"] == P(None, "tp")
    for name in (
        "['embed_tokens']",
        "['lm_head']['weight']",
        f"{layer}['mlp']['down_proj']['bias']",
        f"{layer}['self_attn']['q_norm']['weight']",
        "['norm']['weight']",
    ):
        assert specs[name] == P(), name
