"""The P-EAGLE training step, its state, checkpoints and metrics; the host loop that ties them together.

Invariants:

- ``TrainState`` is a pytree of arrays only (params, optimizer state, step, rng key data, data position),
  so a checkpoint of it is the whole run: restoring it and feeding the batch for ``data_pos`` continues the
  run exactly as if it had not stopped.
- Master weights and the optimizer state are fp32. With ``compute_dtype`` bfloat16 the loss is taken of
  bf16 casts of the params inside the differentiated function, so the gradients arrive in fp32 (the
  cast's transpose) and AdamW updates the fp32 masters. The bf16 products take bf16 operands and accumulate
  in f32, forward and backward (:func:`peagle_jax.ops.einsum_f32`).
- Frozen leaves (the integer / boolean vocab maps ``d2t`` / ``t2d``, and ``embed_tokens`` when the config
  says ``embed_requires_grad`` is false) are split off before differentiation: the optimizer never sees
  them, so they get no update, no weight decay and do not count in the clipping norm.
- ``train_step`` is jitted once: configs are static, everything that changes per step is an array, and
  the batch shapes are fixed by the caller (padded elements), so a run compiles a single step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.train.config import TrainConfig
from peagle_jax.train.objective import PEagleBatch, peagle_loss, split_trainable
from peagle_jax.train.partition import partitioned_loss_and_grad
from peagle_jax.train.ttt import ttt_loss


class TrainState(NamedTuple):
    """Everything a run needs to continue exactly; every leaf an array."""

    params: dict  # fp32 masters (plus the frozen integer / boolean vocab maps)
    opt_state: Any  # optax state over the trainable leaves only
    step: jax.Array  # int32 scalar: optimizer steps taken
    rng: jax.Array  # uint32 key data, split once per step (for stochastic parts of the step)
    data_pos: jax.Array  # int32 scalar: batches consumed; the loader resumes from here


def lr_schedule(tcfg: TrainConfig) -> optax.Schedule:
    """Linear warmup 0 -> ``lr`` over ``warmup_steps``, then cosine to ``lr * min_lr_ratio`` at ``total_steps``."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=tcfg.lr,
        warmup_steps=tcfg.warmup_steps,
        decay_steps=tcfg.total_steps,
        end_value=tcfg.lr * tcfg.min_lr_ratio,
    )


def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on the schedule. It acts on the trainable leaves only; see
    :func:`partition` for what is frozen."""
    return optax.chain(
        optax.clip_by_global_norm(tcfg.clip_norm),
        optax.adamw(lr_schedule(tcfg), b1=tcfg.b1, b2=tcfg.b2, eps=tcfg.eps, weight_decay=tcfg.weight_decay),
    )


def partition(params: dict, cfg: DrafterConfig) -> tuple[dict, dict]:
    """``(trainable, frozen)`` top-level dicts: the vocab maps always frozen, the embedding when
    ``cfg.embed_requires_grad`` is false. ``{**trainable, **frozen}`` is the full tree again."""
    trainable, frozen = split_trainable(params)
    if not cfg.embed_requires_grad and "embed_tokens" in trainable:
        frozen = {**frozen, "embed_tokens": trainable.pop("embed_tokens")}
    return trainable, frozen


def _to_fp32(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def init_train_state(params: dict, cfg: DrafterConfig, tcfg: TrainConfig) -> TrainState:
    """A fresh state: fp32 copies of ``params``, a zero optimizer state, step 0, data position 0. Every
    leaf is a copy, since :func:`train_step` donates the state and must not consume the caller's arrays."""
    params = _to_fp32(jax.tree.map(lambda x: jnp.array(x, copy=True), params))
    trainable, _ = partition(params, cfg)
    return TrainState(
        params=params,
        opt_state=make_optimizer(tcfg).init(trainable),
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.key_data(jax.random.key(tcfg.seed)),
        data_pos=jnp.zeros((), jnp.int32),
    )


def compute_config(cfg: DrafterConfig, tcfg: TrainConfig) -> DrafterConfig:
    """The drafter config the forward runs under: its layers in ``tcfg.compute_dtype``."""
    if cfg.layer.dtype == tcfg.compute_dtype:
        return cfg
    return cfg.replace(layer=dataclasses.replace(cfg.layer, dtype=tcfg.compute_dtype))


def loss_and_grad(trainable, frozen, batch, target_head_UD, embed_VD, *, cfg, tcfg, num_depths):
    """``((loss, metrics), grads)`` of the configured objective with respect to ``trainable``."""
    ccfg = compute_config(cfg, tcfg)
    dtype = ccfg.layer.jnp_dtype

    def cast(params):
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)

    if tcfg.segments > 1:
        return partitioned_loss_and_grad(
            trainable,
            frozen,
            batch,
            target_head_UD,
            embed_VD,
            cfg=ccfg,
            num_depths=num_depths,
            segments=tcfg.segments,
            cast=cast,
        )
    objective = ttt_loss if tcfg.objective == "eagle3" else peagle_loss

    def loss_fn(trainable):
        return objective(
            cast({**trainable, **frozen}), batch, target_head_UD, embed_VD, cfg=ccfg, num_depths=num_depths
        )

    return jax.value_and_grad(loss_fn, has_aux=True)(trainable)


def train_step_fn(
    state: TrainState,
    batch: PEagleBatch,
    target_head_UD,
    embed_VD=None,
    *,
    cfg: DrafterConfig,
    tcfg: TrainConfig,
    num_depths: int,
):
    """One optimizer step; returns ``(state, metrics)``. Metrics: ``loss``, ``grad_norm`` (before
    clipping), ``lr`` (the rate this step used) and the objective's ``loss_sum_K`` / ``correct_K`` /
    ``count_K``. Unjitted: :data:`train_step` is its jitted form, :func:`peagle_jax.train.mesh` jits it
    with shardings."""
    trainable, frozen = partition(state.params, cfg)
    (_, metrics), grads = loss_and_grad(
        trainable, frozen, batch, target_head_UD, embed_VD, cfg=cfg, tcfg=tcfg, num_depths=num_depths
    )
    grads = _to_fp32(grads)
    updates, opt_state = make_optimizer(tcfg).update(grads, state.opt_state, trainable)
    trainable = optax.apply_updates(trainable, updates)
    metrics = {**metrics, "grad_norm": optax.tree.norm(grads), "lr": lr_schedule(tcfg)(state.step)}
    rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0])
    new = TrainState({**trainable, **frozen}, opt_state, state.step + 1, rng, state.data_pos + 1)
    return new, metrics


STEP_STATICS = ("cfg", "tcfg", "num_depths")
train_step = jax.jit(train_step_fn, static_argnames=STEP_STATICS, donate_argnums=(0,))


@functools.partial(jax.jit, static_argnames=("cfg", "tcfg", "num_depths"))
def eval_step(params, batch: PEagleBatch, target_head_UD, embed_VD=None, *, cfg, tcfg, num_depths):
    """The objective's metrics on a batch, no update (held-out evaluation)."""
    trainable, frozen = partition(params, cfg)
    ccfg = compute_config(cfg, tcfg)
    objective = ttt_loss if tcfg.objective == "eagle3" else peagle_loss
    _, metrics = objective({**trainable, **frozen}, batch, target_head_UD, embed_VD, cfg=ccfg, num_depths=num_depths)
    return metrics


# --- metrics ------------------------------------------------------------------------------------------------


def summarize(metrics: dict, step: int) -> dict:
    """A JSON-ready record of one step: scalars, then per-depth loss and top-1 accuracy (None where a
    depth had no elements)."""
    m = jax.device_get(metrics)
    count = np.asarray(m["count_K"], np.float64)
    safe = np.maximum(count, 1.0)
    record = {"step": int(step), "loss": float(m["loss"])}
    for key in ("grad_norm", "lr"):
        if key in m:
            record[key] = float(m[key])
    for key, total in (("loss_K", "loss_sum_K"), ("acc_K", "correct_K")):
        per_depth = np.asarray(m[total], np.float64) / safe
        record[key] = [float(x) if c else None for x, c in zip(per_depth, count, strict=True)]
    record["count_K"] = [int(c) for c in count]
    return record


def truncate_jsonl(path: str | Path, keep) -> int:
    """Keep only the records of a JSON-lines file for which ``keep(record)`` holds (a resumed run drops the
    rows a killed run wrote after its last checkpoint, which it is about to write again); returns how many
    were dropped. A missing file is left missing."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.strip() and keep(json.loads(line))]
    if len(kept) != len(lines):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    return len(lines) - len(kept)


def append_jsonl(path: str | Path, record: dict) -> None:
    """Append one record as a JSON line (the file is created on first use)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# --- checkpoints --------------------------------------------------------------------------------------------


def checkpoint_manager(directory: str | Path, tcfg: TrainConfig) -> ocp.CheckpointManager:
    """An orbax manager keeping the last ``keep_last`` states, saving every ``save_every`` steps, async."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=tcfg.keep_last, save_interval_steps=tcfg.save_every, enable_async_checkpointing=True
    )
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def save_state(manager: ocp.CheckpointManager, state: TrainState, *, force: bool = False) -> bool:
    """Save ``state`` under its step when the interval says so (or ``force``); returns whether it saved.
    The save may still be in flight: call ``manager.wait_until_finished()`` before relying on it."""
    return manager.save(int(state.step), args=ocp.args.StandardSave(state), force=force)


def restore_state(manager: ocp.CheckpointManager, template: TrainState, step: int | None = None) -> TrainState:
    """The saved state at ``step`` (default: the latest), shaped like ``template`` (e.g. a fresh
    :func:`init_train_state`; only its structure, shapes and dtypes are used)."""
    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {manager.directory}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
    return TrainState(*restored)


# --- the host loop ------------------------------------------------------------------------------------------


def train_loop(
    state: TrainState,
    batch_at: Callable[[int], PEagleBatch],
    target_head_UD,
    embed_VD=None,
    *,
    cfg: DrafterConfig,
    tcfg: TrainConfig,
    num_depths: int,
    num_steps: int,
    manager: ocp.CheckpointManager | None = None,
    metrics_path: str | Path | None = None,
) -> tuple[TrainState, list[dict]]:
    """Run ``num_steps`` steps. ``batch_at(data_pos)`` gives the batch for a data position (a pure function
    of it, so that a restored run sees the same data). Saves through ``manager`` on its interval and
    appends one metrics record per step to ``metrics_path``. Returns the state and the records."""
    records = []
    for _ in range(num_steps):
        batch = batch_at(int(state.data_pos))
        step = int(state.step)
        state, metrics = train_step(state, batch, target_head_UD, embed_VD, cfg=cfg, tcfg=tcfg, num_depths=num_depths)
        record = summarize(metrics, step)
        records.append(record)
        if metrics_path is not None:
            append_jsonl(metrics_path, record)
        if manager is not None:
            save_state(manager, state)
    if manager is not None:
        manager.wait_until_finished()
    return state, records
