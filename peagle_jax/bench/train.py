"""``python -m peagle_jax.bench.train``: drafter training throughput with online vs cached target features,
and the memory of one step with and without sequence partitioning, measured side by side in one run.

Throughput: a SmolLM2-sized 2-layer P-EAGLE drafter (random weights: speed does not depend on values)
trained on random token rows of ``--seq-len``; *cached* feeds precomputed features (as read from the
feature cache), *online* runs the real SmolLM2 target over each batch first
(:func:`peagle_jax.train.features.target_features`, the path ``batch.features: online`` takes). Rounds
alternate the two; medians of the step times are reported, in loss-weighted tokens per second (every slot
carries loss here).

Memory: XLA's compiled memory analysis (``temp`` buffers: activations, attention scores and gradients)
of one train step at ``--long-seq-len`` positions for 1 (unpartitioned), 2, 4 and 8 segments. Compile only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax import errors
from peagle_jax.bench.draft import smollm2_sized_drafter
from peagle_jax.drafter.model import init_drafter_params
from peagle_jax.train.cod import cod_batch, max_elements
from peagle_jax.train.config import TrainConfig
from peagle_jax.train.features import target_features
from peagle_jax.train.loop import init_train_state, train_step
from peagle_jax.train.objective import PEagleBatch


def _batch(rng, B, T, K, aux, hidden, tokens):
    loss_mask = np.ones((B, T), np.int32)
    return PEagleBatch(
        jnp.asarray(tokens),
        aux,
        hidden,
        jnp.asarray(loss_mask),
        jnp.zeros((B, T), jnp.int32),
        *(jnp.asarray(a) for a in cod_batch(loss_mask, max_elements(T, K), num_depths=K, rng=rng)),
    )


def _drafter(layers: int, vocab: int, *, shared_embedding: bool):
    """(config, random params) of a SmolLM2-sized P-EAGLE drafter over a ``vocab``-id draft vocabulary; with
    ``shared_embedding`` it reads the target's embedding instead of its own (as the shipped drafters do)."""
    dcfg = smollm2_sized_drafter(layers=layers, draft_vocab=vocab)
    if shared_embedding:
        dcfg = dcfg.replace(target_hidden_size=576, own_embedding=False, embed_requires_grad=False)
    params = init_drafter_params(dcfg, jax.random.key(0))
    params["d2t"] = jnp.zeros((vocab,), jnp.int32)
    params["t2d"] = jnp.zeros((dcfg.layer.vocab_size,), bool).at[:vocab].set(True)
    return dcfg, params


def throughput(args) -> dict:
    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.models.gguf import default_model_dir

    tcfg_model, tparams = load_target_any(default_model_dir())
    dcfg, params = _drafter(2, args.draft_vocab, shared_embedding=True)
    tcfg = TrainConfig(lr=1e-4, warmup_steps=1, total_steps=10_000)
    B, T, K = args.batch_size, args.seq_len, args.num_depths
    head = tparams["embed_tokens"][: args.draft_vocab]
    embed = tparams["embed_tokens"]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, (B, T)).astype(np.int32)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    docs = np.zeros((B, T), np.int32)

    def features():
        return target_features(tparams, tokens, positions, docs, cfg=tcfg_model, dtype="float32")

    cached_aux, cached_hidden = jax.block_until_ready(features())
    states = {m: init_train_state(params, dcfg, tcfg) for m in ("cached", "online")}
    times = {"cached": [], "online": []}
    for r in range(args.rounds + 1):  # round 0 compiles
        for mode in ("cached", "online"):
            t0 = time.perf_counter()
            aux, hidden = (cached_aux, cached_hidden) if mode == "cached" else features()
            batch = _batch(np.random.default_rng(r), B, T, K, aux, hidden, tokens)
            states[mode], m = train_step(states[mode], batch, head, embed, cfg=dcfg, tcfg=tcfg, num_depths=K)
            jax.block_until_ready(m["loss"])
            if r:
                times[mode].append(time.perf_counter() - t0)
    out = {}
    for mode, ts in times.items():
        med = statistics.median(ts)
        out[mode] = {"step_s": med, "tokens_per_s": B * T / med}
    out["cached_over_online"] = out["online"]["step_s"] / out["cached"]["step_s"]
    return out


def sweep(args) -> list[dict]:
    """Cached-feature step time of each ``layers:draft_vocab:K_train`` shape in ``--sweep``, side by side
    (rounds alternate the shapes): the cost side of choosing the drafter's shape."""
    shapes = [tuple(int(x) for x in s.split(":")) for s in args.sweep.split(",")]
    B, T = args.batch_size, args.seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, (B, T)).astype(np.int32)
    aux = jnp.asarray(rng.standard_normal((B, T, 3 * 576)), jnp.float32)
    hidden = jnp.asarray(rng.standard_normal((B, T, 576)), jnp.float32)
    embed = jnp.asarray(rng.standard_normal((49152, 576)) * 0.02, jnp.float32)
    tcfg = TrainConfig(lr=1e-4, warmup_steps=1, total_steps=10_000)
    runs = []
    for layers, vocab, K in shapes:
        dcfg, params = _drafter(layers, vocab, shared_embedding=True)
        runs.append({"shape": (layers, vocab, K), "dcfg": dcfg, "state": init_train_state(params, dcfg, tcfg), "t": []})
    for r in range(args.rounds + 1):  # round 0 compiles
        for run in runs:
            K = run["shape"][2]
            batch = _batch(np.random.default_rng(r), B, T, K, aux, hidden, tokens)
            t0 = time.perf_counter()
            run["state"], m = train_step(
                run["state"], batch, embed[: run["shape"][1]], embed, cfg=run["dcfg"], tcfg=tcfg, num_depths=K
            )
            jax.block_until_ready(m["loss"])
            if r:
                run["t"].append(time.perf_counter() - t0)
    base = statistics.median(runs[0]["t"])
    return [
        {
            "layers": run["shape"][0],
            "draft_vocab": run["shape"][1],
            "k_train": run["shape"][2],
            "step_s": statistics.median(run["t"]),
            "vs_first": statistics.median(run["t"]) / base,
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
    p.add_argument("--seq-len", type=int, default=256, help="positions per row for throughput (default 256)")
    p.add_argument("--num-depths", type=int, default=8, help="K_train (default 8)")
    p.add_argument("--draft-vocab", type=int, default=12288, help="draft vocabulary (default 12288)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per mode; medians (default 5)")
    p.add_argument("--long-seq-len", type=int, default=2048, help="positions for the memory analysis (default 2048)")
    p.add_argument(
        "--sweep",
        help="instead: step time of each comma-separated LAYERS:DRAFT_VOCAB:K_TRAIN drafter shape, side by side",
    )
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.sweep:
        rows = sweep(args)
        print(f"## Step time by drafter shape (B={args.batch_size}, T={args.seq_len}, cached features)\n")
        print("| layers | draft vocab | K_train | step | vs first |\n|---|---|---|---|---|")
        for row in rows:
            print(
                f"| {row['layers']} | {row['draft_vocab']} | {row['k_train']} | {row['step_s'] * 1e3:.0f} ms "
                f"| {row['vs_first']:.2f}x |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    res = {"throughput": throughput(args), "memory": memory(args)}
    th, mem = res["throughput"], res["memory"]
    print(
        f"## Training throughput (B={args.batch_size}, T={args.seq_len}, K_train={args.num_depths}, "
        f"U={args.draft_vocab}, 2-layer SmolLM2-sized drafter)\n"
    )
    print("| features | step | tokens/s |\n|---|---|---|")
    for mode in ("cached", "online"):
        print(f"| {mode} | {th[mode]['step_s'] * 1e3:.0f} ms | {th[mode]['tokens_per_s']:.0f} |")
    print(f"\ncached is {th['cached_over_online']:.2f}x faster than online\n")
    print(f"## Memory of one step at T={mem['seq_len']} ({mem['elements']} elements)\n")
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
