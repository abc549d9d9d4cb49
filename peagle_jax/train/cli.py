"""Command line of the training pipeline (``train/train.py``, ``python -m peagle_jax.train``)."""

from __future__ import annotations

import sys
from pathlib import Path

from peagle_jax.errors import ArgumentParser, UserError, check_output_dir, report
from peagle_jax.models.config import ConfigError
from peagle_jax.platform import compilation_cache_counts


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="train/train.py",
        description="Train a P-EAGLE / EAGLE-3 drafter: prompts, regeneration by the target, draft vocabulary, "
        "packing, target features, sharded training with orbax checkpoints, export in the speculators format. "
        "Running the same command again resumes.",
    )
    p.add_argument("--config", required=True, help="the YAML recipe (see train/configs/)")
    p.add_argument("--output", required=True, help="run directory; the drafter lands in OUTPUT/drafter")
    p.add_argument(
        "--until",
        choices=("data", "features", "train"),
        default="train",
        help="stop after this stage: data (the regenerated answers), features (the feature cache too) or train "
        "(the whole run, the default); running again with a later stage continues",
    )
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides, e.g. optim.lr=1e-4")
    return p


def preflight(recipe, output: str) -> None:
    """The checks that need no model, data or device work, run before the run directory is created: the
    output directory, the paths the recipe names, the mesh against the devices present. A recipe refused
    here leaves nothing behind."""
    check_output_dir(output, "--output")
    t = recipe.target
    if t.model not in ("smollm2", "random"):
        from peagle_jax.checkpoint import is_jax_checkpoint
        from peagle_jax.loading import target_config
        from peagle_jax.models.tensors import open_safetensors

        try:
            target_config(t.model, "float32")
        except FileNotFoundError as err:
            raise ConfigError(f"target.model {t.model}: no such directory") from err
        if not is_jax_checkpoint(t.model):
            open_safetensors(t.model)  # the headers only: missing or unreadable weights are refused here
    tokenizer = t.tokenizer or (t.model if t.model != "random" else "smollm2")
    files = ("tokenizer.json", "tokenizer_config.json")
    if tokenizer != "smollm2" and not any((Path(tokenizer) / f).is_file() for f in files):
        key = "target.tokenizer" if t.tokenizer else "target.model (no target.tokenizer given)"
        raise ConfigError(f"{key} {tokenizer}: no tokenizer there ({' or '.join(files)})")
    prompts = recipe.data.prompts
    if prompts != "sharegpt":
        if not prompts.endswith((".jsonl", ".json")):
            raise ConfigError(f"data.prompts {prompts!r}: expected 'sharegpt', a .jsonl or a .json file")
        if not Path(prompts).is_file():
            raise ConfigError(f"data.prompts {prompts}: no such file")
    init = recipe.drafter.init
    if init and not Path(init).is_dir():
        raise ConfigError(f"drafter.init {init}: no such directory")
    from peagle_jax.train import mesh as meshlib

    if not meshlib.multi_process(recipe.mesh):  # a multi-process run sees its devices after jax.distributed starts
        mesh = meshlib.make_mesh(recipe.mesh.data, recipe.mesh.fsdp)
        meshlib.check_batch_size(recipe.batch.batch_size, mesh)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def use_compilation_cache(recipe) -> Path | None:
    """Point JAX's persistent compilation cache at ``run.compilation_cache`` (the default, a directory or
    none) and count its lookups; returns the directory (None: no cache)."""
    from peagle_jax.platform import chosen_cache, configure_jax_cache, count_cache_lookups

    cache = configure_jax_cache(chosen_cache(recipe.run.compilation_cache))
    count_cache_lookups()
    return cache


def parse_args(argv=None):
    """The command line: options and recipe overrides in any order (``--config X a.b=1 --output DIR c.d=2``)."""
    return build_parser().parse_intermixed_args(argv)


def main(argv=None) -> None:
    """Run (or resume) the recipe; a bad flag, recipe or input exits with status 2 and one ``error:`` line, a
    run stopped by SIGTERM with status 143 once its checkpoint is saved (:mod:`peagle_jax.train.preemption`)."""
    args = parse_args(argv)
    from peagle_jax.train.pipeline import run
    from peagle_jax.train.recipe import load_recipe

    try:
        recipe = load_recipe(args.config, args.overrides)
        preflight(recipe, args.output)
        cache = use_compilation_cache(recipe)
        summary = run(recipe, args.output, log=_log, until=args.until)
    except (UserError, ValueError) as e:
        sys.exit(report(e))
    from peagle_jax.train.mesh import is_primary

    if cache is not None and is_primary():  # JAX writes it from process 0 only (the others count no lookups)
        counts = compilation_cache_counts()
        _log(f"compilation cache {cache}: {counts['hits']} graphs loaded, {counts['misses']} compiled")
    if "preempted" in summary:  # checkpointed at that step; a scheduler sees a run that did not finish
        from peagle_jax.train.preemption import EXIT_STATUS

        sys.exit(EXIT_STATUS)
    if "stage" in summary:
        print(f"done: stopped after the {summary['stage']} stage in {args.output}")
        return
    last = summary["last_eval"] or summary["last_train"]
    acc = ", ".join("-" if a is None else f"{a:.2f}" for a in (last or {}).get("acc_K", []))
    print(f"done: {summary['steps']} steps, drafter in {summary['drafter']}; per-depth top-1 accuracy: {acc}")
