"""``python -m peagle_jax.neuron``: export every graph for Neuron / TPU and lint it; plan a deployment.

Examples::

    python -m peagle_jax.neuron export --out /tmp/peagle-neuron
    python -m peagle_jax.neuron export --model DIR --drafter DIR --buckets neuron/buckets.yaml --out OUT
    python -m peagle_jax.neuron export --model neuron/configs/gpt-oss-20b.json --k 10 --no-write --out OUT
    python -m peagle_jax.neuron plan --instance trn1.2xlarge --tp 2 --k 7 --acceptance-length 3.5
    python -m peagle_jax.neuron plan --model neuron/configs/gpt-oss-20b.json --k 10 --acceptance-length 3

``export`` exits 0 when every graph is clean, 1 when the lint found anything (the findings are printed),
2 on a usage error.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from peagle_jax.errors import ArgumentParser, UserError, check_output_dir, comma_ints, comma_list, report


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m peagle_jax.neuron", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="export every graph with jax.export for neuron and tpu, and lint it")
    e.add_argument(
        "--model",
        default="smollm2",
        help="target model directory, a config.json file (neuron/configs/ has GPT-OSS and Qwen3-Coder), or "
        "'smollm2' (default)",
    )
    e.add_argument(
        "--drafter",
        help="drafter directory (default: the shipped drafter for smollm2, a randomly initialised drafter of the "
        "released P-EAGLE drafter's shape for the targets in neuron/configs/, else a 2-layer P-EAGLE drafter of "
        "the target's shape; a graph's shapes do not depend on the weights)",
    )
    e.add_argument("--buckets", help="serving buckets YAML (default: the built-in small set, see neuron/README.md)")
    e.add_argument("--k", help="draft lengths K, comma-separated, instead of the buckets' k_values")
    e.add_argument("--out", required=True, help="output directory")
    e.add_argument(
        "--platforms",
        default="neuron,tpu",
        help="comma-separated platforms to export for: neuron, tpu (default neuron,tpu)",
    )
    e.add_argument("--no-write", action="store_true", help="lint only; write nothing but the manifest")
    e.add_argument(
        "--tp",
        type=int,
        default=1,
        help="export the tensor-parallel graphs for this many devices (NeuronCores); must divide the kv heads",
    )
    e.add_argument(
        "--expert-split",
        choices=["auto", "experts", "width"],
        default="auto",
        help="with --tp, how a mixture of experts is split: whole experts, or every expert's width "
        "(peagle_jax.sharding; default auto)",
    )
    from peagle_jax.neuron.plan import add_experts_flag, add_plan_parser

    add_experts_flag(e)
    add_plan_parser(sub)
    return p


def run_export(args) -> int:
    import jax
    from tqdm import tqdm

    from peagle_jax.neuron.buckets import load_buckets
    from peagle_jax.neuron.export import PLATFORMS, export_all
    from peagle_jax.neuron.graphs import all_graphs

    overrides = {}
    if args.k is not None:
        overrides["k_values"] = tuple(comma_ints(args.k, "--k", "3,7", minimum=1))
    platforms = tuple(comma_list(args.platforms, "--platforms", "neuron,tpu"))
    unknown = [p for p in platforms if p not in PLATFORMS]
    if unknown:
        raise UserError(f"--platforms: unknown platform {unknown[0]!r}; choose from {', '.join(PLATFORMS)}")
    if args.tp < 1:
        raise UserError(f"--tp must be >= 1, got {args.tp}")
    check_output_dir(args.out, "--out")
    if args.drafter is not None and not Path(args.drafter).is_dir():
        raise UserError(f"--drafter {args.drafter}: no such directory")
    buckets = load_buckets(args.buckets, **overrides)
    from peagle_jax.neuron.targets import configs

    cfg, dcfg, drafter_note = configs(args.model, args.drafter, buckets.dtype, args.experts)
    graphs = all_graphs(cfg, dcfg, buckets, tp=args.tp, expert_split=args.expert_split)
    held = f", {cfg.moe.experts} experts" if cfg.moe is not None else ""
    print(f"target: {args.model} ({cfg.family}, {cfg.num_layers} layers, vocab {cfg.vocab_size}, {cfg.dtype}{held})")
    print(drafter_note)
    print(f"buckets: {buckets}" + (f"; tensor parallel over {args.tp} devices" if args.tp > 1 else ""))
    print(f"{len(graphs)} graphs x platforms {', '.join(platforms)} (jax {jax.__version__}) -> {args.out}")
    bar = tqdm(total=len(graphs), desc="export + lint", file=sys.stderr)
    out = Path(args.out)
    staging = _staging_dir(out)
    try:
        findings = export_all(
            graphs, staging, platforms, write=not args.no_write, progress=lambda _: bar.update(), dtype=buckets.dtype
        )
        _publish(staging, out)
    except ValueError as err:
        raise UserError(f"export failed: {err}") from None
    finally:
        bar.close()
        shutil.rmtree(staging, ignore_errors=True)
    bad = 0
    for name, per_platform in findings.items():
        for platform, found in per_platform.items():
            for f in found:
                bad += 1
                print(f"{platform}/{name}.mlir: {f}")
    if bad:
        print(f"lint: {bad} finding(s); see above. These graphs are not Neuron-ready.")
        return 1
    print(f"lint: clean ({len(graphs)} graphs, {len(platforms)} platforms)")
    if "neuron" in platforms and not args.no_write:
        print(f"compile them on a Neuron host with: sh {Path(args.out) / 'neuron' / 'compile.sh'}")
    return 0


def _staging_dir(out: Path) -> Path:
    """A fresh directory that the export writes into, on ``out``'s file system (inside ``out`` when it
    exists, else under its nearest existing ancestor), so that a failed or interrupted export leaves ``out``
    as it was and a finished one moves its files into place by rename."""
    parent = out.absolute()
    while not parent.is_dir():
        parent = parent.parent
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=parent))


def _publish(staging: Path, out: Path) -> None:
    """Move every file the export wrote from ``staging`` into ``out`` (created), replacing older ones."""
    for src in sorted(p for p in staging.rglob("*") if p.is_file()):
        dst = out / src.relative_to(staging)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(src, dst)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "export":
            return run_export(args)
        from peagle_jax.neuron.plan import run_plan

        return run_plan(args)
    except (UserError, FileNotFoundError) as err:
        return report(err)


if __name__ == "__main__":
    sys.exit(main())
