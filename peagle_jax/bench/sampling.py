"""``python -m peagle_jax.bench.sampling``: the sampler with and without its no-filter shortcut, side by side.

:func:`peagle_jax.sampling.processed_logits` finds the top-k and top-p thresholds by two bitwise searches
(64 passes over the vocabulary). Where a graph may branch (CPU, GPU, TPU) a batch in which no row filters
skips them; Neuron runs the branch-free graph. This times :func:`peagle_jax.sampling.sample` both ways
(each compiled ahead of time) for each row count and top_p, interleaved round by round: the rows of one
plain decode step, or of a verify step (rows x tree nodes). Prints a markdown table (medians); ``--json
FILE`` writes it too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from peagle_jax import errors


def compiled(rows: int, vocab: int, top_p: float, static: bool):
    """``(sample, args)``: the sampler compiled for ``rows`` x ``vocab`` logits at temperature 0.8 and
    ``top_p``, branch-free when ``static``, and its inputs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from peagle_jax.platform import static_graphs
    from peagle_jax.sampling import SamplingParams, sample

    logits = jnp.asarray(np.random.default_rng(0).standard_normal((rows, vocab), np.float32) * 3)
    args = (
        logits,
        SamplingParams.make(rows, 0.8, 0, top_p),
        jnp.arange(rows, dtype=jnp.uint32),
        jnp.zeros(rows, jnp.int32),
    )
    with static_graphs() if static else contextlib.nullcontext():
        return jax.jit(sample).lower(*args).compile(), args


def measure(rows: int, vocab: int, top_p: float, rounds: int) -> dict[str, float]:
    """Median ms of the branch-free and the branching sampler, interleaved."""
    from peagle_jax.bench.linear import interleaved

    static, args = compiled(rows, vocab, top_p, static=True)
    branching, _ = compiled(rows, vocab, top_p, static=False)
    return interleaved({"branch-free": static, "branching": branching}, args, rounds)


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.sampling", description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,8,64", help="logit rows per call, comma-separated (default 1,8,64)")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default 49152, SmolLM2's)")
    p.add_argument("--top-p", default="1.0,0.9", help="top_p values, comma-separated (default 1.0,0.9)")
    p.add_argument("--rounds", type=int, default=20, help="timed rounds per case (default 20)")
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rows = errors.comma_ints(args.rows, "--rows", "1,8,64", minimum=1)
        top_ps = errors.comma_floats(args.top_p, "--top-p", "1.0,0.9")
        if not all(0 < t <= 1 for t in top_ps):
            raise errors.UserError(f"--top-p {args.top_p!r}: every value must be in (0, 1]")
        errors.at_least(2, {"--vocab": args.vocab})
        errors.at_least(1, {"--rounds": args.rounds})
    except errors.UserError as err:
        return errors.report(err)
    results = []
    lines = ["| rows | top_p | branch-free | branching | branching / branch-free |", "|---|---|---|---|---|"]
    for r in rows:
        for t in top_ps:
            ms = measure(r, args.vocab, t, args.rounds)
            ratio = ms["branching"] / ms["branch-free"]
            results.append({"rows": r, "top_p": t, "ms": ms, "ratio": ratio})
            lines.append(f"| {r} | {t} | {ms['branch-free']:.2f} ms | {ms['branching']:.2f} ms | {ratio:.2f}x |")
            print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
