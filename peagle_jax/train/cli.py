"""Command line of the training pipeline (``train/train.py``, ``python -m peagle_jax.train``)."""

from __future__ import annotations

import argparse
import sys

from peagle_jax.errors import UserError
from peagle_jax.models.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train/train.py",
        description="Train a P-EAGLE / EAGLE-3 drafter: prompts, regeneration by the target, draft vocabulary, "
        "packing, target features, sharded training with orbax checkpoints, export in the speculators format. "
        "Running the same command again resumes.",
    )
    p.add_argument("--config", required=True, help="the YAML recipe (see train/configs/)")
    p.add_argument("--output", required=True, help="run directory; the drafter lands in OUTPUT/drafter")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides, e.g. optim.lr=1e-4")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from peagle_jax.train.pipeline import run
    from peagle_jax.train.recipe import load_recipe

    try:
        recipe = load_recipe(args.config, args.overrides)
        summary = run(recipe, args.output, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except (UserError, ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    last = summary["last_eval"] or summary["last_train"]
    acc = ", ".join("-" if a is None else f"{a:.2f}" for a in (last or {}).get("acc_K", []))
    print(f"done: {summary['steps']} steps, drafter in {summary['drafter']}; per-depth top-1 accuracy: {acc}")
