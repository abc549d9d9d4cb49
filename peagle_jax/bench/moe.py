"""``python -m peagle_jax.bench.moe``: the two MoE dispatches side by side, by token count, at real widths.

A mixture-of-experts layer (:class:`peagle_jax.models.moe.MoE`: router, top-k, experts, weighted sum) with
random weights at the widths of GPT-OSS-20B (D 2880, expert width F 2880, 32 experts, top-4, biases and the
clamped SwiGLU) and of Qwen3-30B-A3B (D 2048, F 768, 128 experts, top-8), run on 1..64 tokens (a decode
step of 1..64 rows, a verify of a tree) with each dispatch: ``dense`` (every expert on every token) and
``gather`` (each token's k experts' weights gathered). The dispatches are timed interleaved round by round
(medians) and, from XLA's compiled cost analysis, the bytes each call accesses are set against the
active-parameter bound (the router plus the experts the tokens select, ``min(tokens * k, E)`` experts'
weights: what a call must read at least) and against all of the layer's weights. A variant whose compiled
temporaries exceed ``--max-temp-gib`` (gather materialises ``tokens * k`` experts' weights) is analysed
but not run. Prints a markdown table per model; ``--json FILE`` writes the results too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys

from peagle_jax import errors

DISPATCHES = ("dense", "gather")
PRESETS = {
    "gpt-oss-20b": dict(family="gpt_oss", hidden=2880, expert_width=2880, experts=32, top_k=4),
    "qwen3-30b-a3b": dict(family="qwen3_moe", hidden=2048, expert_width=768, experts=128, top_k=8),
    "tiny-gpt-oss": dict(family="gpt_oss", hidden=64, expert_width=64, experts=16, top_k=2),
    "tiny-qwen3-moe": dict(family="qwen3_moe", hidden=64, expert_width=32, experts=32, top_k=4),
}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One MoE layer's widths: D ``hidden``, F ``expert_width``, E ``experts``, ``top_k``."""

    name: str
    family: str
    hidden: int
    expert_width: int
    experts: int
    top_k: int

    def moe(self, dispatch: str):
        from peagle_jax.models.config import MoEConfig

        return MoEConfig(
            num_experts=self.experts,
            top_k=self.top_k,
            intermediate_size=self.expert_width,
            sparse_layers=(0,),
            norm_topk_prob=True,
            dispatch=dispatch,
        )

    def expert_params(self) -> int:
        """Parameters of one expert: gate and up [2, F, D], down [D, F], and GPT-OSS's biases."""
        F, D = self.expert_width, self.hidden
        return 3 * F * D + (2 * F + D if self.family == "gpt_oss" else 0)

    def router_params(self) -> int:
        return self.experts * self.hidden + (self.experts if self.family == "gpt_oss" else 0)

    def active_params(self, tokens: int) -> int:
        """What a call over ``tokens`` must read at least: the router and the experts the tokens select
        (``tokens * k`` of them, at most all E)."""
        return self.router_params() + min(tokens * self.top_k, self.experts) * self.expert_params()

    def all_params(self) -> int:
        return self.router_params() + self.experts * self.expert_params()


def random_layers(spec: Spec, layers: int, dtype: str, seed: int = 0) -> list:
    """``layers`` MoE layers' parameters, normal with std 0.02 (biases 0.1), generated one expert at a time
    so that no float32 copy of a whole layer exists."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from peagle_jax.models.moe import MoE

    dt = jnp.dtype(dtype)
    module = MoE(spec.moe("dense"), spec.family, dt)
    shapes = jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((1, 1, spec.hidden), dt))
    rng = np.random.default_rng(seed)
    np_dt = ml_dtypes.bfloat16 if dt == jnp.bfloat16 else np.float32

    def fill(path, leaf):
        out = np.empty(leaf.shape, np_dt)
        scale = 0.1 if "bias" in jax.tree_util.keystr(path) else 0.02
        for i in range(leaf.shape[0]):
            out[i] = (rng.standard_normal(leaf.shape[1:], np.float32) * scale).astype(np_dt)
        return jnp.asarray(out)

    return [jax.tree_util.tree_map_with_path(fill, shapes) for _ in range(layers)]


def layer_stack(spec: Spec, dispatch: str, dtype: str):
    """``f(params, x_BTD)``: the MoE layers in turn, each added to the residual stream."""
    import jax.numpy as jnp

    from peagle_jax.models.moe import MoE

    module = MoE(spec.moe(dispatch), spec.family, jnp.dtype(dtype))

    def run(params, x_BTD):
        for p in params:
            x_BTD = x_BTD + module.apply(p, x_BTD)
        return x_BTD

    return run


_DEF = re.compile(r"%(\S+) = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(%?([^,) ]*)")
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8, "f64": 8}


def slice_overcount(hlo_text: str) -> int:
    """Bytes that XLA's cost analysis counts beyond what a selection reads: for a gather it counts the whole
    array the gather takes from (all E experts' weights, as stored: through any convert XLA fused in
    between), and so for a dynamic slice whose operand reaches it through a fused convert (a bf16 expert
    slice for a float32 product), where each reads only the slice it returns. (A dynamic slice of a fusion's
    parameter itself is already counted at the slice.)"""
    defs = {m[1]: m for m in _DEF.finditer(hlo_text)}  # name -> (name, type, dims, op, first operand)

    def elements(dims):
        return math.prod(int(d) for d in dims.split(",") if d)

    extra = 0
    for m in defs.values():
        if m[4] not in ("gather", "dynamic-slice"):
            continue
        source, hops = defs.get(m[5]), 0
        while source is not None and source[4] in ("convert", "bitcast", "copy", "reshape"):
            source, hops = defs.get(source[5]), hops + 1
        if source is not None and (m[4] == "gather" or hops):
            itemsize = _ITEMSIZE.get(source[2], 4)
            extra += max(0, itemsize * (elements(source[3]) - elements(m[3])))
    return extra


def compile_variant(spec: Spec, dispatch: str, dtype: str, params, x_BTD) -> tuple:
    """``(compiled, bytes accessed, temporary bytes)`` of one dispatch from XLA's compiled analyses; bytes
    accessed with each selection counted at the slices it reads (:func:`slice_overcount`)."""
    import jax

    compiled = jax.jit(layer_stack(spec, dispatch, dtype)).lower(params, x_BTD).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    nbytes = float(cost["bytes accessed"]) - slice_overcount(compiled.as_text())
    return compiled, nbytes, int(compiled.memory_analysis().temp_size_in_bytes)


def measure(spec: Spec, params, tokens: int, dtype: str, rounds: int, max_temp: float) -> dict:
    """One token count: each dispatch's bytes, temporaries and (where they fit) median ms."""
    import jax
    import jax.numpy as jnp

    from peagle_jax.bench.linear import interleaved
    from peagle_jax.models.moe import dispatch_for

    x_BTD = jax.random.normal(jax.random.key(tokens), (1, tokens, spec.hidden), jnp.float32).astype(dtype)
    run, result = {}, {"tokens": tokens, "bytes": {}, "temp_bytes": {}, "skipped": {}}
    for dispatch in DISPATCHES:
        compiled, nbytes, temp = compile_variant(spec, dispatch, dtype, params, x_BTD)
        result["bytes"][dispatch], result["temp_bytes"][dispatch] = nbytes, temp
        if temp > max_temp:
            result["skipped"][dispatch] = f"temporaries {temp / 2**30:.1f} GiB > --max-temp-gib"
        else:
            run[dispatch] = compiled
    ms = interleaved(run, (params, x_BTD), rounds) if run else {}
    result["ms"] = {d: ms.get(d) for d in DISPATCHES}
    both = all(result["ms"].values())
    result["gather_over_dense"] = result["ms"]["gather"] / result["ms"]["dense"] if both else None
    itemsize = jnp.dtype(dtype).itemsize
    layers = len(params)
    result["active_bound_bytes"] = spec.active_params(tokens) * itemsize * layers
    result["all_bytes"] = spec.all_params() * itemsize * layers
    result["auto"] = dispatch_for(tokens, spec.moe("auto"))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.moe", description=__doc__.split("\n")[0])
    p.add_argument(
        "--models",
        default="gpt-oss-20b,qwen3-30b-a3b",
        help=f"comma-separated widths from {', '.join(PRESETS)} (default gpt-oss-20b,qwen3-30b-a3b)",
    )
    p.add_argument("--tokens", default="1,2,4,8,16,32,64", help="token counts per call, comma-separated")
    p.add_argument("--layers", type=int, default=1, help="MoE layers per call (default 1)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per token count (default 5)")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and inputs (default float32)"
    )
    p.add_argument(
        "--max-temp-gib", type=float, default=1.5, help="run no variant with more temporaries than this (default 1.5)"
    )
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def _table(model: dict) -> str:
    gib = 2**30
    lines = [
        f"### {model['name']}: D {model['hidden']}, F {model['expert_width']}, E {model['experts']}, "
        f"top-{model['top_k']}, {model['all_bytes'] / gib:.2f} GiB of weights\n",
        "| tokens | dense | gather | gather / dense | dense bytes / bound | gather bytes / bound | "
        "bound / all weights | auto |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in model["results"]:
        ms = {d: f"{r['ms'][d]:.2f} ms" if r["ms"][d] else "not run" for d in DISPATCHES}
        ratio = f"{r['gather_over_dense']:.2f}x" if r["gather_over_dense"] else "-"
        bound = r["active_bound_bytes"]
        lines.append(
            f"| {r['tokens']} | {ms['dense']} | {ms['gather']} | {ratio} | {r['bytes']['dense'] / bound:.2f} "
            f"| {r['bytes']['gather'] / bound:.2f} | {bound / r['all_bytes']:.2f} | {r['auto']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        names = errors.comma_list(args.models, "--models", ",".join(PRESETS))
        unknown = [n for n in names if n not in PRESETS]
        if unknown:
            raise errors.UserError(f"unknown --models {', '.join(unknown)}; choose from {', '.join(PRESETS)}")
        tokens = errors.comma_ints(args.tokens, "--tokens", "1,64", minimum=1)
        errors.at_least(1, {"--rounds": args.rounds, "--layers": args.layers})
    except errors.UserError as err:
        return errors.report(err)
    from tqdm import tqdm

    models = []
    for name in names:
        spec = Spec(name, **PRESETS[name])
        params = random_layers(spec, args.layers, args.dtype)
        results = [
            measure(spec, params, t, args.dtype, args.rounds, args.max_temp_gib * 2**30)
            for t in tqdm(tokens, desc=name, file=sys.stderr)
        ]
        del params
        model = {**dataclasses.asdict(spec), "results": results}
        model["all_bytes"] = results[0]["all_bytes"]
        models.append(model)
        print(_table(model) + "\n")
    print(f"{args.dtype}, {args.layers} layer(s), median of {args.rounds} interleaved rounds")
    print("bytes: XLA's cost analysis, each gather or dynamic slice counted at the slices it reads")
    if args.json:
        with open(args.json, "w") as f:
            out = {"dtype": args.dtype, "layers": args.layers, "rounds": args.rounds, "models": models}
            json.dump({**out, "max_temp_gib": args.max_temp_gib}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
