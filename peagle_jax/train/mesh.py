"""Training beyond one device: a ``jax.sharding.Mesh`` with ``data`` and ``fsdp`` axes, multi-host start-up.

- Batches are split along their row axis over both axes (``data`` x ``fsdp`` shards of the global batch).
- Parameters and optimizer state are fully sharded over ``fsdp`` (each leaf along its largest dimension that
  the axis size divides; small or indivisible leaves are replicated) and replicated over ``data``.
- The step is :func:`peagle_jax.train.loop.train_step_fn` jitted with the state's shardings as output
  shardings, so the state keeps its layout from step to step (one compile) and XLA inserts the
  all-gathers / reduce-scatters. The math is the single-device step's: tests on 8 simulated CPU devices
  check loss and gradients against one device, and restoring a checkpoint onto another mesh.
- Multi-host (TPU pod slices): :func:`initialize` calls ``jax.distributed.initialize()`` (coordinator and
  process ids come from the TPU environment); every process builds the same global batch (a pure function
  of the data position) and :func:`global_batch` hands each device only its shard.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from peagle_jax.models.config import ConfigError
from peagle_jax.train.loop import STEP_STATICS, train_step_fn

AXES = ("data", "fsdp")
MIN_SHARD_ELEMENTS = 2**12  # leaves smaller than this are replicated: sharding them only adds collectives


def initialize(distributed: bool) -> None:
    """``jax.distributed.initialize()`` on multi-host runs (before any other JAX call touches devices)."""
    if distributed:
        jax.distributed.initialize()


def make_mesh(data: int, fsdp: int, devices=None) -> Mesh:
    """A (data, fsdp) mesh over ``devices`` (default all); ``data=-1`` takes what ``fsdp`` leaves."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if fsdp < 1 or (data < 1 and data != -1):
        raise ConfigError(f"mesh: data={data} fsdp={fsdp} must be >= 1 (data may be -1: the rest)")
    if data == -1:
        if n % fsdp:
            raise ConfigError(f"mesh: fsdp={fsdp} does not divide the {n} devices")
        data = n // fsdp
    if data * fsdp != n:
        raise ConfigError(f"mesh: data={data} x fsdp={fsdp} = {data * fsdp} devices, but {n} are present")
    return Mesh(np.asarray(devices).reshape(data, fsdp), AXES)


def leaf_spec(shape: tuple[int, ...], fsdp: int) -> PartitionSpec:
    """Shard the largest dimension that ``fsdp`` divides; replicate small or indivisible leaves."""
    if fsdp == 1 or math.prod(shape) < MIN_SHARD_ELEMENTS:
        return PartitionSpec()
    for axis in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if shape[axis] % fsdp == 0:
            spec = [None] * len(shape)
            spec[axis] = "fsdp"
            return PartitionSpec(*spec)
    return PartitionSpec()


def state_shardings(state, mesh: Mesh):
    """A NamedSharding per leaf of ``state`` (arrays or ShapeDtypeStructs)."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda x: NamedSharding(mesh, leaf_spec(tuple(x.shape), fsdp)), state)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def check_batch_size(batch_size: int, mesh: Mesh) -> None:
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch_size % shards:
        raise ConfigError(f"batch_size={batch_size} must be a multiple of data x fsdp = {shards}")


def global_batch(batch, mesh: Mesh):
    """Host arrays of the global batch -> arrays sharded along rows; each device receives only its shard
    (on a pod, each process only materialises its addressable shards)."""

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, batch_sharding(mesh, x.ndim), lambda idx: x[idx])

    return jax.tree.map(put, batch)


def place(tree, shardings):
    return jax.tree.map(lambda x, s: jax.device_put(x, s), tree, shardings)


def sharded_train_step(mesh: Mesh, state_sharding, *, cfg, tcfg, num_depths: int):
    """The train step jitted for ``mesh``: ``step(state, batch, target_head, embed) -> (state, metrics)``,
    the state donated and kept in ``state_sharding``, metrics replicated."""
    jitted = jax.jit(
        train_step_fn,
        static_argnames=STEP_STATICS,
        donate_argnums=(0,),
        out_shardings=(state_sharding, replicated(mesh)),
    )

    def step(state, batch, target_head_UD, embed_VD=None):
        return jitted(state, batch, target_head_UD, embed_VD, cfg=cfg, tcfg=tcfg, num_depths=num_depths)

    step.jitted = jitted
    return step
