"""Regeneration in several worker processes side by side (``data.regen_workers``), each on its own CPU cores.

One slot engine leaves part of a CPU idle: a decode step is a chain of operations, each split over the
cores, and the cores wait for each other between them. Workers pinned to disjoint cores each run their own
slot engine on their share of the shards (worker w of n takes shards w, w + n, ...) of every temperature's
pass, so that one worker's gaps are another's work: on 2 cores, two one-core workers answer 1.27x the
tokens/s of one engine over both cores (docs/bench/regen/README.md). The shards are the same files a single
process writes (a row's answer depends on its prompt and seed only, up to bf16 near-ties), and a stopped run
resumes from them as ever. A worker exits when the process that started it does, so that a restarted run
never shares a shard with a worker of the run before it.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

from peagle_jax.train.prompts import DataError


def core_shares(workers: int) -> list[set[int] | None]:
    """Each worker's CPU cores: this process's cores dealt out in turn, or None (unpinned) for every worker
    when there are fewer cores than workers or the platform cannot pin."""
    if not hasattr(os, "sched_getaffinity"):
        return [None] * workers
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        return [None] * workers
    return [set(cores[w::workers]) for w in range(workers)]


def _exit_with_parent(parent: int) -> None:
    """End this process as soon as its parent is gone (a killed run must not leave writers behind)."""

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _work(recipe, out: str, source: str, prompt_ids, conversations, stops, worker: int, workers: int, cores, parent):
    """One worker: pin to ``cores``, load the target from ``source`` (cast as the parent casts it), answer its
    share of every pass."""
    _exit_with_parent(parent)
    if cores is not None:
        os.sched_setaffinity(0, cores)  # before JAX starts its CPU client, whose threads then stay on them
    from peagle_jax.checkpoint import cast_floats, load_target_any
    from peagle_jax.platform import chosen_cache, configure_jax_cache
    from peagle_jax.train.pipeline import regen_dir, regen_generator
    from peagle_jax.train.regen import regenerate

    configure_jax_cache(chosen_cache(recipe.run.compilation_cache))  # a resumed run's workers load their graphs
    dc = recipe.data
    cfg, params = load_target_any(source)
    if recipe.target.dtype != cfg.dtype:
        cfg, params = cfg.replace(dtype=recipe.target.dtype), cast_floats(params, recipe.target.dtype)
    gen = regen_generator(recipe, cfg, params, lambda msg: None)
    for k, temperature in enumerate(dc.temperatures):
        regenerate(
            gen,
            prompt_ids,
            regen_dir(Path(out), k, temperature),
            max_prompt_tokens=dc.max_prompt_tokens,
            max_new_tokens=dc.max_new_tokens,
            shard_size=dc.shard_size,
            temperature=temperature,
            stop_token_ids=stops,
            progress=recipe.run.progress,
            dtype=dc.regen_dtype,
            conversations=conversations,
            desc=f"regenerate (temperature {temperature:g}, worker {worker + 1}/{workers})",
            share=(worker, workers),
            bar_position=worker,
        )


def regenerate_in_workers(recipe, out: Path, source: str, prompt_ids, conversations, stops, log) -> None:
    """Answer every missing shard of every pass in ``recipe.data.regen_workers`` worker processes; raises
    :class:`DataError` naming a worker that failed (what the workers answered is kept)."""
    n = recipe.data.regen_workers
    shares = core_shares(n)
    where = ", ".join("cores " + ",".join(map(str, sorted(c))) for c in shares) if shares[0] else "unpinned"
    log(f"regenerating in {n} worker processes ({where})")
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(
            target=_work,
            args=(recipe, str(out), source, prompt_ids, conversations, stops, w, n, shares[w], os.getpid()),
            name=f"regen-worker-{w + 1}",
        )
        for w in range(n)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    failed = [(w, p.exitcode) for w, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        w, code = failed[0]
        raise DataError(
            f"regeneration worker {w + 1} of {n} stopped with exit code {code} (its error is above); "
            "the answers so far are kept: run again to resume"
        )
