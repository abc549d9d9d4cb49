"""The roofline planner against hand-computed cases."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from peagle_jax.errors import UserError
from peagle_jax.models.config import ModelConfig
from peagle_jax.models.hf_config import from_hf_config
from peagle_jax.neuron.plan import GIB, INSTANCES, ModelCost, model_cost, plan

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


def test_model_cost_of_a_tiny_config_by_hand():
    # Per layer: qkv [G=2, R+2=4, H=16, D=64] 8192, o_proj [64, 4, 16] 4096, gate_up [2, 128, 64] 16384,
    # down [64, 128] 8192 (36864 in matmuls) + two norms of 64. Embedding 128x64 = 8192, lm_head 8192 (untied),
    # final norm 64. Total 8192 + 4 * (36864 + 128) + 64 + 8192 = 164416 parameters of 4 bytes.
    cost = model_cost(TINY)
    assert cost.weight_bytes == (164416 - 8192) * 4  # the untied input embedding is only gathered
    assert cost.matmul_params == 4 * 36864 + 8192
    assert cost.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4  # K and V, 4 layers, 2 kv heads of 16, fp32
    tied = model_cost(TINY.replace(tie_word_embeddings=True, dtype="bfloat16"))
    assert tied.weight_bytes == (164416 - 8192) * 2  # no lm_head; the embedding is read whole as the head
    assert tied.matmul_params == 4 * 36864 + 8192


def test_memory_bound_case_by_hand():
    target = ModelCost(weight_bytes=10**9, matmul_params=5 * 10**8, kv_bytes_per_token=10**5)
    drafter = ModelCost(weight_bytes=10**8, matmul_params=5 * 10**7, kv_bytes_per_token=0)
    r = plan(target, drafter, INSTANCES["trn1.2xlarge"], tp=2, k=4, acceptance_length=3.0, context=1000)
    bw = 410 * GIB  # 820 GiB/s per chip, 2 NeuronCores
    plain = (10**9 + 10**8) / 2 / bw  # 1.2493 ms; FLOPs 5e8 / 95e12 = 5 us
    draft = 10**8 / bw  # the replicated drafter: 0.2271 ms
    assert r.plain_step_s == pytest.approx(plain)
    assert r.verify_s == pytest.approx(plain)  # 5 tokens are still far from compute-bound
    assert r.draft_s == pytest.approx(draft)
    assert r.plain_tokens_per_s == pytest.approx(1 / plain)
    assert r.spec_tokens_per_s == pytest.approx(3 / (plain + draft))
    assert r.speedup == pytest.approx(2.5385, rel=1e-4)
    assert r.bound == {"plain": "memory", "verify": "memory", "draft": "memory"}


def test_compute_bound_verify_by_hand():
    target = ModelCost(weight_bytes=2 * 10**9, matmul_params=10**9, kv_bytes_per_token=0)
    drafter = ModelCost(weight_bytes=0, matmul_params=0, kv_bytes_per_token=0)
    r = plan(target, drafter, INSTANCES["trn2.48xlarge"], tp=1, k=7, acceptance_length=4.0, batch=64)
    # Per device (LNC=2: 4 per chip): 2.9 TB/s / 4 = 725 GB/s, 667 TFLOPS / 4 = 166.75 TFLOPS.
    assert r.plain_step_s == pytest.approx(2e9 / 725e9)  # memory: 2.759 ms > 2e9*64 / 166.75e12 = 0.768 ms
    assert r.verify_s == pytest.approx(2e9 * 64 * 8 / 166.75e12)  # compute: 6.141 ms > 2.759 ms
    assert r.bound["plain"] == "memory" and r.bound["verify"] == "compute"
    assert r.spec_tokens_per_s == pytest.approx(64 * 4 / r.verify_s)


def test_sequential_drafting_pays_k_passes():
    target = ModelCost(10**9, 5 * 10**8, 0)
    drafter = ModelCost(10**8, 5 * 10**7, 0)
    one = plan(target, drafter, INSTANCES["inf2.xlarge"], tp=1, k=5, acceptance_length=2.0)
    seq = plan(target, drafter, INSTANCES["inf2.xlarge"], tp=1, k=5, acceptance_length=2.0, sequential=True)
    assert seq.draft_s == pytest.approx(5 * one.draft_s)


def test_bad_plans_are_refused():
    cost = ModelCost(1, 1, 0)
    with pytest.raises(UserError, match="64 devices"):
        plan(cost, cost, INSTANCES["trn2.48xlarge"], tp=65, k=3, acceptance_length=2)
    with pytest.raises(UserError, match="acceptance-length"):
        plan(cost, cost, INSTANCES["inf2.xlarge"], tp=1, k=3, acceptance_length=5)


def test_plan_cli(save_hf, capsys):
    from conftest import tiny_hf_model

    from peagle_jax.neuron.__main__ import main

    model_dir = str(save_hf(tiny_hf_model("llama")))
    assert (
        main(
            [
                "plan",
                "--model",
                model_dir,
                "--instance",
                "trn1.32xlarge",
                "--tp",
                "2",
                "--k",
                "3",
                "--acceptance-length",
                "2.5",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| trn1.32xlarge | 2 | 0.0 of 16 GiB |" in out and "memory: 0.0 GiB per device" in out
    # 2 kv heads: TP 4 cannot shard them.
    assert (
        main(["plan", "--model", model_dir, "--instance", "trn1.32xlarge", "--tp", "4", "--acceptance-length", "2"])
        == 2
    )
    assert "must divide" in capsys.readouterr().err


# A tiny GPT-OSS: 2 layers, 4 experts of width 8, top-2, fp32.
TINY_MOE = dict(
    model_type="gpt_oss",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=8,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
)
CONFIGS = Path(__file__).resolve().parent.parent / "neuron" / "configs"


def test_moe_cost_counts_every_expert_in_memory_and_the_routed_ones_in_a_step_by_hand():
    cfg = from_hf_config(TINY_MOE)
    # Per layer: experts gate_up [4, 2, 8, 16] 1024 + down [4, 16, 8] 512 (matmuls) + biases 64 + 64; router
    # 64 + 4; qkv [2, 4, 4, 16] 512 + bias 32; o_proj [16, 4, 4] 256 + bias 16; sinks 4; two norms 32: 2584.
    # Embedding 1024, lm_head 1024, final norm 16: 2 * 2584 + 2064 = 7232 parameters of 4 bytes.
    width = model_cost(cfg, expert_split="width", tp=2)
    assert width.num_params == 7232 and width.param_bytes == 7232 * 4
    assert width.weight_bytes == (7232 - 1024) * 4  # the untied input embedding is only gathered
    assert width.matmul_params == 2 * (1536 + 64 + 512 + 256) + 1024
    assert width.expert_params == 2 * 1536 and (width.num_experts, width.top_k) == (4, 2)
    # Split by width: the experts but their down_proj bias (replicated), qkv (and bias), o_proj, sinks.
    assert width.split_param_bytes == 2 * (1600 + 512 + 32 + 256 + 4) * 4
    assert width.expert_bytes == 2 * 1600 * 4
    whole = model_cost(cfg, expert_split="experts", tp=2)
    assert whole.expert_bytes == 2 * 1664 * 4 and whole.split_param_bytes == width.split_param_bytes + 2 * 64 * 4
    # Active per token: the router and 2 of the 4 experts.
    assert whole.active_params == whole.matmul_params - 2 * 1536 / 2
    # One token reads k = 2 of 4 experts; n tokens E (1 - (1 - k/E)^n) of them.
    assert whole.experts_read(1) == 2 and whole.experts_read(3) == pytest.approx(4 * (1 - 0.5**3))
    replicated = whole.weight_bytes - whole.split_bytes
    read = whole.read_bytes_per_device(1, 2)
    assert read == pytest.approx((whole.split_bytes - whole.expert_bytes / 2) / 2 + replicated)
    assert whole.read_bytes_per_device(64, 2) == pytest.approx(whole.split_bytes / 2 + replicated)
    assert whole.memory_per_device(2) == whole.split_param_bytes / 2 + whole.param_bytes - whole.split_param_bytes
    flops = 2 * 3 * ((whole.split_matmul_params - 1536) / 2 + whole.matmul_params - whole.split_matmul_params)
    assert whole.flops_per_device(3, 2) == pytest.approx(flops)


def test_a_model_that_does_not_fit_is_refused_with_the_numbers():
    # 40 GiB of weights, all split; a device of trn1.2xlarge has 16 GiB.
    target = ModelCost(weight_bytes=40 * GIB, matmul_params=10**9, kv_bytes_per_token=2**20)
    drafter = ModelCost(weight_bytes=GIB, matmul_params=10**8, kv_bytes_per_token=0)
    # At TP 2: 20 GiB of weights + 1 GiB of KV cache (2^20 bytes x 1024 tokens) / 2 + the replicated drafter.
    want = (
        r"does not fit at TP 2: 21\.5 GiB per device \(target weights 20\.0 \+ KV cache 0\.50 \+ drafter 1\.00\) of 16"
    )
    with pytest.raises(UserError, match=want):
        plan(target, drafter, INSTANCES["trn1.2xlarge"], tp=2, k=4, acceptance_length=2, context=1024)
    r = plan(target, drafter, INSTANCES["trn1.32xlarge"], tp=4, k=4, acceptance_length=2, context=1024)
    # At TP 4 on trn1.32xlarge: 10 + 0.25 + 1 GiB.
    assert r.memory.total == pytest.approx(10 * GIB + GIB / 4 + GIB) and r.memory.capacity == 16 * GIB


def test_moe_steps_read_the_routed_experts_by_hand():
    # 1e9 bytes of which 8e8 are 32 experts (top-4); one device; a verify of K + 1 = 5 tokens.
    target = ModelCost(
        weight_bytes=10**9, matmul_params=5 * 10**8, kv_bytes_per_token=0, expert_bytes=8 * 10**8,
        expert_params=4 * 10**8, num_experts=32, top_k=4,
    )  # fmt: skip
    drafter = ModelCost(0, 0, 0)
    r = plan(target, drafter, INSTANCES["inf2.xlarge"], tp=1, k=4, acceptance_length=2, context=0)
    bw = 410 * GIB
    assert r.plain_step_s == pytest.approx((2 * 10**8 + 8 * 10**8 * 4 / 32) / bw)
    distinct = 32 * (1 - (28 / 32) ** 5)  # 15.4 experts
    assert r.verify_s == pytest.approx((2 * 10**8 + 8 * 10**8 * distinct / 32) / bw)
    assert target.active_params == 10**8 + 4 * 10**8 * 4 / 32


SHA256 = {  # of the files on the hub (neuron/configs/README.md)
    "gpt-oss-20b": "3a2a26ded679375b7928ddeca59764df7cea83220c1961035f6d6e232659e9ce",
    "gpt-oss-120b": "933aeb666a3fd851133ddd7686414f369bc564c4185fb5704416550879f10566",
}


@pytest.mark.parametrize(
    "name, total, active",
    [
        ("gpt-oss-20b", 20.91, 3.61),  # the gpt-oss model card: 20.91B total, 3.61B active
        ("gpt-oss-120b", 116.83, 5.13),  # 116.83B, 5.13B
        ("Qwen3-Coder-30B-A3B-Instruct", 30.5, 3.3),  # its model card: 30.5B total, 3.3B activated
    ],
)
def test_the_shipped_configs_have_the_published_parameter_counts(name, total, active):
    path = CONFIGS / f"{name}.json"
    if name in SHA256:
        assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA256[name]
    cfg = from_hf_config(json.loads(path.read_text()), dtype="bfloat16")
    cost = model_cost(cfg)
    unit = 10.0 ** -len(str(total).split(".")[1])  # the model card's last digit
    assert cost.num_params / 1e9 == pytest.approx(total, abs=unit)
    embed = cfg.vocab_size * cfg.hidden_size  # Qwen's card counts the input embedding as activated
    assert (cost.active_params + (0 if name.startswith("gpt") else embed)) / 1e9 == pytest.approx(active, abs=unit)


def test_plan_cli_on_the_shipped_configs(capsys):
    from peagle_jax.neuron.__main__ import main

    gpt = ["plan", "--model", str(CONFIGS / "gpt-oss-20b.json"), "--k", "10", "--acceptance-length", "3"]
    gpt += ["--experts", "unpacked"]  # packed (the default for GPT-OSS): test_plan_experts_flag
    assert main(gpt) == 0
    out = capsys.readouterr().out
    assert "3.61 B active per token" in out and "released gpt-oss-20b drafter's shape (4 layers" in out
    assert "TP 1, 2, 4, 8; the others are refused: --tp 3 must divide the target's 8 kv heads" in out
    # bf16: 39.0 GiB of target weights; trn1 and inf2 devices hold 16 GiB, trn2's 24 GiB.
    assert "| trn1.2xlarge | 2 | refused: does not fit at TP 2: 23.2 GiB per device" in out
    assert "| trn2.48xlarge | 2 | 23.2 of 24 GiB |" in out and "| trn1.32xlarge | 8 | 9.4 of 16 GiB |" in out
    assert main([*gpt, "--instance", "trn1.2xlarge", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "error: trn1.2xlarge: does not fit at TP 2: 23.2 GiB per device (target weights 20.6" in err
    assert main([*gpt, "--instance", "trn2.48xlarge", "--tp", "16"]) == 2
    assert "--tp 16 must divide the target's 8 kv heads" in capsys.readouterr().err
    # gpt-oss-120b in bf16 (234 GB) fits nowhere: TP stops at its 8 kv heads, 29 GiB per device.
    big = ["plan", "--model", str(CONFIGS / "gpt-oss-120b.json"), "--k", "8", "--acceptance-length", "3"]
    assert main([*big, "--experts", "unpacked"]) == 2
    captured = capsys.readouterr()
    assert "| trn2.48xlarge | 8 | refused: does not fit at TP 8: 31.8 GiB per device" in captured.out
    assert "fits on none of these instances" in captured.err


# A tiny GPT-OSS whose widths are whole MXFP4 blocks: 2 layers, D = F = 32, 4 experts, top-2.
TINY_PACKABLE = {**TINY_MOE, "hidden_size": 32, "intermediate_size": 32, "head_dim": 8}


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("bfloat16", 2)])
def test_packed_experts_count_4_25_bits_per_weight_by_hand(dtype, itemsize):
    cfg = from_hf_config(TINY_PACKABLE, dtype=dtype)
    unpacked = model_cost(cfg, expert_split="experts", tp=2)
    packed = model_cost(cfg, expert_split="experts", tp=2, experts="packed")
    # Per layer: gate_up [4, 2, 32, 32] 8192 + down [4, 32, 32] 4096 = 12288 expert weights: packed, 6144
    # bytes of FP4 codes (two a byte) + 384 E8M0 scales (one per 32 weights) = 6528 bytes = 4.25 bits each.
    saved = 2 * (12288 * itemsize - 6528)
    assert packed.param_bytes == unpacked.param_bytes - saved
    assert packed.weight_bytes == unpacked.weight_bytes - saved
    assert packed.split_param_bytes == unpacked.split_param_bytes - saved
    assert packed.expert_bytes == unpacked.expert_bytes - saved  # what a step reads of the routed experts
    assert (packed.num_params, packed.matmul_params, packed.expert_params) == (
        unpacked.num_params,
        unpacked.matmul_params,
        unpacked.expert_params,
    )
    assert packed.unpack_bytes == 12288 * itemsize and unpacked.unpack_bytes == 0  # one layer, run dtype
    assert (packed.experts, unpacked.experts) == ("packed", "unpacked")
    # The biases (gate_up [4, 64] and down [4, 32] per layer) stay in the run dtype.
    biases = 2 * (256 + 128) * itemsize
    assert packed.expert_bytes == 2 * 6528 + biases
    drafter = ModelCost(0, 0, 0)
    m = plan(packed, drafter, INSTANCES["trn1.32xlarge"], tp=2, k=3, acceptance_length=2, context=0).memory
    assert m.unpack == 12288 * itemsize / 2 and m.total == pytest.approx(packed.memory_per_device(2) + m.unpack)


def test_a_tree_already_packed_counts_as_the_packed_count():
    """A parameter tree holding the experts as uint8 blocks and scales (the packed MoE's own parameters) gives
    the bytes and weights that counting the unpacked tree as packed gives."""
    import jax

    from peagle_jax.neuron.plan import _cost

    cfg = from_hf_config(TINY_PACKABLE)
    u8, f32 = jax.numpy.uint8, jax.numpy.float32
    E, F, D = 4, 32, 32

    def layer(packed):
        shapes = {"gate_up_proj_bias": ((E, 2, F), f32), "down_proj_bias": ((E, D), f32)}
        if packed:
            shapes["gate_up_proj_blocks"] = ((E, 2, F, D // 32, 16), u8)
            shapes["gate_up_proj_scales"] = ((E, 2, F, D // 32), u8)
            shapes["down_proj_blocks"] = ((E, D, F // 32, 16), u8)
            shapes["down_proj_scales"] = ((E, D, F // 32), u8)
        else:
            shapes["gate_up_proj"] = ((E, 2, F, D), f32)
            shapes["down_proj"] = ((E, D, F), f32)
        experts = {name: jax.ShapeDtypeStruct(*shape_dtype) for name, shape_dtype in shapes.items()}
        return {"mlp": {"experts": experts, "router": {"weight": jax.ShapeDtypeStruct((E, D), f32)}}}

    args = (False, 2, 2, 8, f32, None, cfg.moe)
    from_packed = _cost({"layers.0": layer(True), "layers.1": layer(True)}, *args)
    counted = _cost({"layers.0": layer(False), "layers.1": layer(False)}, *args, packed=True)
    assert from_packed == counted and counted.param_bytes == 2 * (6528 + (256 + 128 + 128) * 4)


def test_plan_experts_flag(capsys):
    from peagle_jax.neuron.__main__ import main

    gpt = ["plan", "--model", str(CONFIGS / "gpt-oss-20b.json"), "--k", "10", "--acceptance-length", "3"]
    for flag in ([], ["--experts", "packed"]):  # auto: the config's quantization_config is mxfp4
        assert main([*gpt, *flag, "--instance", "trn1.2xlarge", "--tp", "2"]) == 0
        out = capsys.readouterr().out
        assert "13.76 GB of bfloat16 and MXFP4 parameters" in out  # the hub checkpoint's 13,761,264,768 bytes
        assert "expert matrices: packed MXFP4, 4.25 bits per weight" in out
        assert "| trn1.2xlarge | 2 | 10.9 of 16 GiB |" in out
    assert main([*gpt, "--experts", "unpacked", "--instance", "trn1.2xlarge", "--tp", "2"]) == 2
    assert "does not fit at TP 2: 23.2 GiB per device" in capsys.readouterr().err
    assert main([*gpt, "--instance", "trn1.2xlarge", "--tp", "1"]) == 2  # 12.8 + 2.62 drafter + 1.48 unpacking
    assert "does not fit at TP 1: 17.0 GiB per device (target weights 12.8" in capsys.readouterr().err
    qwen = ["plan", "--model", str(CONFIGS / "Qwen3-Coder-30B-A3B-Instruct.json"), "--acceptance-length", "3"]
    assert main([*qwen, "--experts", "packed"]) == 2
    assert "only GPT-OSS's MXFP4 experts are held packed" in capsys.readouterr().err
    assert main(["plan", "--acceptance-length", "3", "--experts", "packed"]) == 2  # smollm2: dense
    capsys.readouterr()
    assert main(["plan", "--acceptance-length", "3", "--instance", "inf2.xlarge", "--tp", "1"]) == 0  # auto
    assert "MXFP4" not in capsys.readouterr().out
