"""``python -m peagle_jax.bench.linear``: the two forms of the weight products, side by side, by row count.

Every projection of the target (and of the drafter) is ``x . W^T`` with ``W`` in ``[out, in]`` layout
(:func:`peagle_jax.ops.linear`). XLA can compute it as ``x @ W^T`` or as ``W @ x^T`` (then transposed); on
its CPU backend the first repacks all of W on every call as soon as x has more than one row, which a
verify of a few tokens, a draft, or a decode step of a small batch pays on every layer. This times, for
each row count M, all of the model's weight matrices (every layer's, and the LM head) multiplied by an
M-row input in each form, chained so that they run one after the other as in a forward pass, interleaved
round by round, and reports the ratio and which form ``ops.linear`` picks. Prints a markdown table
(medians); ``--json FILE`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

from peagle_jax import errors


def _matrices(params) -> list:
    """Every weight matrix of the target's products as ``[out, in]`` (heads flattened): the projections and
    the LM head (the embedding where tied; an untied embedding is a lookup, not a product)."""
    import jax

    mats = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        if leaf.ndim < 2 or ("embed_tokens" in name and "lm_head" in params):
            continue
        in_axes = 2 if "o_proj" in name else 1  # o_proj is [D, N, H]: it contracts heads and head dims
        mats.append(leaf.reshape(-1, math.prod(leaf.shape[leaf.ndim - in_axes :])))
    return mats


def _chained(form):
    """A jitted pass over all matrices: each product's mean nudges the next input, so they run in order."""
    import jax
    import jax.numpy as jnp

    def run(mats, xs):
        carry = jnp.zeros((), jnp.float32)
        for w, x in zip(mats, xs, strict=True):
            y = form(w, x + carry.astype(x.dtype))
            carry = jnp.mean(y) * 1e-6
        return carry

    return jax.jit(run)


def forms():
    """name -> ``f(w [out, in], x [M, in]) -> [M, out]``."""
    import jax
    import jax.numpy as jnp

    from peagle_jax import ops

    return {
        "x @ W^T": lambda w, x: jnp.dot(x, w.T),
        "W @ x^T": lambda w, x: jax.lax.optimization_barrier(jnp.dot(w, x.T)).T,
        "ops.linear": ops.linear,
    }


def measure(mats, rows: int, rounds: int) -> dict:
    """Median ms of one pass over ``mats`` per form, at ``rows`` input rows."""
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    xs = [jax.numpy.asarray(rng.standard_normal((rows, w.shape[1]), np.float32)).astype(w.dtype) for w in mats]
    return interleaved({name: _chained(f) for name, f in forms().items()}, (mats, xs), rounds)


def interleaved(fns: dict, args: tuple, rounds: int) -> dict[str, float]:
    """Median ms of each jitted ``fns[name](*args)``: each compiled and run once untimed, then ``rounds``
    rounds with the functions taking turns in an order that rotates each round, so that the machine's noise
    hits all of them alike."""
    for f in fns.values():  # compile, then one untimed pass
        f(*args).block_until_ready()
        f(*args).block_until_ready()
    times = {name: [] for name in fns}
    order = list(fns)
    for i in range(rounds):
        for name in order[i % len(order) :] + order[: i % len(order)]:
            t0 = time.perf_counter()
            fns[name](*args).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def load_model(model: str, dtype: str):
    """``(cfg, params)`` of a ``--model`` (a directory or 'smollm2'), or None after printing why it could not
    be loaded (a user mistake: one line, no traceback)."""
    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.errors import UserError
    from peagle_jax.loading import resolve_model_dir

    try:
        return load_target_any(resolve_model_dir(model), dtype=dtype)
    except (UserError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return None


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.linear", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="target directory or 'smollm2' (default)")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256", help="row counts M, comma-separated")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds per row count (default 15)")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and inputs (default float32)"
    )
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rows = errors.comma_ints(args.rows, "--rows", "1,8,64", minimum=1)
        errors.at_least(1, {"--rounds": args.rounds})
    except errors.UserError as err:
        return errors.report(err)
    from tqdm import tqdm

    from peagle_jax import ops

    loaded = load_model(args.model, args.dtype)
    if loaded is None:
        return 2
    cfg, params = loaded
    mats = _matrices(params)
    mb = sum(w.nbytes for w in mats) / 2**20
    results = []
    for m in tqdm(rows, desc="row counts", file=sys.stderr):
        ms = measure(mats, m, args.rounds)
        picks = "x @ W^T" if m > ops.SMALL_ROWS else "W @ x^T" if args.dtype == "float32" else "bf16 kernel, >= 4 rows"
        results.append({"rows": m, "ms": ms, "ratio": ms["W @ x^T"] / ms["x @ W^T"], "picks": picks})
    print(f"{len(mats)} weight matrices, {mb:.0f} MiB ({cfg.dtype}); median ms per pass of {args.rounds} rounds\n")
    print("| rows M | x @ W^T | W @ x^T (barrier) | W @ x^T / x @ W^T | ops.linear picks | ops.linear |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ms = r["ms"]
        print(
            f"| {r['rows']} | {ms['x @ W^T']:.1f} ms | {ms['W @ x^T']:.1f} ms | {r['ratio']:.2f}x | {r['picks']} "
            f"| {ms['ops.linear']:.1f} ms |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"model": str(args.model), "dtype": args.dtype, "weights_mib": mb, "results": results}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
