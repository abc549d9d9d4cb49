"""Every graph the generators use exports for neuron and tpu and passes the Neuron lint: a tiny random
model with every graph family, and full-size shapes (abstract, no weights): SmolLM2, and the GPT-OSS and
Qwen3-Coder configs of neuron/configs/ with drafters of the released P-EAGLE drafters' shape."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from peagle_jax.drafter.config import random_drafter_config
from peagle_jax.engine.generator import decode_step
from peagle_jax.errors import UserError
from peagle_jax.models import model
from peagle_jax.models.config import ModelConfig, RopeConfig
from peagle_jax.neuron.buckets import BucketsError, ServingBuckets, load_buckets
from peagle_jax.neuron.export import NEURON_TARGETS, export_all, register_serialization
from peagle_jax.neuron.graphs import all_graphs
from peagle_jax.neuron.lint import Finding
from peagle_jax.sampling import SamplingParams

TINY = ModelConfig(
    family="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
# SmolLM2-135M-Instruct's config.json, as read by from_hf_config (hermetic: no download needed).
SMOLLM2 = ModelConfig(
    family="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope=RopeConfig(theta=100000.0),
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    dtype="bfloat16",
)
EVERY_FAMILY = dict(
    batch_buckets=(1, 2),
    prefill_buckets=(16, 32),
    max_seq_len=64,
    k_values=(3,),
    trees=("0,1,00",),
    sequential=True,
    fused=True,
    sampling=True,
)


def kinds(graphs):
    return {g.name.split("_b")[0] for g in graphs}


def test_tiny_model_every_graph_exports_clean_for_neuron_and_tpu(tmp_path):
    buckets = ServingBuckets(**EVERY_FAMILY, dtype="float32")
    graphs = all_graphs(TINY, random_drafter_config(TINY), buckets)
    assert kinds(graphs) == EVERY_KIND
    findings = export_all(graphs, tmp_path, ("neuron", "tpu"))
    assert {n: f for n, per in findings.items() for f in per.values() if f} == {}
    for platform in ("neuron", "tpu"):
        for g in graphs:
            for suffix in (".mlir", ".exported", ".hlo.pb"):
                assert (tmp_path / platform / f"{g.name}{suffix}").stat().st_size > 0
    commands = (tmp_path / "neuron" / "compile.sh").read_text().splitlines()
    compiles = [c for c in commands if c.startswith("neuronx-cc compile")]
    assert len(compiles) == len(graphs) * len(NEURON_TARGETS)
    assert "--framework XLA decode_b1_s64_w64_greedy.hlo.pb --target inf2 --model-type transformer" in "\n".join(
        compiles
    )
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [g["name"] for g in manifest["graphs"]] == [g.name for g in graphs]
    mlir = (tmp_path / "neuron" / "decode_b1_s64_w64_sampling.mlir").read_text()
    # The sampler sorts nothing: the one sort is the decomposition of the log-probabilities' top-20 composite
    # (chlo.top_k, one instruction for neuronx-cc), which is not called.
    assert 'stablehlo.composite "chlo.top_k"' in mlir and "i64>" not in mlir
    assert "stablehlo.sort" not in mlir.split("func.func private @chlo.top_k.impl")[0]


def test_compile_commands_keep_float32_products_in_float32():
    """neuronx-cc casts float32 matrix products to bf16 under --auto-cast matmult (its default before Neuron
    2.27): float32 graphs ask for none, bf16 graphs keep the compiler's default."""
    from peagle_jax.neuron.export import neuronx_cc_command

    fp32 = neuronx_cc_command("g.hlo.pb", "trn1", "float32")
    assert fp32 == (
        "neuronx-cc compile --framework XLA g.hlo.pb --target trn1 --model-type transformer --auto-cast none "
        "--output g.trn1.neff"
    )
    assert "--auto-cast" not in neuronx_cc_command("g.hlo.pb", "trn1", "bfloat16")
    assert neuronx_cc_command("g.hlo.pb", "trn2") == neuronx_cc_command("g.hlo.pb", "trn2", "bfloat16")


@pytest.mark.slow
def test_smollm2_shapes_every_graph_exports_clean():
    """The full-size vocabulary (49152) is where sort, top-k and argmax would trip the lint."""
    buckets = ServingBuckets(**{**EVERY_FAMILY, "batch_buckets": (1,)})
    graphs = all_graphs(SMOLLM2, random_drafter_config(SMOLLM2), buckets)
    findings = export_all(graphs, None, ("neuron",), write=False)
    assert {n: f for n, per in findings.items() for f in per.values() if f} == {}


def test_the_graph_set_follows_the_generators_buckets():
    b = ServingBuckets(
        batch_buckets=(1,),
        prefill_buckets=(16, 32),
        max_seq_len=100,
        k_values=(2,),
        sampling=False,
        adaptive_chains=(1,),
    )
    names = [g.name for g in all_graphs(TINY, random_drafter_config(TINY), b)]
    # Plain: 128 slots (100 rounded up to whole 32-token chunks), windows 128; chunks start at 0, 32, 64, 96.
    assert "prefill_b1_s128_t32_w128" in names and "decode_b1_s128_w128_greedy" in names
    assert not any("sampling" in n for n in names)
    # Speculative (K=2: 16 slots of slack, a queue of 16 context slots): 128 slots too, so the target prefill
    # graphs are shared. A draft reads 3 context slots.
    assert "verify_b1_s128_chain2_w128_greedy" in names and "parallel_draft_b1_s128_c3_chain2_n1_w128" in names
    # Every step writes its verified aux states into the next draft's context (3 of them for K = 2) in the
    # 16-slot queue.
    assert "write_context_b1_c16_n3" in names
    # The adaptive step length's shorter steps, inside the K=2 cache: a chain of 1 (adaptive_chains) drafted
    # over the same 3 context slots, the plain step, and make_room's write of the 16 queued elements to the
    # drafter cache.
    assert "parallel_draft_b1_s128_c3_chain1_n1_w128" in names and "write_context_b1_c16_n2" in names
    assert "plain_b1_s128_c16_w128_greedy" in names and "flush_context_b1_s128_c16_w128" in names
    assert not any("chain0" in n for n in names)  # a plain step neither drafts nor verifies a tree
    default = [
        g.name for g in all_graphs(TINY, random_drafter_config(TINY), dataclasses.replace(b, adaptive_chains=()))
    ]
    assert set(default) < set(names) and "plain_b1_s128_c16_w128_greedy" in default
    assert not any(x in n for n in default for x in ("chain1", "_n2"))
    fixed = [g.name for g in all_graphs(TINY, random_drafter_config(TINY), dataclasses.replace(b, adaptive=False))]
    assert set(fixed) < set(default)
    assert not any(x in n for n in fixed for x in ("chain1", "plain_", "flush_", "_n2"))
    assert len(names) == len(set(names))
    # window_buckets (serve --window-buckets): a 64-slot window below the whole 128-slot cache adds its graphs
    windowed = [
        g.name for g in all_graphs(TINY, random_drafter_config(TINY), dataclasses.replace(b, window_buckets=(64,)))
    ]
    assert set(names) < set(windowed) and "decode_b1_s128_w64_greedy" in windowed
    assert "verify_b1_s128_chain2_w64_greedy" in windowed and "plain_b1_s128_c16_w64_greedy" in windowed
    with pytest.raises(BucketsError, match="adaptive_chains"):
        dataclasses.replace(b, adaptive_chains=(2,))  # as long as the draft


def test_an_exported_graph_runs_and_equals_the_jitted_one():
    """The serialized export is the same computation: exported for cpu, reloaded and called."""
    register_serialization()
    params = model.init_params(TINY, jax.random.key(1))
    B, S = 2, 128
    args = lambda: (  # noqa: E731
        params,
        model.new_cache(TINY, B, S),
        jnp.asarray([3, 5], jnp.int32),
        jnp.asarray([0, 4], jnp.int32),
        jnp.asarray([1, 2], jnp.uint32),
        SamplingParams.make(B, 0.8, 5, 0.9),
    )
    kw = dict(cfg=TINY, greedy_only=False, window=128)
    blob = export.export(decode_step, platforms=["cpu"])(*args(), **kw).serialize()
    tokens, cache = export.deserialize(blob).call(*args())
    ref_tokens, ref_cache = decode_step(*args(), **kw)
    np.testing.assert_array_equal(tokens, ref_tokens)
    np.testing.assert_array_equal(cache.k[0], ref_cache.k[0])


def test_bucket_config_from_yaml(tmp_path):
    path = tmp_path / "b.yaml"
    path.write_text("batch_buckets: [1, 8]\nk_values: 5\ntrees: ['0,1']\nwindow_buckets: [256]\n")
    b = load_buckets(path)
    assert b.batch_buckets == (1, 8) and b.k_values == (5,) and b.trees == ("0,1",) and b.max_seq_len == 256
    assert b.window_buckets == (256,)
    shipped = load_buckets(Path(__file__).resolve().parent.parent / "neuron" / "buckets.yaml")
    assert shipped.k_values == (7,) and shipped.fused and shipped.dtype == "bfloat16"
    assert shipped.window_buckets is None  # the server's default windows
    with pytest.raises(BucketsError, match="window_buckets"):
        load_buckets(None, window_buckets=[0])
    path.write_text("batch_size: [1]\n")
    with pytest.raises(BucketsError, match="unknown bucket field"):
        load_buckets(path)
    with pytest.raises(BucketsError, match="batch_buckets"):
        load_buckets(None, batch_buckets=[0])


def test_cli_exports_a_tiny_hf_model_and_fails_on_findings(tmp_path, save_hf, monkeypatch, capsys):
    from conftest import tiny_hf_model

    from peagle_jax.neuron import __main__ as cli
    from peagle_jax.neuron import export as export_mod

    model_dir = save_hf(tiny_hf_model("llama"))
    yaml = tmp_path / "b.yaml"
    yaml.write_text("batch_buckets: [1]\nprefill_buckets: [16]\nmax_seq_len: 32\nk_values: [2]\ndtype: float32\n")
    argv = ["export", "--model", str(model_dir), "--buckets", str(yaml), "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "randomly initialised" in out and "lint: clean" in out
    assert (tmp_path / "out" / "tpu" / "fused_mask_hidden.mlir").is_file()
    compiles = [
        c
        for c in (tmp_path / "out" / "neuron" / "compile.sh").read_text().splitlines()
        if c.startswith("neuronx-cc compile")
    ]
    assert compiles and all("--auto-cast none" in c for c in compiles)  # float32 buckets: no cast to bf16
    # neuron/compile.sh runs the written commands for one target, here with a stand-in neuronx-cc that
    # writes the file named after --output.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "neuronx-cc"
    fake.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = --output ] && echo neff > "$2"; shift; done\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    script = Path(__file__).resolve().parent.parent / "neuron" / "compile.sh"
    r = subprocess.run(["sh", str(script), str(tmp_path / "out"), "inf2", "2"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    hlos = sorted(p.name.removesuffix(".hlo.pb") for p in (tmp_path / "out" / "neuron").glob("*.hlo.pb"))
    neffs = sorted(p.name.removesuffix(".inf2.neff") for p in (tmp_path / "out" / "neuron").glob("*.inf2.neff"))
    # 12 at a fixed K, + 3 for the adaptive step length (the plain step, greedy and sampling, and the context
    # flush), + 3 keeping the slots' token counts (penalties)
    assert hlos == neffs and len(hlos) == 18
    assert not list((tmp_path / "out" / "neuron").glob("*.trn1.neff"))

    # A real drafter directory (speculators layout) instead of the random default.
    from peagle_jax.drafter.load import save_drafter
    from peagle_jax.drafter.model import init_drafter_params
    from peagle_jax.models.hf_config import load_hf_config

    dcfg = random_drafter_config(load_hf_config(model_dir))
    save_drafter(tmp_path / "drafter", dcfg, init_drafter_params(dcfg, jax.random.key(0)))
    drafted = [*argv[:-1], str(tmp_path / "out_d"), "--drafter", str(tmp_path / "drafter"), "--platforms", "neuron"]
    assert cli.main(drafted) == 0
    out = capsys.readouterr().out
    assert "drafter " in out and "randomly" not in out and "lint: clean" in out

    def one_finding(text, **_):
        return [Finding("int64", 1, "a 64-bit integer tensor")] if "@jit_decode_step" in text else []

    monkeypatch.setattr(export_mod, "lint_stablehlo", one_finding)
    assert cli.main([*argv, "--platforms", "neuron", "--no-write"]) == 1
    assert "[int64]" in capsys.readouterr().out


def test_cli_usage_errors():
    run = [sys.executable, "-m", "peagle_jax.neuron", "export", "--model", "/nonexistent", "--out", "/tmp/x"]
    r = subprocess.run(run, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1


def test_tensor_parallel_graphs_export_clean_on_one_cpu(tmp_path):
    """``--tp``: the graphs take their parameters and caches sharded over an abstract 4-device mesh, so each
    module is a 4-partition program (partitioned by the compiler), exported and linted without 4 devices."""
    cfg = TINY.replace(num_heads=8, num_kv_heads=4, num_layers=2, aux_layer_ids=())
    buckets = ServingBuckets(**{**EVERY_FAMILY, "batch_buckets": (1,)}, dtype="float32")
    graphs = all_graphs(cfg, random_drafter_config(cfg), buckets, tp=4)
    findings = export_all(graphs, tmp_path, ("neuron",))
    assert {n: f for n, per in findings.items() for f in per.values() if f} == {}
    text = (tmp_path / "neuron" / "decode_b1_s64_w64_greedy.mlir").read_text()
    assert "mhlo.num_partitions = 4" in text
    qkv = next(line for line in text.splitlines() if "qkv_proj']['weight']\")" in line and "sdy.sharding" in line)
    assert '[{"tp"}, {}, {}, {}]' in qkv  # split on the kv heads
    assert len(list((tmp_path / "neuron").glob("*.hlo.pb"))) == len(graphs)
    with pytest.raises(UserError, match="must divide"):
        all_graphs(cfg, random_drafter_config(cfg), buckets, tp=3)


CONFIGS = Path(__file__).resolve().parent.parent / "neuron" / "configs"
EVERY_KIND = {
    "prefill", "sample", "decode", "drafter_prefill", "parallel_draft", "sequential_draft", "verify",
    "fused_parallel", "fused_sequential", "fused_mask_hidden", "write_context", "plain", "flush_context",
    "start_row", "count_tokens",
}  # fmt: skip
# Full-size models, small buckets: the shapes that trip the lint are the model's (vocabulary, width, experts).
SMALL = dict(batch_buckets=(1,), prefill_buckets=(16,), max_seq_len=32)


def released(name):
    from peagle_jax.neuron.targets import configs

    return configs(str(CONFIGS / f"{name}.json"), None, "bfloat16")


@pytest.mark.parametrize(
    "name, k, aux",
    [
        ("gpt-oss-20b", 10, (2, 12, 21)),
        ("gpt-oss-120b", 8, (2, 18, 33)),
        ("Qwen3-Coder-30B-A3B-Instruct", 18, (2, 24, 45)),
    ],
)
def test_the_shipped_configs_get_a_drafter_of_the_released_shape(name, k, aux):
    cfg, dcfg, note = released(name)
    assert f"released {name} drafter's shape" in note
    assert dcfg.parallel and dcfg.layer.num_layers == 4 and dcfg.speculative_tokens == k
    assert dcfg.draft_vocab_size == cfg.vocab_size and dcfg.has_vocab_map  # the identity d2t / t2d
    assert dcfg.hidden_size == dcfg.target_hidden_size == cfg.hidden_size and dcfg.layer.moe is None
    assert dcfg.aux_layer_ids == cfg.aux_layer_ids == aux  # vLLM's taps: 2, L // 2, L - 3
    plain = random_drafter_config(cfg.replace(family="llama", moe=None, layer_types=(), sliding_window=None))
    assert plain.layer.num_layers == 2  # a target without a released drafter keeps the 2-layer stand-in


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["neuron", "tpu"])
def test_gpt_oss_20b_every_graph_family_exports_clean_at_full_shapes(platform):
    """GPT-OSS-20B's config.json (24 layers, 32 experts, vocabulary 201088) with a drafter of the released
    shape (4 layers, K = 10): every graph family, no weights (about a minute per platform)."""
    cfg, dcfg, _ = released("gpt-oss-20b")
    buckets = ServingBuckets(**SMALL, k_values=(10,), sequential=True, fused=True, sampling=True)
    graphs = all_graphs(cfg, dcfg, buckets)
    assert kinds(graphs) == EVERY_KIND
    assert "verify_b1_s64_chain10_w64_sampling" in [g.name for g in graphs]
    findings = export_all(graphs, None, (platform,), write=False)
    assert {n: f for n, per in findings.items() for f in per.values() if f} == {}


@pytest.mark.slow
@pytest.mark.parametrize("name, k", [("gpt-oss-120b", 8), ("Qwen3-Coder-30B-A3B-Instruct", 18)])
def test_a_decode_and_a_verify_graph_export_clean_at_full_shapes(name, k):
    """The other released drafters' targets at full shapes (more experts, layers, K), for neuron: the TPU
    lowering of the same graph families at full shapes is GPT-OSS-20B's above."""
    cfg, dcfg, _ = released(name)
    buckets = ServingBuckets(**SMALL, k_values=(k,), sampling=False, adaptive=False)
    graphs = all_graphs(cfg, dcfg, buckets)
    picked = [next(g for g in graphs if g.name.startswith(kind)) for kind in ("decode_", "verify_b1_s")]
    assert f"_chain{k}_" in picked[1].name
    findings = export_all(picked, None, ("neuron",), write=False)
    assert {n: f for n, per in findings.items() for f in per.values() if f} == {}


def test_cli_exports_from_a_config_json_with_k_and_an_expert_split(tmp_path, capsys):
    """``--model`` takes a bare config.json (a tiny GPT-OSS here), ``--k`` the draft lengths; with ``--tp``
    the experts are split as ``--expert-split`` says."""
    from peagle_jax.neuron.__main__ import main

    hf = dict(
        model_type="gpt_oss", vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4,
    )  # fmt: skip
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(hf))
    yaml = tmp_path / "b.yaml"
    yaml.write_text("batch_buckets: [1]\nprefill_buckets: [8]\nmax_seq_len: 16\nsampling: false\nadaptive: false\n")
    argv = ["export", "--model", str(config), "--buckets", str(yaml), "--platforms", "neuron", "--no-write"]
    assert main([*argv, "--k", "2,3", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "gpt_oss, 2 layers" in out and "2-layer P-EAGLE drafter" in out and "lint: clean" in out
    names = [g["name"] for g in json.loads((tmp_path / "out" / "manifest.json").read_text())["graphs"]]
    assert any("_chain2_" in n for n in names) and any("_chain3_" in n for n in names)
    for split, axis in (("experts", '[{"tp"}, {}, {}, {}]'), ("width", '[{}, {}, {"tp"}, {}]')):
        out_dir = tmp_path / split
        assert main([*argv[:-1], "--k", "2", "--tp", "2", "--expert-split", split, "--out", str(out_dir)]) == 0
        text = (out_dir / "neuron" / "decode_b1_s16_w16_greedy.mlir").read_text()
        gate_up = next(x for x in text.splitlines() if "experts']['gate_up_proj']\")" in x and "sdy.sharding" in x)
        assert axis in gate_up, gate_up
    assert main([*argv, "--k", "two", "--out", str(tmp_path / "x")]) == 2
    assert main(["export", "--model", str(tmp_path / "missing.json"), "--out", str(tmp_path / "x")]) == 2
    assert "--k 'two': expected comma-separated integers" in capsys.readouterr().err


def test_packed_experts_export_clean(tmp_path, capsys):
    """A GPT-OSS config.json whose checkpoint is MXFP4 (``quantization_config``) exports its packed graphs
    (the uint8 blocks and scales as parameters, unpacked inside), clean for neuron and tpu; ``--experts
    unpacked`` exports the run-dtype experts instead."""
    from peagle_jax.neuron.__main__ import main

    hf = dict(
        model_type="gpt_oss", vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, quantization_config={"quant_method": "mxfp4"},
    )  # fmt: skip
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(hf))
    yaml = tmp_path / "b.yaml"
    yaml.write_text("batch_buckets: [1]\nprefill_buckets: [8]\nmax_seq_len: 16\nsampling: false\nadaptive: false\n")
    argv = ["export", "--model", str(config), "--buckets", str(yaml), "--k", "2"]
    assert main([*argv, "--out", str(tmp_path / "packed")]) == 0
    out = capsys.readouterr().out
    assert "packed experts" in out and "lint: clean" in out
    text = (tmp_path / "packed" / "neuron" / "decode_b1_s16_w16_greedy.mlir").read_text()
    assert "gate_up_proj_blocks" in text and "ui8" in text
    assert main([*argv, "--experts", "unpacked", "--platforms", "neuron", "--out", str(tmp_path / "plain")]) == 0
    assert "unpacked experts" in capsys.readouterr().out
    text = (tmp_path / "plain" / "neuron" / "decode_b1_s16_w16_greedy.mlir").read_text()
    assert "gate_up_proj_blocks" not in text
