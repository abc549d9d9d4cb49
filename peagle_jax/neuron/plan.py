"""Planner: what one device holds, and lower bounds on the time of a decoding step on a Neuron instance,
with and without speculation, from the model's bytes and FLOPs and the instance's memory and compute.

The model (one step, batch ``B``, TP over ``tp`` devices):

- memory per device: the target's parameters, every expert included (what :mod:`peagle_jax.sharding`
  splits over ``tp``, the rest whole: embedding, LM head, norms, routers), its KV cache of ``context``
  tokens per row split on the kv heads, and the replicated drafter with its KV cache. A TP or instance
  where that exceeds one device's share of HBM is refused, with the numbers;
- bytes read per device: the target's weights (an untied input embedding is gathered a few rows at a
  time, so it is left out) plus its KV cache, the split part over ``tp``. For a mixture of experts the
  bound reads only the experts the step's tokens route to: with ``n`` tokens (``B`` for a plain step,
  ``B x T`` for a verify) each routed to ``k`` of ``E`` experts, uniformly and independently, a layer reads
  ``E (1 - (1 - k/E)^n)`` experts in expectation (``k`` at one token, all ``E`` as ``n`` grows);
- FLOPs per device: ``2 x active matmul parameters x tokens`` (active: the router and ``k`` of ``E``
  experts per token; tokens = ``B`` for a plain step, ``B x T`` for a verify over the root and ``T - 1``
  tree nodes), the split part over ``tp``;
- time = max(bytes / bandwidth, FLOPs / compute) per graph; a speculative step is one verify plus the
  drafter (replicated, so each device reads all its weights; one pass for P-EAGLE, K for EAGLE-3);
- tokens/s = ``B / plain step`` and ``B x AL / speculative step`` (AL = acceptance length, tokens per
  target forward).

Packed experts (``experts="packed"``, GPT-OSS's MXFP4 checkpoints held as they are stored,
:class:`peagle_jax.models.config.MoEConfig`): every expert matrix counts 4.25 bits per weight (a 4-bit FP4
code, plus one 8-bit E8M0 scale per block of 32 weights: :data:`PACKED_BYTES_PER_WEIGHT`) in memory and in
the bytes a step reads; biases, routers and the rest stay in the run dtype. The bound assumes each product
reads the packed bytes (the unpacking fused into it); memory adds one layer's experts unpacked in the run
dtype, split over ``tp`` (:attr:`ModelCost.unpack_bytes`: the scratch of a call that unpacks every expert
of a layer, as the dense dispatch does).

Collectives (TP all-reduces), kernel launches and host work are ignored: these are bounds, not
predictions. Devices are what jax-neuronx exposes: NeuronCores (trn1 / inf2: 2 per chip) or logical
NeuronCores (trn2 at its default LNC=2: 4 per chip); a device gets its chip's bandwidth, compute and HBM
divided by that count.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from jax.sharding import PartitionSpec

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
# MXFP4: a 4-bit FP4 (E2M1) code per weight plus one 8-bit E8M0 scale per block of 32 weights = 4.25 bits.
PACKED_BYTES_PER_WEIGHT = (4 + 8 / 32) / 8
EXPERT_FORMATS = ("auto", "packed", "unpacked")
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
    """Bytes and matmul parameters of a model (see the module doc). The ``split_*`` parts are what tensor
    parallelism divides over the devices (None: all of it); the ``expert_*`` parts, of a mixture of experts,
    are the routed experts of every sparse layer, all E of them."""

    weight_bytes: int  # bytes read per step reading every expert
    matmul_params: int  # parameters in matrix products per token, every expert counted
    kv_bytes_per_token: int  # KV cache bytes per token of context (all layers, K and V)
    param_bytes: int | None = None  # all parameters, in memory (None: weight_bytes)
    split_bytes: int | None = None  # of weight_bytes
    split_param_bytes: int | None = None  # of param_bytes
    split_matmul_params: int | None = None  # of matmul_params
    expert_bytes: int = 0  # of weight_bytes (and of split_bytes: every split of the experts divides them)
    expert_params: int = 0  # of matmul_params (and of split_matmul_params)
    num_experts: int = 0
    top_k: int = 0
    num_params: int = 0  # all parameters
    unpack_bytes: int = 0  # packed experts: one layer's experts in the run dtype (scratch, split over TP)
    experts: str = "unpacked"  # how the expert matrices are counted: "unpacked" (run dtype) or "packed" (MXFP4)

    def experts_read(self, tokens: int) -> float:
        """The expected number of distinct experts a layer reads for ``tokens`` tokens, each routed to
        ``top_k`` of E uniformly: ``E (1 - (1 - k/E)^tokens)`` (k for one token, all E as tokens grow)."""
        E, k = self.num_experts, self.top_k
        return E * (1 - (1 - k / E) ** tokens) if E else 0.0

    def read_bytes_per_device(self, tokens: int, tp: int) -> float:
        """Weight bytes a device reads in a step over ``tokens`` tokens: the experts only as far as
        :meth:`experts_read`, the TP-split part over ``tp``."""
        split = self.weight_bytes if self.split_bytes is None else self.split_bytes
        unread = self.expert_bytes * (1 - self.experts_read(tokens) / self.num_experts) if self.num_experts else 0
        return (split - unread) / tp + (self.weight_bytes - split)

    @property
    def active_params(self) -> float:
        """Matmul parameters per token: the router and ``top_k`` of E experts (all of a dense model)."""
        if not self.num_experts:
            return self.matmul_params
        return self.matmul_params - self.expert_params * (1 - self.top_k / self.num_experts)

    def flops_per_device(self, tokens: int, tp: int) -> float:
        split = self.matmul_params if self.split_matmul_params is None else self.split_matmul_params
        inactive = self.expert_params * (1 - self.top_k / self.num_experts) if self.num_experts else 0
        return 2 * tokens * ((split - inactive) / tp + (self.matmul_params - split))

    def memory_per_device(self, tp: int) -> float:
        """Bytes of parameters one device holds at ``tp`` (all of them: memory counts every expert)."""
        total = self.weight_bytes if self.param_bytes is None else self.param_bytes
        split = total if self.split_param_bytes is None else self.split_param_bytes
        return split / tp + (total - split)


def model_cost(cfg, params=None, expert_split: str = "auto", tp: int = 1, experts: str = "unpacked") -> ModelCost:
    """Bytes and matmul parameters of a target config, from ``jax.eval_shape`` of its init; which parameters
    TP splits is what :func:`peagle_jax.sharding.param_shardings` places at ``tp`` (the experts as
    ``expert_split`` resolves there). ``experts="packed"`` counts the expert matrices as MXFP4 (see the module
    doc; :func:`check_packed` says where that is possible)."""
    if experts == "packed":
        check_packed(cfg)
    from peagle_jax.models import model
    from peagle_jax.neuron.graphs import abstract_mesh
    from peagle_jax.sharding import param_shardings, target_dispatch

    if params is None:
        params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    shardings = param_shardings(params, abstract_mesh(tp), expert_split, target_dispatch(cfg))
    split = [s.spec != PartitionSpec() for s in jax.tree.leaves(shardings)]
    return _cost(
        params,
        cfg.tie_word_embeddings,
        cfg.num_layers,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.jnp_dtype,
        split,
        cfg.moe,
        packed=experts == "packed",
    )


def check_packed(cfg) -> None:
    """Refuse packed experts where the project keeps them unpacked: outside GPT-OSS (the MXFP4 checkpoints),
    or widths that are not whole blocks of 32."""
    if cfg.moe is None or cfg.family != "gpt_oss":
        raise UserError(f"--experts packed: only GPT-OSS's MXFP4 experts are held packed, not {cfg.family}'s")
    for what, width in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.moe.intermediate_size)):
        if width % 32:
            raise UserError(f"--experts packed: MXFP4 blocks of 32 need {what} a multiple of 32, got {width}")


def checkpoint_experts(model: str) -> str:
    """``"packed"`` where ``--model``'s config.json (a file, or a directory's) says its experts are MXFP4
    (``quantization_config.quant_method == "mxfp4"``, GPT-OSS on the hub), else ``"unpacked"``."""
    import json

    path = Path(model)
    path = path if path.suffix == ".json" else path / "config.json"
    try:
        quant = json.loads(path.read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return "unpacked"  # smollm2, or a config the target loader reports on
    return "packed" if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4" else "unpacked"


def drafter_cost(dcfg, params=None) -> ModelCost:
    """The drafter's bytes and matmul parameters; it is replicated, so nothing is split."""
    from peagle_jax.drafter.model import init_drafter_params

    if params is None:
        params = jax.eval_shape(lambda: init_drafter_params(dcfg, jax.random.key(0)))
    lc = dcfg.layer
    return _cost(params, False, lc.num_layers, lc.num_kv_heads, lc.head_dim, lc.jnp_dtype, None, None)


def _cost(params, tied, L, G, H, dtype, split, moe, packed: bool = False) -> ModelCost:
    """``split``: per leaf, whether TP splits it (None: nothing is split). ``packed``: the expert matrices
    (``gate_up_proj``, ``down_proj``) count :data:`PACKED_BYTES_PER_WEIGHT` bytes per weight; a tree that
    holds them packed already (uint8 ``*_blocks``, two weights a byte, and ``*_scales``) counts its bytes
    as they are, and its weights from the blocks."""
    count = weight = param = split_w = split_p = matmul = split_m = expert_b = expert_p = unpack = 0
    itemsize = jax.numpy.dtype(dtype).itemsize
    leaves = jax.tree_util.tree_leaves_with_path(params)
    for (path, x), is_split in zip(leaves, split or [False] * len(leaves), strict=True):
        key = jax.tree_util.keystr(path)
        name = str(getattr(path[-1], "key", path[-1]))
        in_experts = "experts" in key
        weights = x.size
        if in_experts and name.endswith(("_blocks", "_scales")):  # a packed tree: uint8 codes and scales
            weights = 2 * x.size if name.endswith("_blocks") else 0
            name = name.rsplit("_", 1)[0] if name.endswith("_blocks") else name
        nbytes = x.size * x.dtype.itemsize
        expert_matrix = in_experts and name in ("gate_up_proj", "down_proj")
        if expert_matrix and packed and x.dtype != jax.numpy.uint8:
            nbytes = round(x.size * PACKED_BYTES_PER_WEIGHT)
        if expert_matrix and (packed or x.dtype == jax.numpy.uint8):
            unpack += weights * itemsize
        is_matrix = weights and x.ndim >= 2 and not name.endswith("bias") and x.dtype != jax.numpy.bool_
        gathered = "embed_tokens" in key and not tied  # an untied input embedding: a few rows gathered
        is_expert = in_experts and is_split
        count += weights
        param += nbytes
        split_p += nbytes if is_split else 0
        if gathered:
            continue
        weight += nbytes
        split_w += nbytes if is_split else 0
        expert_b += nbytes if is_expert else 0
        if is_matrix:
            matmul += weights
            split_m += weights if is_split else 0
            expert_p += weights if is_expert and expert_matrix else 0
    sparse = len(moe.sparse_layers) if moe is not None else 0
    return ModelCost(
        weight_bytes=int(weight),
        matmul_params=int(matmul),
        kv_bytes_per_token=int(2 * L * G * H * itemsize),
        param_bytes=int(param),
        split_bytes=int(split_w),
        split_param_bytes=int(split_p),
        split_matmul_params=int(split_m),
        expert_bytes=int(expert_b),
        expert_params=int(expert_p),
        num_experts=moe.num_experts if moe is not None else 0,
        top_k=moe.top_k if moe is not None else 0,
        num_params=int(count),
        unpack_bytes=int(unpack // sparse) if sparse else 0,
        experts="packed" if unpack else "unpacked",
    )


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes one device holds: the target's weights (its TP share), its KV cache (split on the kv heads),
    the replicated drafter with its own KV cache, and for packed experts the unpacking scratch."""

    target: float
    kv_cache: float
    drafter: float
    capacity: float  # one device's share of its chip's HBM
    unpack: float = 0.0  # packed experts: one layer's experts unpacked (ModelCost.unpack_bytes / tp)

    @property
    def total(self) -> float:
        return self.target + self.kv_cache + self.drafter + self.unpack

    def __str__(self) -> str:
        unpack = f" + unpacking {self.unpack / GIB:.2f}" if self.unpack else ""
        return (
            f"{self.total / GIB:.1f} GiB per device (target weights {self.target / GIB:.1f} + KV cache "
            f"{self.kv_cache / GIB:.2f} + drafter {self.drafter / GIB:.2f}{unpack}) of {self.capacity / GIB:.0f} GiB"
        )


def memory(target: ModelCost, drafter: ModelCost, instance: Instance, *, tp: int, tokens: int) -> Memory:
    """What one device holds with ``tokens`` tokens (context x batch rows) in both KV caches."""
    return Memory(
        target.memory_per_device(tp),
        target.kv_bytes_per_token * tokens / tp,
        drafter.memory_per_device(1) + drafter.kv_bytes_per_token * tokens,
        instance.hbm_gib * GIB / instance.devices_per_chip,
        target.unpack_bytes / tp,
    )


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
    memory: Memory


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
    """The bounds for one configuration (see the module doc); a :class:`UserError` when the model does not
    fit in a device's HBM at this TP."""
    devices = instance.chips * instance.devices_per_chip
    if not 1 <= tp <= devices:
        raise UserError(f"--tp {tp}: the instance has {devices} devices (NeuronCores as jax sees them)")
    if not 1 <= acceptance_length <= k + 1:
        raise UserError(f"--acceptance-length must be in 1..K+1 = 1..{k + 1}, got {acceptance_length}")
    mem = memory(target, drafter, instance, tp=tp, tokens=context * batch)
    if mem.total > mem.capacity:
        raise UserError(f"does not fit at TP {tp}: {mem}")
    bw = instance.hbm_bytes_per_s / instance.devices_per_chip
    compute = instance.bf16_flops / instance.devices_per_chip
    kv = target.kv_bytes_per_token * context * batch / tp
    T = (tree_size if tree_size is not None else k) + 1

    def target_step(tokens):
        return roofline(target.read_bytes_per_device(tokens, tp) + kv, target.flops_per_device(tokens, tp), bw, compute)

    plain, plain_bound = target_step(batch)
    verify_s, verify_bound = target_step(batch * T)
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
        mem,
    )


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="memory per device and roofline bounds on step time and tokens/s on Neuron")
    p.add_argument(
        "--model",
        default="smollm2",
        help="target model directory, a config.json file (neuron/configs/ has GPT-OSS and Qwen3-Coder), or "
        "'smollm2' (default)",
    )
    p.add_argument(
        "--drafter",
        help="drafter directory (default: the shipped drafter for smollm2, one of the released P-EAGLE drafter's "
        "shape for the targets in neuron/configs/, else a 2-layer P-EAGLE drafter of the target's shape)",
    )
    p.add_argument(
        "--instance",
        choices=sorted(INSTANCES),
        help="instance type (default: a table over every instance)",
    )
    p.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel devices (NeuronCores) (default: a table over every TP the model allows)",
    )
    p.add_argument("--k", type=int, default=7, help="draft tokens per step (default 7)")
    p.add_argument("--acceptance-length", type=float, required=True, help="tokens emitted per target forward")
    p.add_argument("--batch", type=int, default=1, help="batch rows (default 1)")
    p.add_argument("--context", type=int, default=1024, help="tokens of context in the KV cache (default 1024)")
    p.add_argument("--sequential", action="store_true", help="EAGLE-3 drafting: K drafter passes")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights (default bf16)")
    p.add_argument(
        "--expert-split",
        choices=["auto", "experts", "width"],
        default="auto",
        help="how TP splits a mixture of experts (peagle_jax.sharding; default auto); memory differs only in "
        "which biases are replicated",
    )
    add_experts_flag(p)


def add_experts_flag(p) -> None:
    p.add_argument(
        "--experts",
        choices=EXPERT_FORMATS,
        default="auto",
        help="how a mixture of experts holds its expert matrices: packed MXFP4 (4.25 bits per weight, GPT-OSS), "
        "unpacked in --dtype, or auto (default): packed where the config's checkpoint has MXFP4 experts "
        "(quantization_config mxfp4: GPT-OSS)",
    )


def _tps(cfg, devices: int, expert_split: str) -> tuple[list[int], str | None]:
    """Every TP up to ``devices`` that divides what TP splits (:func:`peagle_jax.sharding.check_target_tp`),
    and why the smallest other TP is refused (None when none is)."""
    from peagle_jax.sharding import check_target_tp

    allowed, refused = [], None
    for tp in range(1, devices + 1):
        try:
            check_target_tp(tp, cfg, expert_split)
        except UserError as err:
            refused = refused or str(err)
            continue
        allowed.append(tp)
    return allowed, refused


def run_plan(args) -> int:
    from peagle_jax.neuron.targets import configs
    from peagle_jax.sharding import check_target_tp

    for flag, value, least in (("--k", args.k, 1), ("--batch", args.batch, 1), ("--context", args.context, 0)):
        if value < least:
            raise UserError(f"{flag} must be >= {least}, got {value}")
    if not 1 <= args.acceptance_length <= args.k + 1:  # checked before any table row (NaN fails too)
        raise UserError(f"--acceptance-length must be in 1..K+1 = 1..{args.k + 1}, got {args.acceptance_length}")
    if args.drafter is not None and not Path(args.drafter).is_dir():
        raise UserError(f"--drafter {args.drafter}: no such directory")
    cfg, dcfg, note = configs(args.model, args.drafter, args.dtype, "unpacked")  # counted packed by --experts
    experts = checkpoint_experts(args.model) if args.experts == "auto" else args.experts
    if experts == "packed":
        check_packed(cfg)
    if args.tp is not None:
        check_target_tp(args.tp, cfg, args.expert_split)
    instances = [args.instance] if args.instance else sorted(INSTANCES)
    drafter = drafter_cost(dcfg)
    single = args.instance is not None and args.tp is not None
    from peagle_jax.models import model

    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
    t1 = model_cost(cfg, params, args.expert_split, args.tp or 1, experts)
    active = f", {t1.active_params / 1e9:.2f} B active per token" if t1.num_experts else ""
    print(
        f"target: {args.model} ({cfg.family}, {cfg.num_layers} layers), {t1.param_bytes / 1e9:.2f} GB of "
        f"{cfg.dtype}{' and MXFP4' if experts == 'packed' else ''} parameters ({t1.num_params / 1e9:.2f} B{active})"
    )
    if t1.num_experts:
        print(
            f"experts: top-{t1.top_k} of {t1.num_experts}; a step over n tokens reads E(1-(1-k/E)^n) experts per "
            f"layer (batch {args.batch}: {t1.experts_read(args.batch):.1f} for a plain step, "
            f"{t1.experts_read(args.batch * (args.k + 1)):.1f} for a verify of K+1 = {args.k + 1}); memory holds all"
        )
        unpacked = model_cost(cfg, params, args.expert_split, args.tp or 1) if experts == "packed" else t1
        held = (
            f"packed MXFP4, 4.25 bits per weight: {t1.param_bytes / 1e9:.2f} GB of parameters instead of "
            f"{unpacked.param_bytes / 1e9:.2f} GB unpacked, plus {t1.unpack_bytes / 1e9:.2f} GB (one layer's "
            "experts unpacked, over TP) of scratch"
            if experts == "packed"
            else f"unpacked, in {cfg.dtype}"
        )
        print(f"expert matrices: {held} (--experts {args.experts})")
    print(f"{note}: {drafter.param_bytes / 1e9:.2f} GB (replicated)")
    print(
        f"K = {args.k}, acceptance length {args.acceptance_length}, batch {args.batch}, {args.context} tokens of "
        "context; bounds, not predictions (collectives and launches ignored)"
    )
    if args.tp is None:
        most = max(INSTANCES[n].chips * INSTANCES[n].devices_per_chip for n in instances)
        allowed, refused = _tps(cfg, most, args.expert_split)
        print(f"TP {', '.join(map(str, allowed))}" + (f"; the others are refused: {refused}" if refused else ""))
    print(
        "| instance | TP | memory per device | plain step bound | speculative step bound (verify + draft) "
        "| tokens/s bound, plain / speculative | ratio | limited by |\n|---|---|---|---|---|---|---|---|"
    )
    shown = 0
    for name in instances:
        inst = INSTANCES[name]
        devices = inst.chips * inst.devices_per_chip
        for tp in [args.tp] if args.tp is not None else _tps(cfg, devices, args.expert_split)[0]:
            try:
                target = model_cost(cfg, params, args.expert_split, tp, experts)
                r = plan(
                    target,
                    drafter,
                    inst,
                    tp=tp,
                    k=args.k,
                    acceptance_length=args.acceptance_length,
                    batch=args.batch,
                    context=args.context,
                    sequential=args.sequential,
                )
            except UserError as err:
                if single:
                    raise UserError(f"{name}: {err}") from None
                print(f"| {name} | {tp} | refused: {err} | | | | | |")
                continue
            shown += 1
            m = r.memory
            print(
                f"| {name} | {tp} | {m.total / GIB:.1f} of {m.capacity / GIB:.0f} GiB | {r.plain_step_s * 1e3:.3f} ms "
                f"| {r.spec_step_s * 1e3:.3f} ms ({r.verify_s * 1e3:.3f} + {r.draft_s * 1e3:.3f}) "
                f"| {r.plain_tokens_per_s:.0f} / {r.spec_tokens_per_s:.0f} | {r.speedup:.2f}x "
                f"| plain {r.bound['plain']}, verify {r.bound['verify']}, draft {r.bound['draft']} |"
            )
            if single:
                print(f"memory: {m}")
    if not shown:
        raise UserError("the model fits on none of these instances and TPs (see the table)")
    return 0
