"""Tensor parallelism of the MoE targets on 8 simulated CPU devices: TP = 1, 2, 4, 8 with the experts split
whole (``experts``) or by width (``width``) give the tokens of the unsharded GPT-OSS and Qwen3-MoE targets,
plain and speculative, greedy, past the sliding window; each device holds the expected expert shards; the
sharded decode step exports for neuron and passes the lint; ``auto`` picks the split with the smaller
collectives per dispatch. The devices must be configured before jax starts, so the checks run in two
subprocesses at once, one per family (``tests/moe_tp_check.py``); the refusals are checked here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec as P

from peagle_jax.errors import UserError
from peagle_jax.models import model
from peagle_jax.models.config import MoEConfig
from peagle_jax.models.hf_config import from_hf_config
from peagle_jax.sharding import check_target_tp, check_tp, expert_split, param_shardings, param_spec

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("gpt_oss", "qwen3_moe")
E, F, D = 8, 16, 32  # the check's targets: experts, expert width, model width


@pytest.fixture(scope="module")
def moe_runs():
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    check = str(ROOT / "tests" / "moe_tp_check.py")
    procs = {
        f: subprocess.Popen(
            [sys.executable, check, f], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for f in FAMILIES
    }
    out = {}
    for family, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-3000:]
        out[family] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tp_and_split_gives_the_unsharded_tokens(moe_runs, family):
    r = moe_runs[family]
    assert (r["devices"], r["family"]) == (8, family)
    if family == "gpt_oss":  # both attention kinds, generated past the window of 8
        assert r["layer_types"] == ["sliding_attention", "full_attention"]
    else:  # a sparse and a dense layer
        assert r["sparse_layers"] == [0]
    reference = r["runs"]["none"]["plain"]
    assert all(len(t) == 20 for t in reference) and len({tuple(t) for t in reference}) == 2
    want = {"none", "1-experts"} | {f"{tp}-{s}" for tp in (2, 4, 8) for s in ("experts", "width")}
    assert set(r["runs"]) == want
    for name, run in r["runs"].items():
        assert run["plain"] == reference, name
        for spec in ("parallel", "fused"):
            if spec in run:
                assert run[spec] == reference, (name, spec)
                assert run["accepted"][0] > 0, name  # drafts were accepted: verification was exercised
    for tp in (2, 4, 8):
        assert "parallel" in r["runs"][f"{tp}-experts"] and "fused" in r["runs"][f"{tp}-width"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_device_holds_its_expert_shards(moe_runs, family):
    """``experts`` splits E of every expert tensor, ``width`` the hidden units F (``down_proj_bias`` [E, D]
    replicated). The width placement survives the generators, whose ``auto`` would split whole experts for
    the dense dispatch: a placement made with an explicit split is kept."""
    for name, run in moe_runs[family]["runs"].items():
        if name == "none":
            continue
        tp, split = int(name.split("-")[0]), name.split("-")[1]
        e, f = (E // tp, F) if split == "experts" else (E, F // tp)
        want = {"gate_up_proj": [e, 2, f, D], "down_proj": [e, D, f]}
        if family == "gpt_oss":
            want.update(gate_up_proj_bias=[e, 2, f], down_proj_bias=[e if split == "experts" else E, D])
        assert run["shards"] == want, name
        assert run.get("spec_shards_same", True), name


@pytest.mark.parametrize("family", FAMILIES)
def test_the_sharded_moe_decode_step_exports_clean_for_neuron(moe_runs, family):
    for split in ("experts", "width"):
        assert moe_runs[family]["neuron_export"][split] == {"devices": 8, "findings": []}, split


def test_auto_picks_the_split_with_the_smaller_collectives(moe_runs):
    """Dense dispatch: ``experts`` sums token outputs over the devices, where ``width`` all-gathers expert
    weights (its product over all experts merges E with the split F). Gathered: ``width`` slices each
    selected expert's F-shard on its device and sums the outputs, where ``experts`` all-gathers every
    expert's weights to slice one."""
    sizes = moe_runs["gpt_oss"]["collective"]
    assert sizes["dense"]["auto"] == "experts" and sizes["gather"]["auto"] == "width"
    assert sizes["dense"]["experts"] <= 2 * 1 * 2 * D < sizes["dense"]["width"]  # [B, T, k, D] outputs
    assert sizes["gather"]["width"] <= 2 * 1 * 2 * D < E * 2 * F * D <= sizes["gather"]["experts"]


MOE = MoEConfig(num_experts=8, top_k=2, intermediate_size=24, sparse_layers=(0,))


def test_tp_must_divide_the_experts_or_their_width_by_name():
    check_tp(8, num_kv_heads=8, intermediate_size=None, moe=MOE, experts="experts")
    check_tp(3, num_kv_heads=6, intermediate_size=None, moe=MOE, experts="width")
    with pytest.raises(UserError, match="--tp 3 must divide the target's 8 experts"):
        check_tp(3, num_kv_heads=6, intermediate_size=None, moe=MOE, experts="experts")
    with pytest.raises(UserError, match="--tp 16 must divide the target's expert width 24"):
        check_tp(16, num_kv_heads=16, intermediate_size=None, moe=MOE, experts="width")
    with pytest.raises(UserError, match="--tp 5 must divide the target's expert width 24 .* or its 8 experts"):
        check_tp(5, num_kv_heads=5, intermediate_size=None, moe=MOE)
    with pytest.raises(UserError, match="must divide the target's 6 kv heads"):
        check_tp(4, num_kv_heads=6, intermediate_size=None, moe=MOE)
    with pytest.raises(UserError, match="--expert-split 'rows'"):
        check_tp(2, num_kv_heads=2, intermediate_size=None, moe=MOE, experts="rows")


def test_auto_split_follows_the_dispatch_then_divisibility():
    assert expert_split(4, num_experts=8, expert_width=24, dispatch="dense") == "experts"
    assert expert_split(3, num_experts=8, expert_width=24, dispatch="dense") == "width"
    assert expert_split(4, num_experts=8, expert_width=24, dispatch="gather") == "width"
    assert expert_split(4, num_experts=8, expert_width=24, dispatch="auto") == "width"
    assert expert_split(8, num_experts=8, expert_width=12, dispatch="gather") == "experts"
    assert expert_split(8, num_experts=8, expert_width=12, experts="experts", dispatch="gather") == "experts"


def _gpt_oss():
    hf = dict(model_type="gpt_oss", vocab_size=8, hidden_size=16, intermediate_size=12, num_hidden_layers=1)
    hf.update(num_attention_heads=8, num_key_value_heads=8, head_dim=4, num_local_experts=4, num_experts_per_tok=2)
    return from_hf_config({**hf, "sliding_window": 4})


def test_a_target_is_checked_against_its_config():
    """Kv heads and experts always; the dense MLP width only where a layer is dense (no GPT-OSS layer is)."""
    cfg = _gpt_oss()
    check_target_tp(4, cfg, "experts")
    check_target_tp(4, cfg, "width")
    with pytest.raises(UserError, match="--tp 8 must divide the target's 4 experts"):
        check_target_tp(8, cfg, "experts")
    with pytest.raises(UserError, match="--tp 8 must divide the target's expert width 12 .* or its 4 experts"):
        check_target_tp(8, cfg)
    check_target_tp(4, cfg.replace(intermediate_size=7), "experts")
    with pytest.raises(UserError, match="MLP width 7"):
        check_tp(4, num_kv_heads=8, intermediate_size=7)


def test_expert_partition_specs_by_split():
    cfg = _gpt_oss()
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    leaves = jax.tree_util.tree_leaves_with_path(params)
    want = {
        "experts": {
            "gate_up_proj": P("tp", None, None, None),  # [E, 2, F, D]
            "down_proj": P("tp", None, None),  # [E, D, F]
            "gate_up_proj_bias": P("tp", None, None),  # [E, 2, F]
            "down_proj_bias": P("tp", None),  # [E, D]
        },
        "width": {
            "gate_up_proj": P(None, None, "tp", None),
            "down_proj": P(None, None, "tp"),
            "gate_up_proj_bias": P(None, None, "tp"),
            "down_proj_bias": P(),
        },
    }
    layer = "['layers.0']"
    for split, specs in want.items():
        got = {jax.tree_util.keystr(p): param_spec(p, x, split) for p, x in leaves}
        for name, spec in specs.items():
            assert got[f"{layer}['mlp']['experts']['{name}']"] == spec, (split, name)
        assert got[f"{layer}['mlp']['router']['weight']"] == P()
        assert got[f"{layer}['mlp']['router']['bias']"] == P()
        assert got[f"{layer}['self_attn']['sinks']"] == P("tp")  # [N]: query heads by group, as o_proj
        assert got[f"{layer}['self_attn']['qkv_proj']['weight']"] == P("tp", None, None, None)
    path, x = next((p, x) for p, x in leaves if jax.tree_util.keystr(p).endswith("['experts']['down_proj']"))
    with pytest.raises(ValueError, match="needs experts="):
        param_spec(path, x)
    mesh = jax.sharding.AbstractMesh((2,), ("tp",))
    experts = param_shardings(params, mesh, "auto", dispatch="gather")["layers.0"]["mlp"]["experts"]
    assert experts["gate_up_proj"].spec == P(None, None, "tp", None)  # gathered: the width
    experts = param_shardings(params, mesh)["layers.0"]["mlp"]["experts"]
    assert experts["gate_up_proj"].spec == P("tp", None, None, None)  # dense: whole experts
