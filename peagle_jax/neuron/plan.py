"""Roofline planner: lower bounds on the time of a decoding step on a Neuron instance, with and without
speculation, from the model's bytes and FLOPs and the instance's memory bandwidth and compute.

The model (one step, batch ``B``, TP over ``tp`` devices, weights and KV cache split evenly across them):

- bytes read per device: the target's weights (all parameters; an untied input embedding is gathered a
  few rows at a time, so it is left out) plus the KV cache of ``context`` tokens per row, over ``tp``;
- FLOPs per device: ``2 x matmul parameters x tokens`` (tokens = ``B`` for a plain step, ``B x (T)``
  for a verify over the root and ``T - 1`` tree nodes) over ``tp``;
- time = max(bytes / bandwidth, FLOPs / compute) per graph; a speculative step is one verify plus the
  drafter (replicated, so each device reads all its weights; one pass for P-EAGLE, K for EAGLE-3);
- tokens/s = ``B / plain step`` and ``B x AL / speculative step`` (AL = acceptance length, tokens per
  target forward).

Collectives (TP all-reduces), kernel launches and host work are ignored: these are bounds, not
predictions. Devices are what jax-neuronx exposes: NeuronCores (trn1 / inf2: 2 per chip) or logical
NeuronCores (trn2 at its default LNC=2: 4 per chip); a device gets its chip's bandwidth and compute
divided by that count.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from peagle_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Instance:
    chips: int
    devices_per_chip: int  # jax devices per chip (NeuronCores, or logical NeuronCores on trn2)
    hbm_bytes_per_s: float  # per chip
    bf16_flops: float  # per chip, dense
    hbm_gib: float  # per chip
    source: str


GIB = 1024**3
# Per-chip numbers from the AWS Neuron architecture pages:
# - Inferentia2: 2 NeuronCore-v2, 190 BF16 TFLOPS, 32 GiB HBM at 820 GiB/s
#   https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/inferentia2.html
# - Trainium: 2 NeuronCore-v2, 190 BF16 TFLOPS, 32 GiB at 820 GiB/s; trn1.2xlarge 1 chip, trn1.32xlarge 16
#   https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/trainium.html
#   https://awsdocs-neuron.readthedocs-hosted.com/en/v2.9.1/general/arch/neuron-hardware/trn1-arch.html
# - Trainium2: 8 NeuronCore-v3, 667 BF16 TFLOPS, 96 GiB HBM at 2.9 TB/s; trn2.48xlarge has 16 chips; the
#   default logical NeuronCore config (LNC=2) pairs cores, so jax sees 4 devices per chip
#   https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/trainium2.html
#   https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/arch/trainium2_arch.html
INSTANCES = {
    "inf2.xlarge": Instance(1, 2, 820 * GIB, 190e12, 32, "Inferentia2 architecture page"),
    "trn1.2xlarge": Instance(1, 2, 820 * GIB, 190e12, 32, "Trainium / Trn1 architecture pages"),
    "trn1.32xlarge": Instance(16, 2, 820 * GIB, 190e12, 32, "Trainium / Trn1 architecture pages"),
    "trn2.48xlarge": Instance(16, 4, 2.9e12, 667e12, 96, "Trainium2 architecture pages (LNC=2)"),
}


@dataclasses.dataclass(frozen=True)
class ModelCost:
    weight_bytes: int  # bytes read per step (see module doc)
    matmul_params: int  # parameters in matrix products per token
    kv_bytes_per_token: int  # KV cache bytes per token of context (all layers, K and V)


def model_cost(cfg, params=None) -> ModelCost:
    """Bytes and matmul parameters of a target or drafter config, from ``jax.eval_shape`` of its init."""
    from peagle_jax.models import model

    if params is None:
        params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    return _cost(
        params,
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.tie_word_embeddings,
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.jnp_dtype,
    )


def drafter_cost(dcfg, params=None) -> ModelCost:
    from peagle_jax.drafter.model import init_drafter_params

    if params is None:
        params = jax.eval_shape(lambda: init_drafter_params(dcfg, jax.random.key(0)))
    lc = dcfg.layer
    return _cost(
        params, lc.vocab_size, lc.hidden_size, False, lc.num_layers, lc.num_kv_heads, lc.head_dim, lc.jnp_dtype
    )


def _cost(params, V, D, tied, L, G, H, dtype) -> ModelCost:
    leaves = jax.tree_util.tree_leaves_with_path(params)
    total = sum(x.size * x.dtype.itemsize for _, x in leaves)
    embed = [x for p, x in leaves if "embed_tokens" in jax.tree_util.keystr(p)]
    embed_bytes = sum(x.size * x.dtype.itemsize for x in embed)
    matrices = sum(x.size for _, x in leaves if x.ndim >= 2)
    itemsize = jax.numpy.dtype(dtype).itemsize
    if tied:  # the embedding is read whole as the LM head, and is a matmul
        weight_bytes = total
    else:  # the input embedding is only gathered
        weight_bytes = total - embed_bytes
        matrices -= sum(x.size for x in embed)
    return ModelCost(int(weight_bytes), int(matrices), int(2 * L * G * H * itemsize))


@dataclasses.dataclass(frozen=True)
class Plan:
    plain_step_s: float
    plain_tokens_per_s: float
    verify_s: float
    draft_s: float
    spec_step_s: float
    spec_tokens_per_s: float
    speedup: float
    bound: dict  # which limit binds each graph: "memory" or "compute"


def roofline(bytes_, flops, bw, compute):
    t_mem, t_cmp = bytes_ / bw, flops / compute
    return max(t_mem, t_cmp), ("memory" if t_mem >= t_cmp else "compute")


def plan(
    target: ModelCost,
    drafter: ModelCost,
    instance: Instance,
    *,
    tp: int,
    k: int,
    acceptance_length: float,
    batch: int = 1,
    context: int = 1024,
    tree_size: int | None = None,
    sequential: bool = False,
) -> Plan:
    """The bounds for one configuration (see the module doc)."""
    devices = instance.chips * instance.devices_per_chip
    if not 1 <= tp <= devices:
        raise UserError(f"--tp {tp}: the instance has {devices} devices (NeuronCores as jax sees them)")
    if not 1 <= acceptance_length <= k + 1:
        raise UserError(f"--acceptance-length must be in 1..K+1 = 1..{k + 1}, got {acceptance_length}")
    bw = instance.hbm_bytes_per_s / instance.devices_per_chip
    compute = instance.bf16_flops / instance.devices_per_chip
    kv = target.kv_bytes_per_token * context * batch
    T = (tree_size if tree_size is not None else k) + 1
    plain, plain_bound = roofline((target.weight_bytes + kv) / tp, 2 * target.matmul_params * batch / tp, bw, compute)
    verify_s, verify_bound = roofline(
        (target.weight_bytes + kv) / tp, 2 * target.matmul_params * batch * T / tp, bw, compute
    )
    # Draft: the drafter is replicated; P-EAGLE runs one pass over C + K - 1 <= 2K elements, EAGLE-3 K passes.
    passes, rows = (k, 1) if sequential else (1, 2 * k)
    one_pass, draft_bound = roofline(drafter.weight_bytes, 2 * drafter.matmul_params * batch * rows, bw, compute)
    draft_s = passes * one_pass
    spec_step = verify_s + draft_s
    plain_tps = batch / plain
    spec_tps = batch * acceptance_length / spec_step
    return Plan(
        plain,
        plain_tps,
        verify_s,
        draft_s,
        spec_step,
        spec_tps,
        spec_tps / plain_tps,
        {"plain": plain_bound, "verify": verify_bound, "draft": draft_bound},
    )


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="roofline bound on step time and tokens/s on a Neuron instance")
    p.add_argument("--model", default="smollm2", help="target model directory, or 'smollm2' (default)")
    p.add_argument(
        "--drafter",
        help="drafter directory (default: the shipped drafter for smollm2, else a 2-layer P-EAGLE drafter of the "
        "target's shape)",
    )
    p.add_argument("--instance", required=True, choices=sorted(INSTANCES), help="instance type")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (NeuronCores) (default 1)")
    p.add_argument("--k", type=int, default=7, help="draft tokens per step (default 7)")
    p.add_argument("--acceptance-length", type=float, required=True, help="tokens emitted per target forward")
    p.add_argument("--batch", type=int, default=1, help="batch rows (default 1)")
    p.add_argument("--context", type=int, default=1024, help="tokens of context in the KV cache (default 1024)")
    p.add_argument("--sequential", action="store_true", help="EAGLE-3 drafting: K drafter passes")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights (default bf16)")


def run_plan(args) -> int:
    from peagle_jax.loading import configs

    if args.k < 1 or args.batch < 1 or args.context < 0:
        raise UserError("--k and --batch must be >= 1 and --context >= 0")
    cfg, dcfg, _ = configs(args.model, args.drafter, args.dtype)
    if cfg.num_kv_heads % args.tp:
        raise UserError(
            f"--tp {args.tp} must divide the target's {cfg.num_kv_heads} kv heads (tensor parallelism shards them)"
        )
    inst = INSTANCES[args.instance]
    target, drafter = model_cost(cfg), drafter_cost(dcfg)
    r = plan(
        target,
        drafter,
        inst,
        tp=args.tp,
        k=args.k,
        acceptance_length=args.acceptance_length,
        batch=args.batch,
        context=args.context,
        sequential=args.sequential,
    )
    per_device = (target.weight_bytes + target.kv_bytes_per_token * args.context * args.batch) / args.tp
    print(
        f"{args.instance}: TP {args.tp}, per device {inst.hbm_bytes_per_s / inst.devices_per_chip / 1e9:.0f} GB/s, "
        f"{inst.bf16_flops / inst.devices_per_chip / 1e12:.1f} BF16 TFLOPS ({inst.source})"
    )
    print(
        f"target: {target.weight_bytes / 1e6:.1f} MB of weights read per step, {per_device / 1e6:.1f} MB per device "
        f"with the KV cache of {args.context} tokens x {args.batch} rows"
    )
    print(f"drafter: {drafter.weight_bytes / 1e6:.1f} MB (replicated)")
    print("| | step bound | tokens/s bound | limited by |\n|---|---|---|---|")
    print(f"| plain decode | {r.plain_step_s * 1e3:.3f} ms | {r.plain_tokens_per_s:.0f} | {r.bound['plain']} |")
    print(
        f"| speculative (K={args.k}, AL={args.acceptance_length}) | {r.spec_step_s * 1e3:.3f} ms "
        f"(verify {r.verify_s * 1e3:.3f} + draft {r.draft_s * 1e3:.3f}) | {r.spec_tokens_per_s:.0f} "
        f"| verify {r.bound['verify']}, draft {r.bound['draft']} |"
    )
    print(f"speculative / plain tokens/s bound: {r.speedup:.2f}x")
    if target.weight_bytes / args.tp > inst.hbm_gib * GIB / inst.devices_per_chip:
        print("warning: the weights do not fit in one device's share of HBM at this TP")
    return 0 if math.isfinite(r.speedup) else 1
