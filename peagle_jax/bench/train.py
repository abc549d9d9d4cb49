"""``python -m peagle_jax.bench.train``: drafter training throughput, before and after the fast training step,
fp32 and bf16 compute, online and cached target features, for the P-EAGLE objective or (``--objective
eagle3``) the EAGLE-3 baseline's; the memory of one step per partition count; and (``--sweep``) the loss
tokens/s of drafter shapes and objectives. Everything compared is measured side by side in one run.

Throughput: a SmolLM2-sized 2-layer P-EAGLE drafter (random weights: speed does not depend on values)
trained on random token rows of ``--seq-len``, packed conversations whose answers (``--loss-fraction`` of the
positions, as in the regenerated training data) carry the loss; *cached* feeds precomputed
features (as read from the feature cache), *online* runs the real SmolLM2 target (fp32, as the training
pipeline loads it) over each batch first (:func:`peagle_jax.train.features.target_features`, the path
``batch.features: online`` takes). *after* is :data:`peagle_jax.train.loop.train_step`; *before* is
:func:`reference_step`, the step as it was before the fast one (kept here, and used by the tests as the
reference formulation): the drafter over a dense [Y, Y] element mask (EAGLE-3: each depth over a dense
[T, K*T] mask), the target's logits per element (EAGLE-3: at every position), and bf16 products written in
the operands' dtype (XLA's CPU computes those in f32). Each round runs every variant in turn, a block of
``--block`` steps back to back, as a training run runs its steps (the first step of a block, which follows a
step of another variant, is not timed); medians of the timed steps are reported as loss
tokens per second (positions in the loss per second). ``--block 1`` times single steps of the variants
interleaved, which slows the *before* step more than the *after* one (docs/bench/train/README.md).
Each variant also gets XLA's count of its step's floating-point operations (GFLOP; *online* adds the target's
forward) and the GFLOP/s it reaches, to read against a product of the LM head's shape timed alone (the rate
the CPU's product kernel reaches with nothing around it); ``--sweep`` reports both for every shape.

Memory: XLA's compiled memory analysis (``temp`` buffers: activations, attention scores and gradients)
of one train step at ``--long-seq-len`` positions for 1 (unpartitioned), 2, 4 and 8 segments. Compile only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax import errors, ops
from peagle_jax.bench.draft import smollm2_sized_drafter
from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.draft import drafter_forward
from peagle_jax.drafter.model import init_drafter_params, new_drafter_cache
from peagle_jax.train import loop, ttt
from peagle_jax.train.cod import bucketed_elements, cod_batch, max_elements
from peagle_jax.train.config import OBJECTIVES, TrainConfig
from peagle_jax.train.features import target_features
from peagle_jax.train.loop import STEP_STATICS, init_train_state, train_step, train_step_fn
from peagle_jax.train.objective import (
    PEagleBatch,
    _take,
    depth_metrics,
    element_inputs,
    element_mask,
    loss_weights,
    target_logits,
)
from peagle_jax.train.recipe import BatchConfig

# --- the step before the fast one: the reference formulation -------------------------------------------------


def reference_loss(params, batch: PEagleBatch, target_head_UD, embed_VD=None, *, cfg: DrafterConfig, num_depths: int):
    """:func:`peagle_jax.train.objective.peagle_loss` as it was written before the fast step (the same
    math): the drafter over the dense [Y, Y] :func:`element_mask`, the target's logits computed per element
    (Y x D x U instead of T x D x U), and a log-softmax KL of both per element."""
    B, Y = batch.anchor_BY.shape
    tokens_BY, g_BYD, pos_BY = element_inputs(params, batch, cfg=cfg)
    mask_BYY = element_mask(batch.anchor_BY, batch.depth_BY, batch.valid_BY, batch.document_ids_BT)
    out, _ = drafter_forward(
        params,
        new_drafter_cache(cfg, B, Y, bits=False),
        tokens_BY,
        g_BYD,
        jnp.zeros((B,), jnp.int32),
        cfg=cfg,
        embed_VD=embed_VD,
        mask_BTT=mask_BYY,
        positions_BT=pos_BY,
    )
    z_BYU = out.logits.astype(jnp.float32)
    t_BYU = target_logits(target_head_UD, _take(batch.target_hidden_BTD, pos_BY))
    log_p, log_q = jax.nn.log_softmax(t_BYU, axis=-1), jax.nn.log_softmax(z_BYU, axis=-1)
    kl_BY = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    w_BY = loss_weights(batch, pos_BY)
    loss = jnp.sum(w_BY * kl_BY) / jnp.maximum(jnp.sum(w_BY), 1.0)
    correct_BY = ops.argmax_first(z_BYU, axis=-1) == ops.argmax_first(t_BYU, axis=-1)
    return loss, depth_metrics(loss, kl_BY, correct_BY, w_BY, batch.depth_BY, num_depths)


_linear = ops.linear


def _linear_before(weight, x, in_axes: int = 1, preferred_element_type=None):
    """:func:`peagle_jax.ops.linear` as it was before: beyond ``SMALL_ROWS`` rows a bf16 product in the
    operands' dtype, which XLA's CPU computes in f32 (forward and gradient)."""
    n_in = x.shape[x.ndim - in_axes :]
    rows = int(np.prod(x.shape[: x.ndim - in_axes]))
    if rows <= ops.SMALL_ROWS or weight.dtype != jnp.bfloat16:
        return _linear(weight, x, in_axes, preferred_element_type)
    w_OI = weight.reshape(-1, int(np.prod(n_in)))
    y_MO = jnp.dot(x.reshape(rows, -1), w_OI.T, preferred_element_type=preferred_element_type)
    return y_MO.reshape(*x.shape[: x.ndim - in_axes], *weight.shape[: weight.ndim - in_axes])


def reference_ttt_loss(
    params, batch: PEagleBatch, target_head_UD, embed_VD=None, *, cfg: DrafterConfig, num_depths: int
):
    """:func:`peagle_jax.train.ttt.ttt_loss` with each depth attending over the dense [T, K*T] mask
    :func:`peagle_jax.train.ttt.ttt_visible` instead of its chain visibility (the same math)."""
    with mock.patch.object(ttt, "ttt_visibility", ttt.ttt_visible):
        return ttt.ttt_loss(params, batch, target_head_UD, embed_VD, cfg=cfg, num_depths=num_depths)


def _reference_step_fn(state, batch, target_head_UD, embed_VD=None, *, cfg, tcfg, num_depths):
    # Traced with the former objectives and product form; the rest of the step (cast, AdamW) is the library's.
    with (
        mock.patch.object(loop, "peagle_loss", reference_loss),
        mock.patch.object(loop, "ttt_loss", reference_ttt_loss),
        mock.patch.object(ops, "linear", _linear_before),
    ):
        return train_step_fn(state, batch, target_head_UD, embed_VD, cfg=cfg, tcfg=tcfg, num_depths=num_depths)


reference_step = jax.jit(_reference_step_fn, static_argnames=STEP_STATICS, donate_argnums=(0,))
reference_step.__doc__ = """The training step before the fast one (:func:`reference_loss` or
:func:`reference_ttt_loss`, the former bf16 product form); same signature as
:data:`peagle_jax.train.loop.train_step`."""


CONVERSATION = 256  # positions per packed conversation in the benchmark's rows


def loss_mask_of(B: int, T: int, fraction: float) -> np.ndarray:
    """Rows of conversations of :data:`CONVERSATION` positions, each a prompt (no loss) then an answer making
    up ``fraction`` of it (the training data's share of answer tokens; 1: every position in the loss)."""
    prompt = round((1 - fraction) * CONVERSATION)
    return np.broadcast_to((np.arange(T) % CONVERSATION >= prompt).astype(np.int32), (B, T)).copy()


def _batch(seed: int, K, aux, hidden, tokens, loss_mask, *, fast: bool):
    """The benchmark's batch: as the training data builds it (``fast``: elements padded to their bucket of
    :func:`peagle_jax.train.cod.batch_shape`, the LM head on the elements with loss, the target's distribution
    at the loss positions), or as the step before the fast one took it (padded for every position in the
    loss, every element through the head)."""
    B, T = loss_mask.shape
    rng = np.random.default_rng(seed)
    docs = jnp.asarray(np.arange(T) // CONVERSATION, jnp.int32)[None].repeat(B, 0)
    if fast:
        bucketed = bucketed_elements(loss_mask, num_depths=K, rng=rng, buckets=BatchConfig.element_buckets)
        elements, extra = bucketed.elements, (bucketed.loss_at, bucketed.loss_pos)
    else:
        elements, extra = cod_batch(loss_mask, max_elements(T, K), num_depths=K, rng=rng), ()
    fields = (tokens, aux, hidden, loss_mask, docs, *elements, *extra)
    return PEagleBatch(*(jnp.asarray(a) for a in fields))


def _drafter(layers: int, vocab: int, *, shared_embedding: bool, objective: str = "peagle"):
    """(config, random params) of a SmolLM2-sized drafter of ``objective``'s kind over a ``vocab``-id draft
    vocabulary; with ``shared_embedding`` it reads the target's embedding instead of its own (as the shipped
    drafters do)."""
    dcfg = smollm2_sized_drafter(layers=layers, draft_vocab=vocab).replace(algorithm=objective)
    if shared_embedding:
        dcfg = dcfg.replace(target_hidden_size=576, own_embedding=False, embed_requires_grad=False)
    params = init_drafter_params(dcfg, jax.random.key(0))
    params["d2t"] = jnp.zeros((vocab,), jnp.int32)
    params["t2d"] = jnp.zeros((dcfg.layer.vocab_size,), bool).at[:vocab].set(True)
    return dcfg, params


VARIANTS = [(p, d, f) for p in ("before", "after") for d in ("float32", "bfloat16") for f in ("cached", "online")]


def throughput(args) -> dict:
    """Step time and loss tokens/s of every (path, compute dtype, features) variant, rounds interleaved."""
    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.models.gguf import default_model_dir

    tcfg_model, tparams = load_target_any(default_model_dir())
    dcfg, params = _drafter(args.layers, args.draft_vocab, shared_embedding=True, objective=args.objective)
    B, T, K = args.batch_size, args.seq_len, args.num_depths
    head = tparams["embed_tokens"][: args.draft_vocab]
    embed = tparams["embed_tokens"]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, (B, T)).astype(np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32) % CONVERSATION, (B, T))
    docs = np.broadcast_to(np.arange(T, dtype=np.int32) // CONVERSATION, (B, T))
    loss_mask = loss_mask_of(B, T, args.loss_fraction)

    def features():
        return target_features(tparams, tokens, positions, docs, cfg=tcfg_model, dtype="float32")

    cached_aux, cached_hidden = jax.block_until_ready(features())
    features_gflop = _gflop(
        jax.jit(target_features, static_argnames=("cfg", "dtype")).lower(
            tparams, tokens, positions, docs, cfg=tcfg_model, dtype="float32"
        )
    )
    tcfgs = {
        d: TrainConfig(lr=1e-4, warmup_steps=1, total_steps=10_000, compute_dtype=d, objective=args.objective)
        for d in ("float32", "bfloat16")
    }
    states = {v: init_train_state(params, dcfg, tcfgs[v[1]]) for v in VARIANTS}
    times = {v: [] for v in VARIANTS}
    losses = {v: None for v in VARIANTS}
    gflop = {v: None for v in VARIANTS}
    for r in range(args.rounds + 1):  # round 0 compiles
        batches = {
            path: _batch(r, K, cached_aux, cached_hidden, tokens, loss_mask, fast=path == "after")
            for path in ("before", "after")
        }
        for v in VARIANTS:
            path, dtype, mode = v
            step = reference_step if path == "before" else train_step
            batch0 = batches[path]

            def one_step(v=v, step=step, batch0=batch0, mode=mode, dtype=dtype):
                batch = batch0
                if mode == "online":
                    aux, hidden = features()
                    batch = batch0._replace(aux_BTX=aux, target_hidden_BTD=hidden)
                states[v], m = step(states[v], batch, head, embed, cfg=dcfg, tcfg=tcfgs[dtype], num_depths=K)
                return jax.block_until_ready(m["loss"])

            if r:
                times[v] += timed_block(one_step, args.block)
            else:
                losses[v] = float(one_step())
                gflop[v] = _gflop(step.lower(states[v], batch0, head, embed, cfg=dcfg, tcfg=tcfgs[dtype], num_depths=K))
                gflop[v] += features_gflop if mode == "online" else 0.0
    loss_tokens = int(loss_mask.sum())
    out = {
        "batch_size": B,
        "seq_len": T,
        "num_depths": K,
        "draft_vocab": args.draft_vocab,
        "layers": args.layers,
        "objective": args.objective,
        "block": args.block,
        "loss_fraction": loss_tokens / (B * T),
    }
    elements = B * batches["after"].anchor_BY.shape[1]  # the fast step's: every layer's products run over them
    out["product_shape"] = [elements, head.shape[1], args.draft_vocab]
    out["product_gflops"] = {d: lone_product_gflops(*out["product_shape"], d) for d in ("float32", "bfloat16")}
    rows = []
    for v in VARIANTS:
        med = statistics.median(times[v])
        before = statistics.median(times[("before", *v[1:])])
        rows.append(
            {
                "path": v[0],
                "compute_dtype": v[1],
                "features": v[2],
                "step_s": med,
                "loss_tokens_per_s": loss_tokens / med,
                "vs_before": before / med,
                "gflop": gflop[v],
                "gflops": gflop[v] / med,
                "first_loss": losses[v],
            }
        )
    out["rows"] = rows
    return out


def timed_block(one_step, block: int) -> list[float]:
    """Seconds of each timed step of a block of ``block`` calls of ``one_step`` back to back: all but the
    first, or the one call of a block of 1."""
    times = []
    for i in range(block):
        t0 = time.perf_counter()
        one_step()
        if i or block == 1:
            times.append(time.perf_counter() - t0)
    return times


def _gflop(lowered) -> float:
    """XLA's count of the floating-point operations (GFLOP) of a lowered computation, from its cost analysis
    (every multiply and add of its products, and its elementwise operations)."""
    return float(lowered.cost_analysis()["flops"]) / 1e9


def lone_product_gflops(rows: int, d: int, u: int, dtype: str, repeats: int = 5) -> float:
    """GFLOP/s of one product alone, of the LM head's shape over ``rows`` rows (``[rows, d] . [u, d]^T``, as
    the step takes it: :func:`peagle_jax.ops.einsum_f32`, operands in ``dtype``, f32 result), the best of
    ``repeats``: what the CPU's product kernel reaches with nothing around it, against which a step's
    GFLOP/s reads as its utilisation."""
    a = jnp.ones((rows, d), dtype)
    b = jnp.ones((u, d), dtype)
    product = jax.jit(lambda a, b: ops.einsum_f32("MD,UD->MU", a, b))
    jax.block_until_ready(product(a, b))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(product(a, b))
        best = min(best, time.perf_counter() - t0)
    return 2 * rows * d * u / best / 1e9


def parse_sweep(text: str) -> list[tuple[int, int, int, str]]:
    """``--sweep``: comma-separated ``LAYERS:DRAFT_VOCAB:K_TRAIN[:OBJECTIVE]`` (objective default peagle).
    Raises ValueError naming the bad entry."""
    shapes = []
    for entry in text.split(","):
        parts = entry.strip().split(":")
        objective = parts.pop() if len(parts) == 4 else "peagle"
        try:
            layers, vocab, k = (int(x) for x in parts)
        except ValueError:
            raise ValueError(f"--sweep entry {entry!r} is not LAYERS:DRAFT_VOCAB:K_TRAIN[:OBJECTIVE]") from None
        if objective not in OBJECTIVES or min(layers, vocab, k) < 1:
            raise ValueError(f"--sweep entry {entry!r}: positive sizes and an objective of {', '.join(OBJECTIVES)}")
        shapes.append((layers, vocab, k, objective))
    return shapes


def sweep(args, shapes: list[tuple[int, int, int, str]]) -> list[dict]:
    """Cached-feature loss tokens/s of the fast step for each ``(layers, draft_vocab, K_train, objective)`` of
    ``shapes`` (:func:`parse_sweep` of ``--sweep``; compute dtype ``--dtype``), side by side (each round runs a
    ``--block`` of steps of every shape in turn): the cost side of choosing the drafter's shape, or the
    objective; multiply by the accuracy a shape reaches for accuracy per training second."""
    B, T = args.batch_size, args.seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, (B, T)).astype(np.int32)
    loss_mask = loss_mask_of(B, T, args.loss_fraction)
    aux = jnp.asarray(rng.standard_normal((B, T, 3 * 576)), jnp.float32)
    hidden = jnp.asarray(rng.standard_normal((B, T, 576)), jnp.float32)
    embed = jnp.asarray(rng.standard_normal((49152, 576)) * 0.02, jnp.float32)
    runs = []
    for layers, vocab, K, objective in shapes:
        dcfg, params = _drafter(layers, vocab, shared_embedding=True, objective=objective)
        tcfg = TrainConfig(lr=1e-4, warmup_steps=1, total_steps=10_000, compute_dtype=args.dtype, objective=objective)
        state = init_train_state(params, dcfg, tcfg)
        runs.append({"shape": (layers, vocab, K, objective), "dcfg": dcfg, "tcfg": tcfg, "state": state, "t": []})
    for r in range(args.rounds + 1):  # round 0 compiles
        for run in runs:
            K = run["shape"][2]
            batch = _batch(r, K, aux, hidden, tokens, loss_mask, fast=True)

            def one_step(run=run, batch=batch, K=K):
                head = embed[: run["shape"][1]]
                run["state"], m = train_step(
                    run["state"], batch, head, embed, cfg=run["dcfg"], tcfg=run["tcfg"], num_depths=K
                )
                return jax.block_until_ready(m["loss"])

            if r:
                run["t"] += timed_block(one_step, args.block)
            else:
                one_step()
                run["gflop"] = _gflop(
                    train_step.lower(
                        run["state"],
                        batch,
                        embed[: run["shape"][1]],
                        embed,
                        cfg=run["dcfg"],
                        tcfg=run["tcfg"],
                        num_depths=K,
                    )
                )
    base = statistics.median(runs[0]["t"])
    return [
        {
            "layers": run["shape"][0],
            "draft_vocab": run["shape"][1],
            "k_train": run["shape"][2],
            "objective": run["shape"][3],
            "compute_dtype": args.dtype,
            "block": args.block,
            "step_s": statistics.median(run["t"]),
            "loss_tokens_per_s": int(loss_mask.sum()) / statistics.median(run["t"]),
            "vs_first": base / statistics.median(run["t"]),
            "gflop": run["gflop"],
            "gflops": run["gflop"] / statistics.median(run["t"]),
        }
        for run in runs
    ]


def memory(args) -> dict:
    dcfg, params = _drafter(2, args.draft_vocab, shared_embedding=False)
    T, K, D = args.long_seq_len, args.num_depths, dcfg.layer.hidden_size
    Y = max_elements(T, K)
    sds = jax.ShapeDtypeStruct
    batch = PEagleBatch(
        sds((1, T), jnp.int32),
        sds((1, T, 3 * D), jnp.float32),
        sds((1, T, D), jnp.float32),
        sds((1, T), jnp.int32),
        sds((1, T), jnp.int32),
        sds((1, Y), jnp.int32),
        sds((1, Y), jnp.int32),
        sds((1, Y), jnp.bool_),
    )
    head = sds((args.draft_vocab, D), jnp.float32)
    out = {"seq_len": T, "elements": Y}
    for segments in (1, 2, 4, 8):
        tcfg = TrainConfig(segments=segments)
        state = jax.eval_shape(lambda p, t=tcfg: init_train_state(p, dcfg, t), params)
        compiled = train_step.lower(state, batch, head, cfg=dcfg, tcfg=tcfg, num_depths=K).compile()
        mem = compiled.memory_analysis()
        out[f"segments_{segments}"] = {"temp_bytes": int(mem.temp_size_in_bytes)}
    return out


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.train", description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=2, help="rows per step (default 2)")
    p.add_argument("--seq-len", type=int, default=512, help="positions per row for throughput (default 512)")
    p.add_argument("--num-depths", type=int, default=8, help="K_train (default 8)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary (default 8192)")
    p.add_argument("--layers", type=int, default=2, help="drafter layers for throughput (default 2)")
    p.add_argument(
        "--loss-fraction",
        type=float,
        default=0.55,
        help="share of each row's positions in the loss, the rest prompt (default 0.55, the answer share of "
        "train/configs/smollm2-peagle.yaml's regenerated data; 1 = every position)",
    )
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per variant; medians (default 3)")
    p.add_argument(
        "--block",
        type=int,
        default=3,
        help="steps of a variant back to back in each round, the first untimed (default 3; 1: single timed "
        "steps, the variants interleaved)",
    )
    p.add_argument("--long-seq-len", type=int, default=2048, help="positions for the memory analysis (default 2048)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory analysis (P-EAGLE only)")
    p.add_argument(
        "--objective",
        default="peagle",
        choices=OBJECTIVES,
        help="the training objective of the throughput table (default peagle; eagle3: the TTT baseline, "
        "K_train = --num-depths sequential depths)",
    )
    p.add_argument(
        "--sweep",
        help="instead: loss tokens/s of each comma-separated LAYERS:DRAFT_VOCAB:K_TRAIN[:OBJECTIVE] drafter "
        "shape (objective peagle or eagle3, default peagle), side by side",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("float32", "bfloat16"),
        help="compute dtype of --sweep (default bfloat16)",
    )
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 < args.loss_fraction <= 1:
        parser.error(f"--loss-fraction must be in (0, 1], got {args.loss_fraction}")
    if args.block < 1:
        parser.error(f"--block must be at least 1, got {args.block}")
    if args.sweep:
        try:
            shapes = parse_sweep(args.sweep)
        except ValueError as e:
            parser.error(str(e))
        rows = sweep(args, shapes)
        print(
            f"## Loss tokens/s by drafter shape (B={args.batch_size}, T={args.seq_len}, cached features, "
            f"{args.dtype})\n"
        )
        print(
            "| layers | draft vocab | K_train | objective | step | loss tokens/s | vs first | GFLOP | GFLOP/s |\n"
            "|---|---|---|---|---|---|---|---|---|"
        )
        for row in rows:
            print(
                f"| {row['layers']} | {row['draft_vocab']} | {row['k_train']} | {row['objective']} "
                f"| {row['step_s'] * 1e3:.0f} ms | {row['loss_tokens_per_s']:.0f} | {row['vs_first']:.2f}x "
                f"| {row['gflop']:.1f} | {row['gflops']:.0f} |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    res = {"throughput": throughput(args)}
    th = res["throughput"]
    print(
        f"## Training throughput (B={args.batch_size}, T={args.seq_len}, K_train={args.num_depths}, "
        f"U={args.draft_vocab}, {args.layers}-layer SmolLM2-sized drafter, {args.objective} objective)\n"
    )
    print(
        "| step | compute | features | step time | loss tokens/s | vs before | GFLOP | GFLOP/s |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for row in th["rows"]:
        print(
            f"| {row['path']} | {row['compute_dtype']} | {row['features']} | {row['step_s'] * 1e3:.0f} ms "
            f"| {row['loss_tokens_per_s']:.0f} | {row['vs_before']:.2f}x | {row['gflop']:.0f} | {row['gflops']:.0f} |"
        )
    (rows, d, u), lone = th["product_shape"], th["product_gflops"]
    print(
        f"\nA product of the LM head's shape alone ([{rows}, {d}] . [{u}, {d}]^T): "
        f"{lone['float32']:.0f} GFLOP/s in float32, {lone['bfloat16']:.0f} in bfloat16."
    )
    if not args.no_memory and args.objective == "peagle":
        res["memory"] = mem = memory(args)
        print(f"\n## Memory of one step at T={mem['seq_len']} ({mem['elements']} elements)\n")
        print("| segments | temp memory | vs unpartitioned |\n|---|---|---|")
        base = mem["segments_1"]["temp_bytes"]
        for s in (1, 2, 4, 8):
            b = mem[f"segments_{s}"]["temp_bytes"]
            print(f"| {s} | {b / 2**20:.0f} MiB | {b / base:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
