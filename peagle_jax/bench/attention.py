"""``python -m peagle_jax.bench.attention``: the forms of the attention scores, side by side, by window.

:func:`peagle_jax.ops.attention` computes a step's scores (T new queries per row against a window of W
cache slots) as ``q @ K^T``, as ``K @ q^T`` then transposed, or in either order padded for the bf16 library
kernel (see there). This times, for each window W and query count T, one attention per layer of the model
in each form, chained as in a forward pass, on ``--rows`` rows (1: a single request; 128: a regeneration's
slots), interleaved round by round, and reports which form ``ops.attention`` picks, its time against
``q @ K^T`` and against the fastest other form. Prints a markdown table (medians); ``--json FILE`` writes it
too.
"""

from __future__ import annotations

import argparse
import json
import sys

from peagle_jax import errors

FORMS = ("q @ K^T", "K @ q^T", "bf16 q @ K^T", "bf16 K @ q^T")


def _chained(form, layers: int):
    """A jitted pass of ``layers`` attentions, each one's output the next one's queries."""
    import jax

    from peagle_jax import ops

    def run(q, ks, vs, visible):
        for i in range(layers):
            q = ops.attention(q, ks[i], vs[i], visible, form=form).astype(q.dtype)
        return q

    return jax.jit(run)


def measure(cfg, window: int, queries: int, rounds: int, rows: int = 1) -> dict[str, float]:
    """Median ms of one pass over the model's layers per form: ``queries`` new tokens of each of ``rows`` rows
    against ``window`` slots (every slot visible), random keys, values and queries in the model's dtype."""
    import jax.numpy as jnp
    import numpy as np

    from peagle_jax.bench.linear import interleaved

    rng = np.random.default_rng(0)
    dt, G, H = cfg.jnp_dtype, cfg.num_kv_heads, cfg.head_dim

    def rand(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dt)

    q = rand(rows, queries, cfg.num_heads, H)
    ks = [rand(rows, G, window, H) for _ in range(cfg.num_layers)]
    vs = [rand(rows, G, window, H) for _ in range(cfg.num_layers)]
    visible = jnp.ones((rows, queries, window), bool)
    fns = {form: _chained(form, cfg.num_layers) for form in FORMS}
    return interleaved(fns, (q, ks, vs, visible), rounds)


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.attention", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="target directory or 'smollm2' (default)")
    p.add_argument("--windows", default="256,1024,2048", help="attention windows W (cache slots), comma-separated")
    p.add_argument("--queries", default="1,8", help="new tokens T per step (1: decode; K'+1 or tree nodes + 1: verify)")
    p.add_argument("--rows", type=int, default=1, help="rows (requests or slots) per step (default 1)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds per setting (default 15)")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="cache and queries (default float32)"
    )
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        windows = errors.comma_ints(args.windows, "--windows", "256,1024", minimum=1)
        queries = errors.comma_ints(args.queries, "--queries", "1,8", minimum=1)
        errors.at_least(1, {"--rounds": args.rounds, "--rows": args.rows})
    except errors.UserError as err:
        return errors.report(err)
    from tqdm import tqdm

    from peagle_jax import ops
    from peagle_jax.bench.linear import load_model

    loaded = load_model(args.model, args.dtype)
    if loaded is None:
        return 2
    cfg = loaded[0]
    J = cfg.num_heads // cfg.num_kv_heads
    settings = [(w, t) for w in windows for t in queries]
    results = []
    for w, t in tqdm(settings, desc="settings", file=sys.stderr):
        ms = measure(cfg, w, t, args.rounds, args.rows)
        picks = ops.attention_form(J * t, cfg.jnp_dtype)
        best_other = min(v for f, v in ms.items() if f != picks)
        results.append(
            {"window": w, "queries": t, "ms": ms, "picks": picks}
            | {"ratio": ms[picks] / ms["q @ K^T"], "vs_best_other": ms[picks] / best_other}
        )
    heads = f"{cfg.num_heads} query / {cfg.num_kv_heads} kv heads of {cfg.head_dim}"
    rows = f"{args.rows} row{'s' * (args.rows > 1)}"
    print(f"{cfg.num_layers} layers, {heads} ({cfg.dtype}); {rows}; median ms per pass, {args.rounds} rounds\n")
    cols = " | ".join(FORMS)
    print(f"| window W | queries T | {cols} | ops.attention picks | picked / q @ K^T | picked / fastest other |")
    print("|---|---|" + "---|" * (len(FORMS) + 3))
    for r in results:
        times = " | ".join(f"{r['ms'][f]:.2f} ms" for f in FORMS)
        ratios = f"{r['ratio']:.2f}x | {r['vs_best_other']:.2f}x"
        print(f"| {r['window']} | {r['queries']} | {times} | {r['picks']} | {ratios} |")
    if args.json:
        with open(args.json, "w") as f:
            record = {"model": str(args.model), "dtype": args.dtype, "rows": args.rows, "results": results}
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
