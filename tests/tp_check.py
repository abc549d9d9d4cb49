"""Run by tests/test_tensor_parallel.py in a subprocess with 8 simulated CPU devices (XLA_FLAGS must be
set before jax starts, hence a separate process): greedy tokens of plain and speculative decoding on a tiny
random model with 8 kv heads, without a mesh and at TP = 1, 2, 4, 8. Prints one JSON object."""

from __future__ import annotations

import json
import sys

import jax
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from peagle_jax.drafter.config import random_drafter_config
from peagle_jax.drafter.model import init_drafter_params
from peagle_jax.engine.generator import Generator, decode_step
from peagle_jax.models import model
from peagle_jax.models.config import ModelConfig
from peagle_jax.neuron.lint import lint_stablehlo
from peagle_jax.platform import static_graphs
from peagle_jax.sampling import SamplingParams
from peagle_jax.sharding import CACHE_SPEC, make_mesh, param_shardings
from peagle_jax.spec.generator import SpeculativeGenerator

CFG = ModelConfig(
    family="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=16,
    num_kv_heads=8,
    head_dim=8,
    rms_norm_eps=1e-5,
)
PROMPTS = [[5, 17, 33, 2, 99, 140, 7], [201, 3, 3, 8]]
NEW = 12
# Speculative variants per TP (each compiles its own graphs; together they cover every variant at TP > 1).
VARIANTS = {
    None: ("parallel",),
    1: ("parallel",),
    2: ("sharded_drafter",),
    4: ("fused",),
    8: ("parallel", "fused"),
}


def export_sharded(mesh) -> dict:
    """The TP decode step exported for neuron from sharded abstract inputs: its device count and lint."""
    rep = NamedSharding(mesh, P())

    def sds(x, sharding=rep):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    params = jax.eval_shape(lambda: model.init_params(CFG, jax.random.key(0)))
    params = jax.tree.map(sds, params, param_shardings(params, mesh))
    cache = jax.tree.map(
        lambda x: sds(x, NamedSharding(mesh, CACHE_SPEC)), jax.eval_shape(lambda: model.new_cache(CFG, 2, 64))
    )
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
            cfg=CFG,
            greedy_only=False,
            window=64,
        )
    return {"devices": exported.nr_devices, "findings": [str(f) for f in lint_stablehlo(exported.mlir_module())]}


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    params = model.init_params(CFG, jax.random.key(0))
    dcfg = random_drafter_config(CFG)
    dparams = init_drafter_params(dcfg, jax.random.key(1))
    out = {"devices": jax.device_count(), "runs": {}}
    kw = dict(max_seq_len=64, prefill_buckets=(16,), batch_buckets=(2,))
    for tp in (None, 1, 2, 4, 8):
        mesh = None if tp is None else make_mesh(tp)
        plain = Generator(CFG, params, mesh=mesh, **kw)
        runs = {"plain": [r.token_ids for r in plain.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[])]}
        for name in VARIANTS[tp]:
            extra = {"parallel": {}, "fused": {"fused": True}, "sharded_drafter": {"shard_drafter": True}}[name]
            spec = SpeculativeGenerator(CFG, params, dcfg, dparams, k=3, mesh=mesh, **extra, **kw)
            runs[name] = [r.token_ids for r in spec.generate(PROMPTS, max_new_tokens=NEW, stop_token_ids=[])]
        if mesh is not None:
            qkv = plain.params["layers.0"]["self_attn"]["qkv_proj"]["weight"]
            _, cache = plain.prefill(PROMPTS, 2)
            runs["qkv_shard_shape"] = list(qkv.addressable_shards[0].data.shape)
            runs["cache_sharded_on_kv_heads"] = cache.k[0].sharding.is_equivalent_to(NamedSharding(mesh, CACHE_SPEC), 4)
        out["runs"]["none" if tp is None else str(tp)] = runs
    out["tp8_neuron_export"] = export_sharded(make_mesh(8))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
