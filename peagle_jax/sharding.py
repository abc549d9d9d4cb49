"""Tensor parallelism with ``jax.sharding``: a one-axis mesh ``tp``, parameters and KV cache placed with
``NamedSharding``, and jit propagating the rest (no sharding constraints inside the graphs).

What is split over the ``tp`` devices (Megatron-style, so each layer needs one all-reduce after attention
and one after the MLP, which XLA inserts):

- attention by kv head: ``qkv_proj.weight [G, J+2, H, D]`` (and its bias) on G, so each device holds whole
  groups (a kv head with its J query heads); ``o_proj.weight [D, N, H]`` and GPT-OSS's ``sinks [N]`` on N
  (query heads are ordered by group, so their N-shards are the same groups); the KV cache ``[B, G, S, H]``
  on G;
- the MLP by hidden unit: ``gate_up_proj.weight [2, F, D]`` (and bias) on F, ``down_proj.weight [D, F]`` on
  its input F;
- the experts of a mixture-of-experts layer (:mod:`peagle_jax.models.moe`) in one of two splits, chosen per
  model (``experts=``, ``--expert-split``):

  - ``experts`` (expert parallelism): ``experts.gate_up_proj [E, 2, F, D]``, ``down_proj [E, D, F]`` and
    their biases ``[E, 2, F]``, ``[E, D]`` on E, so each device holds E/TP whole experts;
  - ``width`` (tensor parallelism within each expert): ``gate_up_proj`` on F (axis 2), ``down_proj`` on its
    input F (axis 2), ``gate_up_proj_bias`` on F, ``down_proj_bias`` replicated, so each device holds F/TP
    hidden units of every expert, as the dense MLP;
  - packed (MXFP4) experts split the same axes of their uint8 pairs: E for ``experts``; for ``width``,
    ``gate_up_proj_blocks`` [E, 2, F, D/32, 16] and its scales on F (axis 2), ``down_proj_blocks``
    [E, D, F/32, 16] and its scales on the F/32 block axis (axis 2), so TP must divide F/32 there: a
    device holds whole blocks of 32 hidden units, whose unpacked values are its F/TP hidden units;
  - ``auto`` (the default): ``experts`` for the dense dispatch, ``width`` for a dispatch that gathers
    (``gather``, or ``auto``, whose decode steps gather), the other split where TP does not divide the
    first's count. Both splits are exact and hold 1/TP of the expert weights per device; they differ in
    what XLA communicates. The dense dispatch under ``experts`` runs each device's experts on every token
    and sums token outputs over the devices, where under ``width`` XLA all-gathers expert weights (the
    product over all experts merges E with the split F). The gathered dispatch under ``width`` slices
    each selected expert's F-shard on its device and sums the outputs, where under ``experts`` XLA
    all-gathers every expert's weights to slice one. ``tests/moe_tp_check.py`` compiles both splits for
    both dispatches and checks that ``auto``'s largest collective is the smaller. Under ``auto`` dispatch
    (the default) the decode steps gather and so set the split; its dense graphs (prefill, large
    verifies) then pay the weight all-gathers, and ``--expert-split experts`` is the other trade.
    Expert weights already placed on the mesh keep their split, so a caller that placed them with an
    explicit split (:func:`shard_target`, ``--expert-split``) keeps it through a generator, which places
    its parameters with ``auto``;

- everything else (embedding, LM head, norms, q/k norms, output biases, the MoE routers) replicated.

TP must divide the kv heads G, the dense MLP width F (when a layer is dense), and the experts E (``experts``)
or the expert width (``width``): a kv head is never split. SmolLM2-135M has G = 3 kv heads, so it runs at
TP 1 or 3; :func:`check_tp` refuses the rest, naming the count that TP does not divide. The drafter is
replicated by default (it is small and its output feeds the host), or sharded by the same rules
(``shard_drafter``).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from peagle_jax.errors import UserError
from peagle_jax.models.cache import KVCache
from peagle_jax.models.config import ModelConfig, MoEConfig

AXIS = "tp"
# Parameter name (the last two path components) -> which axis is split over ``tp``.
SPLIT_AXIS = {
    ("qkv_proj", "weight"): 0,
    ("qkv_proj", "bias"): 0,
    ("o_proj", "weight"): 1,
    ("self_attn", "sinks"): 0,
    ("gate_up_proj", "weight"): 1,
    ("gate_up_proj", "bias"): 1,
    ("down_proj", "weight"): 1,
}
EXPERT_SPLITS = ("auto", "experts", "width")
# Expert split -> expert parameter name (under ``experts``) -> the axis split over ``tp`` (absent: replicated).
PACKED_EXPERT_NAMES = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
EXPERT_SPLIT_AXIS = {
    "experts": {
        "gate_up_proj": 0,
        "gate_up_proj_bias": 0,
        "down_proj": 0,
        "down_proj_bias": 0,
        **dict.fromkeys(PACKED_EXPERT_NAMES, 0),
    },
    "width": {"gate_up_proj": 2, "gate_up_proj_bias": 2, "down_proj": 2, **dict.fromkeys(PACKED_EXPERT_NAMES, 2)},
}
MXFP4_BLOCK = 32  # hidden units per packed block: a width split of packed experts splits whole blocks


def expert_split(
    tp: int,
    *,
    num_experts: int,
    expert_width: int,
    dispatch: str = "dense",
    experts: str = "auto",
    what="the target",
    packed: bool = False,
) -> str:
    """The split (``"experts"`` or ``"width"``) of ``num_experts`` experts of ``expert_width`` hidden units
    over ``tp`` devices that ``experts`` asks for, or a :class:`UserError` naming the count TP does not
    divide. ``"auto"``: whole experts for the dense ``dispatch``, the width for one that gathers (``gather``
    or ``auto``), the other where TP does not divide the first. ``packed`` (MXFP4) experts split their width
    in blocks of 32 hidden units, so there TP must divide ``expert_width / 32``."""
    if experts not in EXPERT_SPLITS:
        raise UserError(f"--expert-split {experts!r}: choose {', '.join(EXPERT_SPLITS)}")
    units, unit = (expert_width // MXFP4_BLOCK, "MXFP4 blocks") if packed else (expert_width, "hidden units")
    width = (
        f"packed expert width of {units} MXFP4 blocks ({expert_width} hidden units)"
        if packed
        else f"expert width {units}"
    )
    if experts == "auto":
        if units % tp and num_experts % tp:
            raise UserError(
                f"--tp {tp} must divide {what}'s {width} (--expert-split width) or its {num_experts} experts "
                "(--expert-split experts)"
            )
        first, second = ("experts", "width") if dispatch == "dense" else ("width", "experts")
        return first if (num_experts if first == "experts" else units) % tp == 0 else second
    if experts == "experts" and num_experts % tp:
        raise UserError(
            f"--tp {tp} must divide {what}'s {num_experts} experts (--expert-split experts gives each device "
            "whole experts)"
        )
    if experts == "width" and units % tp:
        raise UserError(f"--tp {tp} must divide {what}'s {width} (--expert-split width splits every expert's {unit})")
    return experts


def check_tp(
    tp: int,
    *,
    num_kv_heads: int,
    intermediate_size: int | None,
    moe: MoEConfig | None = None,
    experts: str = "auto",
    what: str = "the target",
) -> None:
    """Refuse a TP that splits a kv head, or does not divide the dense MLP width (``intermediate_size``;
    None: no layer is dense) or the experts in the split ``experts`` asks for (``moe``; None: no experts)."""
    if tp < 1:
        raise UserError(f"--tp must be >= 1, got {tp}")
    if num_kv_heads % tp:
        raise UserError(
            f"--tp {tp} must divide {what}'s {num_kv_heads} kv heads (tensor parallelism gives each device whole "
            "kv heads)"
        )
    if intermediate_size is not None and intermediate_size % tp:
        raise UserError(
            f"--tp {tp} must divide {what}'s MLP width {intermediate_size} (each device holds 1/TP of its hidden units)"
        )
    if moe is not None:
        expert_split(
            tp,
            num_experts=moe.num_experts,
            expert_width=moe.intermediate_size,
            dispatch=moe.dispatch,
            experts=experts,
            what=what,
            packed=moe.experts == "packed",
        )


def check_target_tp(tp: int, cfg: ModelConfig, experts: str = "auto") -> None:
    """:func:`check_tp` for a target config: its kv heads, its dense MLP width where a layer is dense, and
    its experts."""
    dense = cfg.moe is None or len(cfg.moe.sparse_layers) < cfg.num_layers
    check_tp(
        tp,
        num_kv_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size if dense else None,
        moe=cfg.moe,
        experts=experts,
    )


def make_mesh(tp: int, devices=None) -> Mesh:
    """A mesh of the first ``tp`` devices along one axis named ``tp``."""
    devices = list(jax.devices() if devices is None else devices)
    if tp > len(devices):
        raise UserError(f"--tp {tp}: only {len(devices)} {devices[0].platform} device(s) are available")
    return Mesh(np.asarray(devices[:tp]), (AXIS,))


def _names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def param_spec(path, x, experts: str | None = None) -> PartitionSpec:
    """The partition spec of one parameter; ``experts`` (``"experts"`` or ``"width"``) places the MoE expert
    tensors and is required for them."""
    names = _names(path)
    if len(names) >= 2 and names[-2] == "experts":
        if experts not in EXPERT_SPLIT_AXIS:
            raise ValueError(f"{'.'.join(names)}: an expert tensor needs experts='experts' or 'width'")
        axis = EXPERT_SPLIT_AXIS[experts].get(names[-1])
    else:
        axis = SPLIT_AXIS.get(names[-2:])
    if axis is None:
        return PartitionSpec()
    spec = [None] * x.ndim
    spec[axis] = AXIS
    return PartitionSpec(*spec)


_GATE_UP = ("gate_up_proj", "gate_up_proj_blocks")  # [E, 2, F, D] or packed [E, 2, F, D/32, 16]


def _expert_shapes(params):
    """(E, F, packed) of the first ``experts.gate_up_proj`` (or its packed blocks) in a parameter tree, or
    None."""
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        names = _names(path)
        if len(names) >= 2 and names[-2] == "experts" and names[-1] in _GATE_UP:
            return x.shape[0], x.shape[2], names[-1] != "gate_up_proj"
    return None


def placed_split(params, mesh) -> str | None:
    """The expert split that the tree's expert weights already have on ``mesh``, or None (not placed there,
    or no experts)."""
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        sharding, names = getattr(x, "sharding", None), _names(path)
        if names[-2:-1] != ("experts",) or names[-1] not in _GATE_UP or not isinstance(sharding, NamedSharding):
            continue
        if sharding.mesh != mesh:
            return None
        for split in ("experts", "width"):
            if sharding.is_equivalent_to(NamedSharding(mesh, param_spec(path, x, split)), x.ndim):
                return split
        return None
    return None


def param_shardings(params, mesh, experts: str = "auto", dispatch: str = "dense"):
    """The ``NamedSharding`` of every parameter (concrete or abstract) on ``mesh`` (a ``Mesh`` or an
    ``AbstractMesh``), the experts split as ``experts`` says for the MoE ``dispatch`` (:func:`expert_split`)."""
    shapes = _expert_shapes(params)
    split = None
    if shapes is not None:
        E, F, packed = shapes
        split = expert_split(
            mesh.shape[AXIS], num_experts=E, expert_width=F, dispatch=dispatch, experts=experts, packed=packed
        )
    return jax.tree_util.tree_map_with_path(lambda path, x: NamedSharding(mesh, param_spec(path, x, split)), params)


def shard_params(params, mesh: Mesh, experts: str = "auto", dispatch: str = "dense"):
    """Place a parameter tree (target or drafter) on the mesh by :data:`SPLIT_AXIS` and, for MoE experts,
    :data:`EXPERT_SPLIT_AXIS`; with ``experts="auto"``, expert weights already placed on this mesh keep
    their split (:func:`placed_split`)."""
    if experts == "auto":
        experts = placed_split(params, mesh) or "auto"
    return jax.device_put(params, param_shardings(params, mesh, experts, dispatch))


def target_dispatch(cfg: ModelConfig) -> str:
    """The MoE dispatch that decides ``auto``'s expert split for a target (``"dense"`` without experts)."""
    return cfg.moe.dispatch if cfg.moe else "dense"


def shard_target(cfg: ModelConfig, params, mesh: Mesh, experts: str = "auto"):
    """Check TP against the target (:func:`check_target_tp`) and place its parameters on the mesh, the
    experts split for its dispatch."""
    check_target_tp(mesh.size, cfg, experts)
    return shard_params(params, mesh, experts, target_dispatch(cfg))


def replicate(tree, mesh: Mesh):
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


CACHE_SPEC = PartitionSpec(None, AXIS, None, None)  # [B, G, S, H]: kv heads split


def shard_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    return jax.device_put(cache, NamedSharding(mesh, CACHE_SPEC))
