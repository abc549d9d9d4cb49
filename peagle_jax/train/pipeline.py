"""The whole training pipeline behind ``train/train.py``: prompts -> regeneration -> vocabulary -> packing ->
features -> training (sharded, checkpointed, evaluated) -> export in the speculators (or EAGLE) format.

Everything lands under one output directory, and every stage resumes: running the same command again
skips finished regeneration shards and feature chunks and continues training from the latest checkpoint
(exactly, see :mod:`peagle_jax.train.loop`)::

    DIR/run.json          the recipe as run          DIR/regen/       regenerated shards
    DIR/vocab.json        draft vocabulary + stats   DIR/features/    cached target features
    DIR/checkpoints/      orbax states               DIR/metrics.jsonl, DIR/eval.jsonl, DIR/tb/
    DIR/drafter/          the exported drafter (what ``generate --drafter`` loads)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.load import load_drafter, save_drafter
from peagle_jax.drafter.model import init_drafter_params
from peagle_jax.engine.generator import Generator
from peagle_jax.models.config import ConfigError, ModelConfig
from peagle_jax.train import mesh as meshlib
from peagle_jax.train.data import TrainData, split_records
from peagle_jax.train.endpoints import EndpointGenerator, parse_endpoints
from peagle_jax.train.features import build_cache
from peagle_jax.train.loop import (
    append_jsonl,
    checkpoint_manager,
    eval_step,
    init_train_state,
    restore_state,
    save_state,
    summarize,
    truncate_jsonl,
)
from peagle_jax.train.pack import concat_rows, conversation, pack, packing_stats
from peagle_jax.train.preemption import Preemption
from peagle_jax.train.prompts import DataError, load_prompt_items
from peagle_jax.train.recipe import Recipe, recipe_dict
from peagle_jax.train.regen import cached_prompt_ids, chat_prompt_ids, fitted_prompt_ids, read_shards, regenerate
from peagle_jax.train.target import drafter_layer, random_target, save_random_target
from peagle_jax.train.vocab import coverage, draft_vocab, token_counts, unused_token_id


def load_target(recipe: Recipe):
    """``(cfg, params, tokenizer, source)`` of the recipe's target."""
    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.hf_tokenizers import transformers
    from peagle_jax.models.gguf import default_model_dir

    t = recipe.target

    def resolve(name):
        return str(default_model_dir()) if name == "smollm2" else name

    tok_dir = resolve(t.tokenizer or (t.model if t.model != "random" else "smollm2"))
    tokenizer = transformers().AutoTokenizer.from_pretrained(tok_dir)
    if not tokenizer.chat_template:
        raise DataError(f"the tokenizer of {tok_dir} has no chat template; training prompts need one")
    if t.model == "random":
        cfg, params = random_target(t, tokenizer)
        return cfg, params, tokenizer, "random"
    cfg, params = load_target_any(resolve(t.model))
    return cfg, params, tokenizer, resolve(t.model)


def target_head(params) -> jnp.ndarray:
    """The target's LM head [V, D] (its embedding when tied)."""
    return params["lm_head"]["weight"] if "lm_head" in params else params["embed_tokens"]


def build_drafter(recipe: Recipe, tcfg, cfg: ModelConfig, params, used, d2t, t2d, mask_id, source: str):
    """Drafter config and initial params: the target's width and attention shape (plain Llama layers for a
    mixture-of-experts target, :func:`peagle_jax.train.target.drafter_layer`), its LM head rows of the
    draft vocabulary, the vocab maps."""
    d = recipe.drafter
    dcfg = DrafterConfig(
        layer=drafter_layer(cfg, d.num_layers),
        algorithm=tcfg.objective,
        draft_vocab_size=len(used),
        target_hidden_size=cfg.hidden_size,
        aux_layer_ids=cfg.aux_layer_ids,
        mask_token_id=mask_id if tcfg.objective == "peagle" else None,
        own_embedding=not d.share_embedding,
        embed_requires_grad=not d.share_embedding,
        speculative_tokens=d.speculative_tokens,
        verifier_name_or_path=source,
    )
    dparams = init_drafter_params(dcfg, jax.random.key(d.seed))
    dparams["lm_head"]["weight"] = jnp.asarray(target_head(params))[jnp.asarray(used)]
    if not d.share_embedding:
        dparams["embed_tokens"] = jnp.array(params["embed_tokens"], copy=True)
    if dcfg.has_vocab_map:
        dparams["d2t"], dparams["t2d"] = jnp.asarray(d2t), jnp.asarray(t2d)
    return dcfg, dparams


def warm_start(recipe: Recipe, tcfg, cfg: ModelConfig, source: str, log):
    """``(dcfg, dparams, used)`` of the drafter at ``drafter.init``, checked against the target and the
    objective; ``used`` [U] are its draft vocabulary's target ids."""
    path = recipe.drafter.init
    if not Path(path).is_dir():
        raise ConfigError(f"drafter.init {path}: no such directory")
    dcfg, dparams = load_drafter(path, dtype="float32")
    problems = [
        (dcfg.algorithm != tcfg.objective, f"is a {dcfg.algorithm} drafter but optim.objective is {tcfg.objective}"),
        (
            dcfg.layer.vocab_size != cfg.vocab_size,
            f"has vocabulary {dcfg.layer.vocab_size}, the target {cfg.vocab_size}",
        ),
        (
            dcfg.target_hidden_size != cfg.hidden_size,
            f"reads hidden states of width {dcfg.target_hidden_size}, the target's are {cfg.hidden_size}",
        ),
        (
            dcfg.aux_layer_ids is not None and tuple(dcfg.aux_layer_ids) != tuple(cfg.aux_layer_ids),
            f"reads layers {list(dcfg.aux_layer_ids or ())}, the target provides {list(cfg.aux_layer_ids)}",
        ),
    ]
    for bad, why in problems:
        if bad:
            raise ConfigError(f"drafter.init {path} {why}")
    dcfg = dcfg.replace(aux_layer_ids=cfg.aux_layer_ids, verifier_name_or_path=source)
    used = np.arange(dcfg.draft_vocab_size, dtype=np.int32)
    if dcfg.has_vocab_map:
        used = used + np.asarray(dparams["d2t"], np.int32)
    log(
        f"warm start from {path}: {dcfg.algorithm}, {dcfg.layer.num_layers} layers, draft vocab "
        f"{dcfg.draft_vocab_size}, mask token {dcfg.mask_token_id} (the recipe's drafter keys are not used)"
    )
    return dcfg, dparams, used  # load_drafter's leaves are device arrays already


def dataset_records(recipe: Recipe, cfg, tokenizer, log) -> list[dict]:
    """Records in the regeneration format from the prompt file's own first answers (``responses:
    dataset``): the answer's tokens cut at ``max_new_tokens``, an answer that fits ends with EOS as a
    generated one does."""
    dc = recipe.data
    exchanges = load_prompt_items(dc.prompts, dc.max_prompts or None, replies=True)
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else cfg.eos_token_ids[0]
    records, skipped = [], 0
    bar = tqdm(exchanges, desc="tokenize", unit="answer", disable=not recipe.run.progress)
    for i, (conv, messages) in enumerate(bar):
        prompt_ids = chat_prompt_ids(tokenizer, messages[:-1])
        if len(prompt_ids) > dc.max_prompt_tokens:
            skipped += 1
            continue
        answer = tokenizer.encode(messages[-1]["content"], add_special_tokens=False)
        response = answer[: dc.max_new_tokens] if len(answer) >= dc.max_new_tokens else answer + [eos]
        records.append({"index": i, "conversation": conv, "prompt_ids": prompt_ids, "response_ids": response})
    log(f"dataset answers: {len(records)} from {dc.prompts} ({skipped} prompts skipped as too long)")
    if not records:
        raise DataError("no prompt fits data.max_prompt_tokens; nothing to train on")
    return records


def regen_generator(recipe: Recipe, cfg, params, log):
    """What answers the prompts: the recipe's servers, the slot engine (``data.regen_slots``) or the batch
    generator, over the target in ``data.regen_dtype``."""
    dc = recipe.data
    if dc.regen_endpoints:
        urls = parse_endpoints(dc.regen_endpoints)
        gen = EndpointGenerator(urls, concurrency=dc.regen_concurrency)
        log(f"regenerating through {len(urls)} server(s) of {gen.model}: {', '.join(urls)}")
        return gen
    if dc.regen_dtype != cfg.dtype:
        from peagle_jax.checkpoint import cast_floats

        cfg, params = cfg.replace(dtype=dc.regen_dtype), cast_floats(params, dc.regen_dtype)
    seq = dc.max_prompt_tokens + dc.max_new_tokens
    if dc.regen_slots:
        from peagle_jax.train.slot_regen import SlotGenerator

        log(f"regenerating with continuous batching over {dc.regen_slots} slots in {dc.regen_dtype}")
        return SlotGenerator(cfg, params, slots=dc.regen_slots, max_seq_len=seq)
    return Generator(cfg, params, max_seq_len=seq)


def regen_dir(out: Path, k: int, temperature: float) -> Path:
    """The shards of the recipe's k-th temperature: ``regen/`` for ``data.temperature``, ``regen-tT/`` for
    each of ``data.extra_temperatures``."""
    return out / "regen" if k == 0 else out / f"regen-t{temperature:g}"


def regenerated_records(recipe: Recipe, out: Path, cfg, params, tokenizer, log, source: str) -> list[dict]:
    """The regenerated answers of every pass (``data.temperature`` and each of ``extra_temperatures``),
    answering the missing shards first: in this process, or in ``data.regen_workers`` worker processes that
    load the target from ``source``."""
    dc = recipe.data
    items = load_prompt_items(dc.prompts, dc.max_prompts or None, turns=dc.turns)
    log(f"prompts: {len(items)} from {dc.prompts} ({dc.turns} user turns)")

    def tokenize():
        bar = tqdm(items, desc="tokenize", unit="prompt", disable=not recipe.run.progress)
        return [fitted_prompt_ids(tokenizer, p, dc.max_prompt_tokens) for _, p in bar]

    key = {
        "prompts": [[c, p] for c, p in items],
        "max_prompt_tokens": dc.max_prompt_tokens,
        "chat_template": tokenizer.chat_template,
        "vocab": len(tokenizer),
    }
    key = {"digest": hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()}
    prompt_ids = cached_prompt_ids(out / "regen" / "prompt_ids.npz", key, tokenize)
    stops = set(cfg.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    conversations = [c for c, _ in items]
    if dc.regen_workers > 1:  # with the slot engine (the recipe checks)
        from peagle_jax.train.regen_workers import regenerate_in_workers

        regenerate_in_workers(recipe, out, source, prompt_ids, conversations, sorted(stops), log)
    gen = regen_generator(recipe, cfg, params, log)  # with workers, what they left (nothing) is checked here
    records = []
    for k, temperature in enumerate(dc.temperatures):
        shards = regenerate(
            gen,
            prompt_ids,
            regen_dir(out, k, temperature),
            max_prompt_tokens=dc.max_prompt_tokens,
            max_new_tokens=dc.max_new_tokens,
            batch=dc.regen_batch,
            shard_size=dc.shard_size,
            temperature=temperature,
            stop_token_ids=sorted(stops),
            progress=recipe.run.progress,
            dtype=dc.regen_dtype,
            conversations=conversations,
            desc=f"regenerate (temperature {temperature:g})",
        )
        records.extend(read_shards(shards))
    per = len(records) // len(dc.temperatures)
    log(f"regenerated: {len(records)} responses ({len(prompt_ids) - per} prompts skipped as too long)")
    if not records:
        raise DataError("no prompt fits data.max_prompt_tokens; nothing to train on")
    return records


def evaluate(state, data: TrainData, head, embed, *, dcfg, tcfg, K, batches: int, mesh) -> dict:
    """Per-depth loss and top-1 accuracy over the held-out batches (fixed, so runs are comparable)."""
    total = None
    for pos in range(batches):
        m = eval_step(
            state.params,
            meshlib.global_batch(data.batch_at(pos, lazy_features=jax.process_count() > 1), mesh),
            head,
            embed,
            cfg=dcfg,
            tcfg=tcfg,
            num_depths=K,
        )
        total = m if total is None else jax.tree.map(jnp.add, total, m)
    record = summarize(total, int(state.step))
    count = sum(record["count_K"])
    record["loss"] = sum(
        x * c for x, c in zip(record["loss_K"], record["count_K"], strict=True) if x is not None
    ) / max(count, 1)
    return record


STAGES = ("data", "features", "train")


def shared_data(recipe: Recipe, out: Path, log) -> Path:
    """Where this run's regenerated answers and feature cache live: ``data.from_run`` (another run's
    directory, which must exist) or the run's own directory."""
    if not recipe.data.from_run:
        return out
    root = Path(recipe.data.from_run)
    if not (root / "run.json").exists():
        raise ConfigError(f"data.from_run {recipe.data.from_run!r}: not a training run directory (no run.json)")
    if root.resolve() == out.resolve():
        raise ConfigError("data.from_run: names this run's own output directory")
    log(f"data: the answers and features of {root}")
    return root


def run(recipe: Recipe, output: str | Path, *, log=print, until: str = "train") -> dict:
    """Run (or resume) the pipeline into ``output`` up to stage ``until`` (:data:`STAGES`: ``data`` stops
    after the regenerated or dataset answers, ``features`` after the feature cache too); returns a summary
    dict (``{"stage": until, ...}`` when it stops early)."""
    if until not in STAGES:
        raise ConfigError(f"until {until!r}: expected one of {', '.join(STAGES)}")
    t_start = time.perf_counter()
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    meshlib.initialize(recipe.mesh)
    # Several processes: process 0 writes the logs, records and the export; the others stay quiet.
    primary = meshlib.is_primary()
    if not primary:
        log = _quiet
        recipe = dataclasses.replace(recipe, run=dataclasses.replace(recipe.run, progress=False, tensorboard=False))
    else:
        (out / "run.json").write_text(json.dumps(recipe_dict(recipe), indent=1))
    bc, tcfg, K = recipe.batch, recipe.optim, recipe.batch.num_depths
    mesh = meshlib.make_mesh(recipe.mesh.data, recipe.mesh.fsdp)
    meshlib.check_batch_size(bc.batch_size, mesh)

    cfg, params, tokenizer, source = load_target(recipe)
    if source == "random":
        source = str((out / "target").absolute())
        if primary:
            save_random_target(cfg, params, tokenizer, out / "target")
        meshlib.barrier("random target")
    if recipe.target.dtype != cfg.dtype:  # the features' dtype; the random target above is saved in fp32
        from peagle_jax.checkpoint import cast_floats

        cfg, params = cfg.replace(dtype=recipe.target.dtype), cast_floats(params, recipe.target.dtype)
    log(
        f"target: {source} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
        f"features in {cfg.dtype})"
    )
    data_root = shared_data(recipe, out, log)
    if recipe.data.responses == "dataset":
        records = dataset_records(recipe, cfg, tokenizer, log)
    else:
        records = meshlib.primary_first(
            "regeneration", lambda: regenerated_records(recipe, data_root, cfg, params, tokenizer, log, source)
        )

    if until == "data":
        tokens = sum(len(r["response_ids"]) for r in records)
        log(f"data ready: {len(records)} answers, {tokens} answer tokens")
        return {"stage": until, "responses": len(records), "response_tokens": tokens}
    train_records, eval_records = split_records(records, recipe.run.eval_fraction)
    rows = pack([conversation(r) for r in train_records], bc.seq_len)
    n_train = rows.tokens.shape[0]
    rows = concat_rows(rows, pack([conversation(r) for r in eval_records], bc.seq_len))
    stats = packing_stats(rows)
    log(
        f"packed: {stats['conversations']} conversations into {stats['rows']} rows of {bc.seq_len}, "
        f"{stats['fill']:.0%} filled, {stats['loss_tokens']} loss tokens"
    )
    counts = token_counts((r["response_ids"] for r in records), cfg.vocab_size)
    if recipe.drafter.init:
        dcfg, dparams, used = warm_start(recipe, tcfg, cfg, source, log)
        mask_id = dcfg.mask_token_id
    else:
        used, d2t, t2d = draft_vocab(counts, recipe.drafter.draft_vocab_size or cfg.vocab_size)
        mask_id = recipe.drafter.mask_token_id
        if mask_id < 0:
            mask_id = unused_token_id(
                token_counts((r["prompt_ids"] + r["response_ids"] for r in records), cfg.vocab_size),
                cfg.eos_token_ids,
            )
        dcfg, dparams = build_drafter(recipe, tcfg, cfg, params, used, d2t, t2d, mask_id, source)
    cover = coverage(counts, used)
    if primary:
        (out / "vocab.json").write_text(
            json.dumps(
                {
                    "draft_vocab_size": len(used),
                    "coverage": cover,
                    "mask_token_id": mask_id,
                    "responses": len(records),
                    "response_tokens": int(sum(len(r["response_ids"]) for r in records)),
                    **stats,
                },
                indent=1,
            )
        )
    log(f"draft vocab: {len(used)} ids cover {cover:.2%} of response tokens; mask token {mask_id}")

    head = jnp.asarray(target_head(params))[jnp.asarray(used)]
    embed = None if dcfg.own_embedding else jnp.asarray(params["embed_tokens"])

    train_ids, eval_ids = np.arange(n_train), np.arange(n_train, stats["rows"])
    common = dict(
        batch_size=bc.batch_size,
        num_depths=K,
        cod_ratio=bc.cod_ratio,
        cod_ratio_min=bc.cod_ratio_min,
        max_anchors=bc.max_anchors or None,
        feature_dtype=bc.feature_dtype,
        element_buckets=bc.element_buckets,
    )
    if bc.features == "cached":
        source_kw = dict(
            features=meshlib.primary_first(
                "feature cache",
                lambda: build_cache(
                    params,
                    cfg,
                    rows,
                    data_root / "features",
                    dtype=bc.feature_dtype,
                    chunk_rows=bc.batch_size,
                    progress=recipe.run.progress,
                ),
            )
        )
        stored, raw = source_kw["features"].sizes()
        log(f"feature cache: {stored / 2**30:.2f} GiB, {raw / max(stored, 1):.2f}x smaller than the raw values")
    else:
        source_kw = dict(target=(params, cfg))
    if until == "features":
        where = f" in {data_root / 'features'}" if bc.features == "cached" else ""
        log(f"features ready: {stats['rows']} rows{where}")
        return {"stage": until, "rows": stats["rows"]}
    train = TrainData(rows, train_ids, seed=tcfg.seed, **common, **source_kw)
    held = TrainData(rows, eval_ids, seed=tcfg.seed + 1, **common, **source_kw) if len(eval_ids) else None

    state = init_train_state(dparams, dcfg, tcfg)
    shardings = meshlib.state_shardings(state, mesh)
    manager = checkpoint_manager(out / "checkpoints", tcfg)
    if manager.latest_step() is not None:
        state = restore_state(manager, meshlib.place(state, shardings))
        log(f"resumed from step {int(state.step)}")
    state = meshlib.place(state, shardings)
    rep = meshlib.replicated(mesh)
    head, embed = meshlib.place((head, embed), (rep, None if embed is None else rep))
    step_fn = meshlib.sharded_train_step(mesh, shardings, cfg=dcfg, tcfg=tcfg, num_depths=K)
    writer = _tensorboard(out / "tb") if recipe.run.tensorboard else None

    first = int(state.step)
    # Rows past the checkpoint were written by a run killed before it saved them: they are about to be redone.
    if primary:
        truncate_jsonl(out / "metrics.jsonl", lambda r: r["step"] < first)
        truncate_jsonl(out / "eval.jsonl", lambda r: r["step"] <= first)
    bar = tqdm(total=tcfg.total_steps, initial=first, desc="train", unit="step", disable=not recipe.run.progress)
    t_train, tokens = time.perf_counter(), 0
    record = eval_record = None
    end = tcfg.total_steps if not recipe.run.stop_after else min(tcfg.total_steps, first + recipe.run.stop_after)
    lazy, pos = jax.process_count() > 1, int(state.data_pos)  # the data position of step `first`
    batch = train.batch_at(pos, lazy_features=lazy) if first < end else None
    preemption, stopped = Preemption(manager), False
    with preemption:
        for step in range(first, end):
            state, metrics = step_fn(state, meshlib.global_batch(batch, mesh), head, embed)
            step_tokens = int(np.asarray(batch.loss_mask_BT).sum())
            tokens += step_tokens
            if step + 1 < end:  # the next batch is built on the host while the device runs this step
                batch = train.batch_at(pos + step + 1 - first, lazy_features=lazy)
            record = summarize(metrics, step)
            record["loss_tokens"] = step_tokens
            if primary:
                append_jsonl(out / "metrics.jsonl", record)
            _log_tb(writer, "train", record, step)
            if step % recipe.run.log_every == 0:
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc0=_fmt(record["acc_K"][0]))
            last = step + 1 == end
            if held is not None and ((step + 1) % recipe.run.eval_every == 0 or last):
                eval_record = evaluate(
                    state,
                    held,
                    head,
                    embed,
                    dcfg=dcfg,
                    tcfg=tcfg,
                    K=K,
                    batches=min(recipe.run.eval_batches, held.steps_per_epoch),
                    mesh=mesh,
                )
                if primary:
                    append_jsonl(out / "eval.jsonl", eval_record)
                _log_tb(writer, "eval", eval_record, step + 1)
            # Saved after the evaluation: a checkpoint at a step means its evaluation is on record, so a run
            # killed between the two redoes both rather than resuming past an evaluation it never wrote.
            save_state(manager, state)
            if step + 1 in recipe.run.export_at:
                milestone = meshlib.host_tree(state.params)
                if primary:
                    where = out / "drafters" / f"step-{step + 1}"
                    save_drafter(where, dcfg, milestone, layout=recipe.run.export_layout)
            bar.update(1)
            stopped = preemption.reached(int(state.step))  # SIGTERM: this step is saved, the run stops
            if stopped:
                break
    bar.close()
    train_s = time.perf_counter() - t_train
    save_state(manager, state, force=manager.latest_step() != int(state.step))
    manager.wait_until_finished()
    if writer is not None:
        writer.close()
    if stopped:
        done = int(state.step)
        log(f"stopped by SIGTERM after step {done} of {tcfg.total_steps} (saved); run the same command to resume")
        return {"preempted": done}

    export = out / "drafter"
    final = meshlib.host_tree(state.params)
    if primary:
        save_drafter(export, dcfg, final, layout=recipe.run.export_layout)
    summary = {
        "steps": int(state.step),
        "trained_steps_this_run": int(state.step) - first,
        "train_s": train_s,
        "loss_tokens_per_s": tokens / train_s if train_s > 0 and tokens else None,
        "last_train": record,
        "last_eval": eval_record,
        "drafter": str(export),
        "wall_s": time.perf_counter() - t_start,
    }
    recorded = out / "summary.json"
    if summary["trained_steps_this_run"] == 0 and recorded.exists():
        summary = json.loads(recorded.read_text())  # a finished run run again: the invocation that trained stands
    elif primary:
        recorded.write_text(json.dumps(summary, indent=1))
    meshlib.barrier("export")
    log(f"exported {tcfg.objective} drafter to {export}")
    return summary


def _quiet(msg: str) -> None:
    """The log of processes other than 0."""


def _fmt(x):
    return "-" if x is None else f"{x:.2f}"


def _tensorboard(path: Path):
    from tensorboardX import SummaryWriter

    return SummaryWriter(str(path))


def _log_tb(writer, prefix: str, record: dict, step: int) -> None:
    if writer is None:
        return
    writer.add_scalar(f"{prefix}/loss", record["loss"], step)
    for key in ("grad_norm", "lr"):
        if key in record:
            writer.add_scalar(f"{prefix}/{key}", record[key], step)
    for d, (loss, acc) in enumerate(zip(record["loss_K"], record["acc_K"], strict=True)):
        if acc is not None:
            writer.add_scalar(f"{prefix}/acc_depth{d}", acc, step)
            writer.add_scalar(f"{prefix}/loss_depth{d}", loss, step)
