"""Run by tests/test_moe_tensor_parallel.py in a subprocess per family (``gpt_oss`` or ``qwen3_moe``, the
argument) with 8 simulated CPU devices (XLA_FLAGS must be set before jax starts): a tiny random GPT-OSS
(a sliding and a full layer, sinks, biases, YaRN) or Qwen3-MoE (a sparse and a dense layer) target with 8
kv heads and 8 experts, decoded greedily past the sliding window, plainly and speculatively, without a mesh
and at TP = 1, 2, 4, 8 with the experts split whole (``experts``: a P-EAGLE chain) and by width
(``width``: the fused draft-and-verify graph); the expert shard shapes each generator holds; the sharded
decode step exported for neuron and linted; for GPT-OSS the largest collective of a compiled TP 8 decode
step per dispatch and split. Prints one JSON object.

``gpt_oss_packed`` (tests/test_mxfp4_packed.py): the GPT-OSS target with packed MXFP4 experts of width 64
(two blocks of 32 per expert row), plain and speculative without a mesh, at TP 2 split both ways and at
TP 4 and 8 with whole experts; the shard shapes of the packed pairs; the same model unpacked on one device;
and the refusal of a width split that TP does not divide in blocks."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.model import init_drafter_params
from peagle_jax.engine.generator import Generator, decode_step
from peagle_jax.models import model
from peagle_jax.models.config import ModelConfig
from peagle_jax.models.hf_config import from_hf_config
from peagle_jax.neuron.lint import lint_stablehlo
from peagle_jax.platform import static_graphs
from peagle_jax.sampling import SamplingParams
from peagle_jax.sharding import CACHE_SPEC, expert_split, make_mesh, param_shardings, shard_target
from peagle_jax.spec.generator import SpeculativeGenerator

WINDOW = 8
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
}
# A 6-token vocabulary and large weights (as tests/test_moe_targets.py): a random drafter agrees often enough
# for drafts to be accepted; prompt + new tokens run past the window of 8.
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 0, 1, 2], [3, 4, 1]]
NEW = 20
TPS = (1, 2, 4, 8)
SPLITS = ("experts", "width")
EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
PACKED_EXPERT_TENSORS = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


SEEDS = {"gpt_oss": (1, 2), "qwen3_moe": (5, 15)}  # (target, drafter): varied tokens, drafts accepted


def moe_target(family: str):
    """A tiny random target of ``family`` that TP 8 can split every way: 8 kv heads, 8 experts of width 16."""
    hf = dict(
        model_type=family,
        vocab_size=6,
        hidden_size=32,
        intermediate_size=16 if family == "gpt_oss" else 48,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=8,
        num_experts_per_tok=2,
    )
    if family == "gpt_oss":
        hf.update(num_local_experts=8, sliding_window=WINDOW, rope_parameters=YARN)
    else:
        hf.update(num_experts=8, moe_intermediate_size=16, mlp_only_layers=[1], norm_topk_prob=True)
    cfg = from_hf_config(hf)
    abstract = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    return cfg, random_params(abstract, seed=SEEDS[family][0])


def random_params(abstract, seed: int):
    """Parameters of these shapes drawn on the host (no XLA compile of an init): matrices N(0, 0.6) (the
    0.02 init times 30), norm weights one, biases and sinks N(0, 1); packed experts random bytes with
    scales 2**-3 and 2**-2 (values of about 0.6 too)."""
    rng = np.random.RandomState(seed)

    def draw(path, x):
        if x.dtype == np.uint8:
            low, high = (0, 256) if jax.tree_util.keystr(path).endswith("_blocks']") else (124, 126)
            return jnp.asarray(rng.randint(low, high, x.shape), jnp.uint8)
        if x.ndim > 1:
            return jnp.asarray(0.6 * rng.standard_normal(x.shape), x.dtype)
        if "norm" in jax.tree_util.keystr(path):
            return jnp.ones(x.shape, x.dtype)
        return jnp.asarray(rng.standard_normal(x.shape), x.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract)


def drafter(cfg: ModelConfig, seed: int):
    layer = ModelConfig(
        family="llama",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        aux_layer_ids=(0,),
    )
    dcfg = DrafterConfig(
        layer=layer,
        algorithm="peagle",
        mask_token_id=5,
        own_embedding=False,
        target_hidden_size=cfg.hidden_size,
        num_aux=len(cfg.aux_layer_ids),
        aux_layer_ids=cfg.aux_layer_ids,
    )
    return dcfg, random_params(jax.eval_shape(lambda: init_drafter_params(dcfg, jax.random.key(0))), seed=seed)


def decode(cfg, params, dcfg, dparams, mesh, spec: str | None) -> dict:
    """Greedy tokens of plain decoding and, unless ``spec`` is None, of speculative decoding (``"parallel"``:
    a P-EAGLE chain of 3, ``"fused"``: the same drafted and verified in one graph)."""
    kw = dict(max_seq_len=48, prefill_buckets=(16,), batch_buckets=(2,), mesh=mesh)
    gen = dict(max_new_tokens=NEW, stop_token_ids=[])
    plain = Generator(cfg, params, **kw)
    out = {"plain": [r.token_ids for r in plain.generate(PROMPTS, **gen)]}
    if mesh is not None:
        experts = plain.params["layers.0"]["mlp"]["experts"]
        out["shards"] = {
            n: list(experts[n].addressable_shards[0].data.shape)
            for n in EXPERT_TENSORS + PACKED_EXPERT_TENSORS
            if n in experts
        }
    if spec is not None:
        sg = SpeculativeGenerator(cfg, params, dcfg, dparams, k=3, fused=spec == "fused", **kw)
        out[spec] = [r.token_ids for r in sg.generate(PROMPTS, **gen)]
        out["accepted"] = list(sg.spec.accepted_per_position)
        if mesh is not None:
            placed = sg.params["layers.0"]["mlp"]["experts"]
            out["spec_shards_same"] = all(placed[n].sharding == experts[n].sharding for n in out["shards"])
    return out


def largest_collective(cfg, params, mesh, split: str) -> int:
    """Elements of the largest collective (all-reduce, all-gather, all-to-all, reduce-scatter, collective
    permute) in the compiled decode step (B = 2, T = 1)."""
    placed = shard_target(cfg, params, mesh, split)
    cache = jax.device_put(model.new_cache(cfg, 2, 16), NamedSharding(mesh, CACHE_SPEC))
    step = jax.jit(lambda p, c, t, s: model.forward(p, c, t, s, cfg=cfg))
    hlo = step.lower(placed, cache, jnp.zeros((2, 1), jnp.int32), jnp.zeros(2, jnp.int32)).compile().as_text()
    sizes = [0]
    for line in hlo.splitlines():
        found = re.search(r"\b(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(-start)?\(", line)
        if found:
            shapes = line.split("=", 1)[1].split(found[1], 1)[0]
            sizes += [
                int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\[([\d,]*)\]", shapes)
            ]
    return max(sizes)


def export_sharded(cfg, mesh, split: str) -> dict:
    """The TP decode step exported for neuron from sharded abstract inputs: its device count and lint."""
    rep = NamedSharding(mesh, P())

    def sds(x, sharding=rep):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    params = jax.tree.map(sds, params, param_shardings(params, mesh, split))
    cache = jax.eval_shape(lambda: model.new_cache(cfg, 2, 32))
    cache = jax.tree.map(lambda x: sds(x, NamedSharding(mesh, CACHE_SPEC)), cache)
    ints, floats = (
        jax.ShapeDtypeStruct((2,), "int32", sharding=rep),
        jax.ShapeDtypeStruct((2,), "float32", sharding=rep),
    )
    seeds = jax.ShapeDtypeStruct((2,), "uint32", sharding=rep)
    with static_graphs():  # traced branch-free, as peagle_jax.neuron.export traces every graph
        exported = export.export(decode_step, platforms=["neuron"])(
            params,
            cache,
            ints,
            ints,
            seeds,
            SamplingParams(floats, ints, floats),
            cfg=cfg,
            greedy_only=False,
            window=32,
        )
    return {"devices": exported.nr_devices, "findings": [str(f) for f in lint_stablehlo(exported.mlir_module())]}


def main_packed() -> int:
    """The ``gpt_oss_packed`` runs (see the module docstring)."""
    from peagle_jax.errors import UserError
    from peagle_jax.models.weights import unpacked_experts

    assert jax.device_count() == 8, jax.devices()
    cfg, _ = moe_target("gpt_oss")
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, intermediate_size=64, experts="packed"))
    params = random_params(jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0))), SEEDS["gpt_oss"][0])
    dcfg, dparams = drafter(cfg, SEEDS["gpt_oss"][1])
    out = {"devices": jax.device_count(), "runs": {}}
    out["runs"]["none"] = decode(cfg, params, dcfg, dparams, None, "parallel")
    unpacked = unpacked_experts(jax.tree.map(np.asarray, params), "float32")
    out["unpacked"] = decode(cfg.replace(moe=dataclasses.replace(cfg.moe, experts="unpacked")), unpacked, dcfg,
                             dparams, None, None)["plain"]  # fmt: skip
    for tp, split, spec in ((2, "experts", "parallel"), (2, "width", "fused"), (4, "experts", "parallel"),
                            (8, "experts", None)):  # fmt: skip
        mesh = make_mesh(tp)
        out["runs"][f"{tp}-{split}"] = decode(cfg, shard_target(cfg, params, mesh, split), dcfg, dparams, mesh, spec)
    try:
        shard_target(cfg, params, make_mesh(4), "width")
        out["refused"] = None
    except UserError as err:
        out["refused"] = str(err)
    print(json.dumps(out))
    return 0


def main(family: str) -> int:
    assert jax.device_count() == 8, jax.devices()
    cfg, params = moe_target(family)
    dcfg, dparams = drafter(cfg, SEEDS[family][1])
    out = {"devices": jax.device_count(), "family": cfg.family, "runs": {}}
    out["sparse_layers"], out["layer_types"] = list(cfg.moe.sparse_layers), list(cfg.layer_types)
    out["runs"]["none"] = decode(cfg, params, dcfg, dparams, None, None)
    for tp in TPS:
        mesh = make_mesh(tp)
        # At TP 1 nothing is split: one split stands for both, decoding plainly.
        for split in SPLITS[:1] if tp == 1 else SPLITS:
            # Placed with an explicit split, which the generators keep (they place with "auto").
            placed = shard_target(cfg, params, mesh, split)
            spec = None if tp == 1 else "parallel" if split == "experts" else "fused"
            out["runs"][f"{tp}-{split}"] = decode(cfg, placed, dcfg, dparams, mesh, spec)
    mesh = make_mesh(8)
    out["neuron_export"] = {split: export_sharded(cfg, mesh, split) for split in SPLITS}
    if family == "gpt_oss":  # the largest collective of a TP 8 decode step per dispatch and split
        out["collective"] = {}
        for dispatch in ("dense", "gather"):
            c = cfg.replace(moe=dataclasses.replace(cfg.moe, dispatch=dispatch))
            auto = expert_split(8, num_experts=8, expert_width=16, dispatch=dispatch)
            out["collective"][dispatch] = {"auto": auto, **{s: largest_collective(c, params, mesh, s) for s in SPLITS}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main_packed() if sys.argv[1] == "gpt_oss_packed" else main(sys.argv[1]))
