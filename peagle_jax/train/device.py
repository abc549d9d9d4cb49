"""``python -m peagle_jax.train.device --output DIR``: the device recipe, one command from prompts to a drafter
with its card and learning curve, sized to run in about 12 minutes on one GPU or TPU.

It runs the training pipeline on ``--config`` (default ``train/configs/smollm2-device.yaml``: regeneration in
bf16 with continuous batching, the feature cache, training with drafters exported along the way), then the
learning curve on held-out MT-Bench (:mod:`peagle_jax.train.curve`) over those exports, and writes into DIR:

    DIR/drafter/            the drafter (speculators format) and its card, README.md
    DIR/curve.json, curve.png   acceptance length per tree against training tokens
    DIR/device.json         the device, the command, each stage's wall time

Running it again resumes every stage. On a CPU the same command with ``--config train/configs/tiny.yaml``
(a random tiny target) runs end to end in a minute: what CI checks.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from peagle_jax import errors
from peagle_jax.errors import UserError

DEFAULT_CONFIG = "train/configs/smollm2-device.yaml"


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.train.device", description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True, help="run directory; the drafter, its card and curve land here")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="the training recipe (default %(default)s)")
    p.add_argument("--questions", type=int, default=0, help="MT-Bench questions for the curve (0 = all 80)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per curve answer (default 128)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    command = "python -m peagle_jax.train.device " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    out = Path(args.output)
    try:
        import jax

        from peagle_jax.train import curve
        from peagle_jax.train.card import card, collect
        from peagle_jax.train.cli import preflight
        from peagle_jax.train.pipeline import run
        from peagle_jax.train.recipe import load_recipe

        recipe = load_recipe(args.config, args.overrides)
        preflight(recipe, args.output)
        dev = jax.devices()[0]
        device = dev.platform if dev.device_kind == dev.platform else f"{dev.platform} ({dev.device_kind})"
        times = {}
        t0 = time.perf_counter()
        summary = run(recipe, out, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        times["pipeline_s"] = time.perf_counter() - t0
        model = str(out / "target") if recipe.target.model == "random" else recipe.target.model
        t1 = time.perf_counter()
        res = curve.curve(out, model=model, questions=args.questions or None, max_new_tokens=args.max_new_tokens)
        times["curve_s"] = time.perf_counter() - t1
        (out / "curve.json").write_text(json.dumps(res, indent=1))
        curve.plot(res, out / "curve.png")
        dst = Path(summary["drafter"])
        text = card(
            collect(out),
            name=f"{out.name} (device recipe)",
            command=command,
            ship_command="",
            size_bytes=sum(f.stat().st_size for f in dst.glob("*.safetensors")) or None,
            arch=json.loads((dst / "config.json").read_text()),
            machine=device,
        )
        text += "\n## Learning curve (held-out MT-Bench)\n\n" + curve.markdown(res) + "\n"
    except (UserError, ValueError) as e:
        return errors.report(e)
    (dst / "README.md").write_text(text)
    times["total_s"] = time.perf_counter() - t0
    (out / "device.json").write_text(json.dumps({"device": device, "command": command, **times}, indent=1))
    print(curve.markdown(res))
    print(f"done in {times['total_s']:.0f} s on {device}: drafter and card in {dst}, curve in {out / 'curve.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
