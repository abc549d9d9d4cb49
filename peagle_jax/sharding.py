"""Tensor parallelism with ``jax.sharding``: a one-axis mesh ``tp``, parameters and KV cache placed with
``NamedSharding``, and jit propagating the rest (no sharding constraints inside the graphs).

What is split over the ``tp`` devices (Megatron-style, so each layer needs one all-reduce after attention
and one after the MLP, which XLA inserts):

- attention by kv head: ``qkv_proj.weight [G, J+2, H, D]`` (and its bias) on G, so each device holds whole
  groups (a kv head with its J query heads); ``o_proj.weight [D, N, H]`` on N (query heads are ordered by
  group, so its N-shards are the same groups); the KV cache ``[B, G, S, H]`` on G;
- the MLP by hidden unit: ``gate_up_proj.weight [2, F, D]`` (and bias) on F, ``down_proj.weight [D, F]`` on
  its input F;
- everything else (embedding, LM head, norms, q/k norms, output biases) replicated.

TP must divide the kv heads G (and F): a kv head is never split. SmolLM2-135M has G = 3 kv heads, so it
runs at TP 1 or 3; :func:`check_tp` refuses the rest with the reason. The drafter is replicated by default
(it is small and its output feeds the host), or sharded by the same rules (``shard_drafter``).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from peagle_jax.errors import UserError
from peagle_jax.models.cache import KVCache

AXIS = "tp"
# Parameter name (the last two path components) -> which axis is split over ``tp``.
SPLIT_AXIS = {
    ("qkv_proj", "weight"): 0,
    ("qkv_proj", "bias"): 0,
    ("o_proj", "weight"): 1,
    ("gate_up_proj", "weight"): 1,
    ("gate_up_proj", "bias"): 1,
    ("down_proj", "weight"): 1,
}


def check_tp(tp: int, *, num_kv_heads: int, intermediate_size: int, what: str = "the target") -> None:
    if tp < 1:
        raise UserError(f"--tp must be >= 1, got {tp}")
    if num_kv_heads % tp or intermediate_size % tp:
        raise UserError(
            f"--tp {tp} must divide {what}'s {num_kv_heads} kv heads and its MLP width {intermediate_size} "
            "(tensor parallelism gives each device whole kv heads)"
        )


def make_mesh(tp: int, devices=None) -> Mesh:
    """A mesh of the first ``tp`` devices along one axis named ``tp``."""
    devices = list(jax.devices() if devices is None else devices)
    if tp > len(devices):
        raise UserError(f"--tp {tp}: only {len(devices)} {devices[0].platform} device(s) are available")
    return Mesh(np.asarray(devices[:tp]), (AXIS,))


def param_spec(path, x) -> PartitionSpec:
    names = tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)
    axis = SPLIT_AXIS.get(names[-2:])
    if axis is None:
        return PartitionSpec()
    spec = [None] * x.ndim
    spec[axis] = AXIS
    return PartitionSpec(*spec)


def param_shardings(params, mesh: Mesh):
    return jax.tree_util.tree_map_with_path(lambda path, x: NamedSharding(mesh, param_spec(path, x)), params)


def shard_params(params, mesh: Mesh):
    """Place a parameter tree (target or drafter) on the mesh by :data:`SPLIT_AXIS`."""
    return jax.device_put(params, param_shardings(params, mesh))


def replicate(tree, mesh: Mesh):
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


CACHE_SPEC = PartitionSpec(None, AXIS, None, None)  # [B, G, S, H]: kv heads split


def shard_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    return jax.device_put(cache, NamedSharding(mesh, CACHE_SPEC))
