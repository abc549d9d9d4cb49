"""Training beyond one device: a ``jax.sharding.Mesh`` with ``data`` and ``fsdp`` axes, multi-host start-up.

- Batches are split along their row axis over both axes (``data`` x ``fsdp`` shards of the global batch).
- Parameters and optimizer state are fully sharded over ``fsdp`` (each leaf along its largest dimension that
  the axis size divides; small or indivisible leaves are replicated) and replicated over ``data``.
- The step is :func:`peagle_jax.train.loop.train_step_fn` jitted with the state's shardings as output
  shardings, so the state keeps its layout from step to step (one compile) and XLA inserts the
  all-gathers / reduce-scatters. The math is the single-device step's: tests on 8 simulated CPU devices
  check loss and gradients against one device, and restoring a checkpoint onto another mesh.
- Several processes (TPU pod hosts, or CPU processes joined over loopback): :func:`initialize` starts
  ``jax.distributed`` (explicit coordinator, count and id, or the platform's own detection) with gloo
  collectives on the CPU; every process builds the same global batch (a pure function of the data
  position) and :func:`global_batch` hands each device only its shard. Stages with files to write run on
  process 0 first while the others wait (:func:`primary_first`); :func:`host_tree` gathers a sharded tree
  to every host (the export).
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from peagle_jax.models.config import ConfigError
from peagle_jax.train.loop import STEP_STATICS, train_step_fn

AXES = ("data", "fsdp")
MIN_SHARD_ELEMENTS = 2**12  # leaves smaller than this are replicated: sharding them only adds collectives


def process_settings(mc) -> tuple[str, int, int]:
    """(coordinator address, number of processes, process id) of a :class:`~peagle_jax.train.recipe.MeshConfig`,
    each from the environment (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) where the
    recipe leaves it unset ("", 0, -1)."""

    def env_int(name: str, unset: int) -> int:
        raw = os.environ.get(name, "").strip()
        if not raw:
            return unset
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"${name}={raw!r} is not an integer") from None

    address = mc.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "").strip()
    num = mc.num_processes or env_int("JAX_NUM_PROCESSES", 0)
    pid = mc.process_id if mc.process_id >= 0 else env_int("JAX_PROCESS_ID", -1)
    return address, num, pid


def multi_process(mc) -> bool:
    """Whether the recipe runs as several processes (its devices are known only after :func:`initialize`)."""
    address, num, _ = process_settings(mc)
    return mc.distributed or bool(address) or num > 1


def initialize(mc) -> None:
    """Join the processes of a multi-process run (before any other JAX call touches devices); nothing for a
    single process. Explicit settings need all three of address, count and id; ``mesh.distributed`` alone
    leaves them to ``jax.distributed.initialize()``'s detection (TPU, SLURM, MPI, Kubernetes)."""
    if not multi_process(mc):
        return
    address, num, pid = process_settings(mc)
    explicit = {"mesh.coordinator_address": bool(address), "mesh.num_processes": num > 0, "mesh.process_id": pid >= 0}
    if any(explicit.values()) and not all(explicit.values()):
        missing = ", ".join(k for k, v in explicit.items() if not v)
        raise ConfigError(f"a multi-process run names its coordinator, process count and id: {missing} not set")
    if num and pid >= num:
        raise ConfigError(f"mesh.process_id {pid} must be below mesh.num_processes {num}")
    # CPU collectives across processes (the CPU backend has none by default); TPU and GPU use their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        address or None,
        num or None,
        pid if pid >= 0 else None,
        heartbeat_timeout_seconds=mc.heartbeat_s,
        initialization_timeout=max(60, mc.heartbeat_s),
    )


def is_primary() -> bool:
    """Process 0: the one that writes logs, summaries and the export."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def primary_first(name: str, fn):
    """``fn()`` on process 0, then (after a barrier) on the others, which find its files written and only
    read them: regeneration, the feature cache, the random target. Returns ``fn()``'s result."""
    if is_primary():
        result = fn()
        barrier(name)
        return result
    barrier(name)
    return fn()


def host_tree(tree):
    """``tree``'s arrays as whole numpy arrays on every host (gathered across processes when sharded)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))
    return jax.tree.map(np.asarray, jax.device_get(tree))


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
    (on a pod, each process only materialises its addressable shards, and computes or reads only their
    rows of :class:`~peagle_jax.train.data.LazyRows` features)."""
    from peagle_jax.train.data import LazyRows

    def put(x):
        x = x if isinstance(x, LazyRows) else np.asarray(x)
        return jax.make_array_from_callback(x.shape, batch_sharding(mesh, x.ndim), lambda idx: x[idx])

    return jax.tree.map(put, batch)


def place(tree, shardings):
    """``tree`` laid out as ``shardings``. Across processes each process gives only its own devices' shards
    (the leaves hold the same values on every process); an array already laid out so is kept."""

    def put(x, s):
        if isinstance(x, jax.Array) and x.sharding == s:
            return x
        if jax.process_count() == 1:
            return jax.device_put(x, s)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])

    return jax.tree.map(put, tree, shardings)


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
