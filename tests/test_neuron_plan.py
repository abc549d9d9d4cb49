"""The roofline planner against hand-computed cases."""

from __future__ import annotations

import pytest

from peagle_jax.errors import UserError
from peagle_jax.models.config import ModelConfig
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
    assert "| plain decode |" in out and "speculative / plain tokens/s bound" in out
    # 2 kv heads: TP 4 cannot shard them.
    assert (
        main(["plan", "--model", model_dir, "--instance", "trn1.32xlarge", "--tp", "4", "--acceptance-length", "2"])
        == 2
    )
    assert "must divide" in capsys.readouterr().err
