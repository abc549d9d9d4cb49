"""Random checkpoints in the hub's layout (peagle_jax.models.random_checkpoint): transformers and load_target
load them without a missing or unexpected key, the full-size layouts have the hub's total bytes, the bytes
depend only on the seed, and writing holds one chunk at a time."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from peagle_jax.models import mxfp4
from peagle_jax.models import random_checkpoint as rc
from peagle_jax.models.tensors import open_safetensors

CONFIGS = Path(__file__).resolve().parents[1] / "neuron" / "configs"
TINY = dict(
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
)


def tiny_config(tmp_path: Path, name: str, **extra) -> Path:
    """A published config.json shrunk to two layers of width 64 and a vocabulary of 256 (special ids inside
    it; every other attribute as published)."""
    hf = json.loads((CONFIGS / name).read_text())
    hf.update(TINY)
    hf.update({k: i for i, k in enumerate(("pad_token_id", "bos_token_id", "eos_token_id")) if k in hf})
    if hf["model_type"] == "gpt_oss":
        hf.update(num_local_experts=4, num_experts_per_tok=2, experts_per_token=2, layer_types=hf["layer_types"][:2])
    else:
        hf.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    hf.update(extra)
    path = tmp_path / f"tiny-{name}"
    path.write_text(json.dumps(hf, indent=2))
    return path


@pytest.mark.parametrize(
    "name,total,tensors,files",
    [
        ("gpt-oss-20b.json", 13_761_264_768, 459, 3),
        ("gpt-oss-120b.json", 65_248_815_744, 687, 15),
        ("Qwen3-Coder-30B-A3B-Instruct.json", 61_064_245_248, 18867, 13),
    ],
)
def test_full_size_layouts_have_the_hub_total_size(name, total, tensors, files):
    """The layouts of the published configs, from shapes alone: the totals are the hub indexes' total_size
    (gpt-oss-20b 13.76 GB with MXFP4 experts; gpt-oss-120b; Qwen3-30B-A3B's, which Qwen3-Coder shares)."""
    hf = json.loads((CONFIGS / name).read_text())
    plan = rc.layout(hf, max_shard_size=5 * 10**9)
    assert (plan.total_bytes, plan.num_tensors, len(plan.files)) == (total, tensors, files)
    assert plan.index()["metadata"]["total_size"] == total
    assert all(sum(t.nbytes for t in shard) <= 5 * 10**9 for shard in plan.shards)


def test_gpt_oss_20b_tensors_by_hand():
    """Layer 0's tensors of gpt-oss-20b as the hub lists them: bf16 attention with sinks, router, biases;
    uint8 MXFP4 experts (D 2880 = 90 blocks of 32, E 32, F 2880)."""
    specs = {t.name: t for t in rc.tensor_specs(json.loads((CONFIGS / "gpt-oss-20b.json").read_text()))}
    layer = {n.removeprefix("model.layers.0."): (t.shape, t.dtype) for n, t in specs.items() if ".layers.0." in n}
    assert layer == {
        "input_layernorm.weight": ((2880,), "BF16"),
        "post_attention_layernorm.weight": ((2880,), "BF16"),
        "self_attn.q_proj.weight": ((4096, 2880), "BF16"),
        "self_attn.q_proj.bias": ((4096,), "BF16"),
        "self_attn.k_proj.weight": ((512, 2880), "BF16"),
        "self_attn.k_proj.bias": ((512,), "BF16"),
        "self_attn.v_proj.weight": ((512, 2880), "BF16"),
        "self_attn.v_proj.bias": ((512,), "BF16"),
        "self_attn.o_proj.weight": ((2880, 4096), "BF16"),
        "self_attn.o_proj.bias": ((2880,), "BF16"),
        "self_attn.sinks": ((64,), "BF16"),
        "mlp.router.weight": ((32, 2880), "BF16"),
        "mlp.router.bias": ((32,), "BF16"),
        "mlp.experts.gate_up_proj_blocks": ((32, 5760, 90, 16), "U8"),
        "mlp.experts.gate_up_proj_scales": ((32, 5760, 90), "U8"),
        "mlp.experts.gate_up_proj_bias": ((32, 5760), "BF16"),
        "mlp.experts.down_proj_blocks": ((32, 2880, 90, 16), "U8"),
        "mlp.experts.down_proj_scales": ((32, 2880, 90), "U8"),
        "mlp.experts.down_proj_bias": ((32, 2880), "BF16"),
    }
    assert specs["model.embed_tokens.weight"].shape == specs["lm_head.weight"].shape == (201088, 2880)
    assert specs["model.layers.0.mlp.experts.down_proj_scales"].scale_codes == (119, 121)  # 2**-8 .. 2**-6


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt-oss")
    config = tiny_config(tmp, "gpt-oss-20b.json")
    out = tmp / "model"
    plan = rc.write_checkpoint(config, out, seed=3, max_shard_size=60_000)
    return config, out, plan


def test_files_and_index(tiny_gpt_oss):
    config, out, plan = tiny_gpt_oss
    assert len(plan.files) > 1
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "generation_config.json", "model.safetensors.index.json", *plan.files]
    )
    assert (out / "config.json").read_bytes() == config.read_bytes()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index == plan.index()
    source = open_safetensors(out)
    assert sum(source.nbytes(n) for n in source) == index["metadata"]["total_size"]
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"eos_token_id": 2, "pad_token_id": 0, "transformers_version": "4.55.0.dev0"}  # its own


def test_gpt_oss_generation_config_is_the_published_one():
    hf = json.loads((CONFIGS / "gpt-oss-20b.json").read_text())
    assert rc.generation_config(hf) == {
        "bos_token_id": 199998,
        "do_sample": True,
        "eos_token_id": [200002, 199999, 200012],
        "pad_token_id": 199999,
        "transformers_version": "4.55.0.dev0",
    }


def test_files_hold_what_the_specs_draw(tiny_gpt_oss):
    """Each tensor read back equals rc.array (the generator, whole); the values have the documented law."""
    _, out, plan = tiny_gpt_oss
    source = open_safetensors(out)
    for shard in plan.shards:
        for spec in shard:
            got = source[spec.name]
            np.testing.assert_array_equal(got.view(np.uint8), rc.array(spec, 3).view(np.uint8), err_msg=spec.name)
    scales = source["model.layers.1.mlp.experts.gate_up_proj_scales"]
    assert set(np.unique(scales)) == {119, 120, 121}
    assert np.all(source["model.norm.weight"] == 1)
    weights = source["model.layers.0.self_attn.q_proj.weight"].astype(np.float32)
    assert abs(weights.std() - 0.02) < 0.002
    base = "model.layers.0.mlp.experts.down_proj"
    shard = plan.index()["weight_map"][base + "_blocks"]
    experts = mxfp4.load_dequantized(out / shard, base)  # through safetensors' own reader
    assert np.isfinite(experts).all() and 0.01 < experts.std() < 0.04


def test_same_seed_same_bytes_whatever_the_shards(tiny_gpt_oss, tmp_path):
    config, out, _ = tiny_gpt_oss
    rc.write_checkpoint(config, tmp_path / "one", seed=3)
    rc.write_checkpoint(config, tmp_path / "other", seed=4)
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
    sharded, one, other = (open_safetensors(d) for d in (out, tmp_path / "one", tmp_path / "other"))
    assert list(sharded) == list(one)
    for name in one:
        assert np.array_equal(sharded[name].view(np.uint8), one[name].view(np.uint8)), name
    differ = [n for n in one if not np.array_equal(one[n].view(np.uint8), other[n].view(np.uint8))]
    assert len(differ) == len([n for n in one if not n.endswith("norm.weight")])


def test_load_target_loads_it(tiny_gpt_oss):
    """peagle_jax's loader: every tensor named and shaped as the rules expect; the forward is finite."""
    import jax.numpy as jnp

    from peagle_jax.models import model
    from peagle_jax.models.weights import load_target

    _, out, _ = tiny_gpt_oss
    cfg, params = load_target(out)
    assert cfg.family == "gpt_oss" and cfg.moe.num_experts == 4
    out, _ = model.forward(
        params, model.new_cache(cfg, 1, 16), jnp.arange(12, dtype=jnp.int32)[None], jnp.zeros(1, jnp.int32), cfg=cfg
    )
    assert np.isfinite(np.asarray(out.logits)).all()


def _transformers_load(directory, **kwargs):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True, **kwargs)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not problems, problems
    return model


def test_transformers_loads_it_without_missing_or_unexpected_keys(tiny_gpt_oss):
    """transformers' own loader (MXFP4 dequantized on the CPU) takes every tensor, and its expert parameters
    are the dequantized pairs."""
    torch = pytest.importorskip("torch")
    import transformers

    _, out, plan = tiny_gpt_oss
    model = _transformers_load(out, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32)
    source = open_safetensors(out)
    base = "model.layers.1.mlp.experts.gate_up_proj"
    want = mxfp4.dequantize(source[base + "_blocks"], source[base + "_scales"], np.float32)
    np.testing.assert_array_equal(dict(model.named_parameters())[base].detach().numpy(), want)
    with torch.no_grad():
        logits = model(torch.arange(12)[None]).logits
    assert torch.isfinite(logits).all()


def test_qwen3_moe_per_expert_tensors(tmp_path):
    """A Qwen3-MoE config: per-expert tensors as on the hub, loaded by transformers and load_target."""
    from peagle_jax.models.weights import load_target

    config = tiny_config(tmp_path, "Qwen3-Coder-30B-A3B-Instruct.json")
    out = tmp_path / "model"
    plan = rc.write_checkpoint(config, out)
    names = {t.name for shard in plan.shards for t in shard}
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    _transformers_load(out)
    cfg, _ = load_target(out)
    assert cfg.moe.num_experts == 4


def test_writing_holds_one_chunk(tmp_path, monkeypatch):
    """Peak traced memory while writing stays near one chunk, far below the largest tensor."""
    monkeypatch.setattr(rc, "CHUNK_ELEMENTS", 4096)
    config = tiny_config(tmp_path, "gpt-oss-20b.json", vocab_size=65536)  # embeddings: 8 MiB
    plan = rc.layout(json.loads(config.read_text()))
    largest = max(t.nbytes for shard in plan.shards for t in shard)
    tracemalloc.start()
    try:
        rc.write_checkpoint(config, tmp_path / "model")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert largest == 2 * 65536 * 64
    assert peak < largest / 4, (peak, largest)


def test_cli(tmp_path, capsys):
    config = tiny_config(tmp_path, "gpt-oss-20b.json")
    assert rc.main(["--config", str(config), "--out", str(tmp_path / "m"), "--dry-run"]) == 0
    assert "would write 41 tensors" in capsys.readouterr().out
    assert not (tmp_path / "m").exists()
    assert rc.main(["--config", str(config), "--out", str(tmp_path / "m"), "--max-shard-size", "100KB"]) == 0
    assert "wrote 41 tensors" in capsys.readouterr().out
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    assert rc.main(["--config", str(tmp_path / "none.json"), "--out", str(tmp_path / "n")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert rc.main(["--config", str(config), "--out", str(tmp_path / "n"), "--max-shard-size", "big"]) == 2
