"""``python -m peagle_jax.bench.full_size``: a large mixture-of-experts target at full size on this machine.

For a model directory (a real checkpoint, or a random one in the hub's layout from
``python -m peagle_jax.models.random_checkpoint --config neuron/configs/gpt-oss-20b.json --out DIR``), in one
process and in this order:

1. **start-up**: the seconds to load the weights (MXFP4 experts packed or unpacked, ``--experts``) and the
   process's resident memory after it;
2. **plain greedy decoding** of ``--new-tokens`` tokens after a random ``--prompt-len``-token prompt: the
   seconds to the first token (prefill, compiles included) and the decode tokens per second, timed on a
   second run (compiled);
3. **bytes per decode step** of the compiled one-token forward: the bytes it reads of the weights and of
   the cache, counted from the optimized HLO (:mod:`peagle_jax.bench.hlo_reads`), and XLA's cost analysis
   (bytes accessed, temporaries included), against the active-parameter bound (what one token must read at
   least: every non-expert weight, one embedding row, the router, and ``top_k`` of E experts per sparse layer,
   as the experts are held); ``--bytes-only`` computes just this, from the config's shapes;
4. **speculative step cost**, for a chain of each ``--k``: the target's verify of K + 1 tokens plus the
   drafter's one parallel pass over K tokens, over the target's decode step; the drafter has the released
   drafter's shape for the target (:mod:`peagle_jax.neuron.targets`: for GPT-OSS-20B 4 Llama layers at
   the target's width with the full-vocabulary head; else ``--drafter-layers`` layers of the target's
   shape), random weights, timed as a forward of its layer stack. Medians of ``--steps`` runs each.

Prints a summary and, with ``--json FILE``, writes it; the peak resident memory of the whole run is part of it
(``ru_maxrss``).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from peagle_jax import errors


def rss_gib() -> float:
    """This process's current resident memory, GiB (Linux ``/proc/self/statm``)."""
    import os

    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def tree_bytes(tree) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def active_bound_bytes(cfg, params) -> int:
    """Bytes one decoded token must read at least: every weight but the embedding and the experts, one
    embedding row, and ``top_k`` of E experts' weights and biases in each sparse layer (as they are held)."""
    import jax

    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    total = expert = 0
    embed_row = 0
    for path, x in flat:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        n = x.size * x.dtype.itemsize
        if "embed_tokens" in name:
            embed_row = n // x.shape[0]
            continue
        if "/experts/" in name:
            expert += n
            continue
        total += n
    m = cfg.moe
    return total + embed_row + (expert * m.top_k // m.num_experts if m is not None else expert)


def decode_bytes(cfg, params, max_seq_len: int) -> dict:
    """What the compiled forward of one token against a cache of ``max_seq_len`` reads: XLA's ``bytes
    accessed`` (every fusion operand at its full size, temporaries included: an upper bound), and the bytes
    it reads of the weights and of the cache, counted from the optimized HLO
    (:func:`peagle_jax.bench.hlo_reads.input_reads`: a sliced or gathered expert at the slice). ``params``
    may be abstract (``jax.ShapeDtypeStruct`` leaves): only the shapes are compiled."""
    import jax
    import jax.numpy as jnp

    from peagle_jax.bench.hlo_reads import input_reads
    from peagle_jax.models import model as M

    cache = jax.eval_shape(lambda: M.new_cache(cfg, 1, max_seq_len))
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    start = jax.ShapeDtypeStruct((1,), jnp.int32)
    forward = jax.jit(M.forward, static_argnames=("cfg",))
    compiled = forward.lower(params, cache, tokens, start, cfg=cfg).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    reads = input_reads(compiled.as_text())
    return {
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "weight_bytes_read": sum(v for k, v in reads.items() if k.startswith("params")),
        "cache_bytes_read": sum(v for k, v in reads.items() if k.startswith("cache")),
    }


def decode_step(cfg, params, max_seq_len: int) -> dict:
    """The ``decode_step`` entry of the results: :func:`decode_bytes` against the active-parameter bound."""
    step = decode_bytes(cfg, params, max_seq_len)
    bound = active_bound_bytes(cfg, params)
    return {
        **step,
        "active_bound_bytes": bound,
        "over_bound": step["bytes_accessed"] / bound,
        "weights_read_over_bound": step["weight_bytes_read"] / bound,
    }


def plain_decode(gen, prompt: list[int], new_tokens: int) -> dict:
    """Seconds to the first token and decode tokens per second of one greedy stream (the caller runs it
    twice: the first compiles)."""
    t0 = time.perf_counter()
    first = None
    count = 0
    for gained in gen.stream([prompt], max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=[]):
        count += len(gained[0])
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"first_token_s": first - t0, "decode_tokens_per_s": (count - 1) / (end - first)}


def build_parser() -> argparse.ArgumentParser:
    from peagle_jax.loading import add_experts_flag

    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.full_size", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face model directory of a mixture-of-experts target")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="run dtype (default bfloat16)")
    add_experts_flag(p)
    p.add_argument("--prompt-len", type=int, default=32, help="random prompt tokens (default 32)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens decoded per plain run (default 16)")
    p.add_argument("--max-seq-len", type=int, default=256, help="context length (default 256)")
    p.add_argument("--k", default="3,7", help="chains of K to time against a plain step, comma-separated (default 3,7)")
    p.add_argument("--drafter-layers", type=int, default=4, help="layers of the random drafter (default 4)")
    p.add_argument("--steps", type=int, default=3, help="timed runs of each forward (default 3)")
    p.add_argument("--skip-spec", action="store_true", help="no speculative part")
    p.add_argument(
        "--bytes-only",
        action="store_true",
        help="only the bytes per decode step, compiled from the config's shapes (no weights loaded, nothing run)",
    )
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        ks = errors.comma_ints(args.k, "--k", "3,7", minimum=1)
        errors.at_least(1, {"--prompt-len": args.prompt_len, "--steps": args.steps})
        errors.at_least(2, {"--new-tokens": args.new_tokens})
        out = run(args, ks)
    except (errors.UserError, FileNotFoundError) as err:
        return errors.report(err)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


def run(args, ks: list[int]) -> dict:
    import jax
    import numpy as np

    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.engine.generator import Generator
    from peagle_jax.loading import resolve_model_dir

    out: dict = {"model": args.model, "dtype": args.dtype, "platform": jax.devices()[0].platform}
    if args.bytes_only:
        return {**out, "decode_step": bytes_only(args)}
    model_dir = resolve_model_dir(args.model)
    t0 = time.perf_counter()
    cfg, params = load_target_any(model_dir, dtype=args.dtype, experts=args.experts)
    jax.block_until_ready(params)
    out["load_s"] = time.perf_counter() - t0
    out["experts"] = cfg.moe.experts if cfg.moe is not None else None
    out["param_gib"] = tree_bytes(params) / 2**30
    out["rss_after_load_gib"] = rss_gib()
    print(f"loaded in {out['load_s']:.1f} s: {out['param_gib']:.2f} GiB of parameters", file=sys.stderr)

    # random ordinary tokens (below the special ids, which GPT-OSS starts at 199998)
    prompt = np.random.default_rng(0).integers(0, min(cfg.vocab_size, 199998), args.prompt_len).tolist()
    gen = Generator(cfg, params, max_seq_len=args.max_seq_len)
    out["cold"] = plain_decode(gen, prompt, args.new_tokens)
    out["warm"] = plain_decode(gen, prompt, args.new_tokens)
    out["startup_s"] = out["load_s"] + out["cold"]["first_token_s"]
    print(f"plain: {out['warm']['decode_tokens_per_s']:.3f} tokens/s", file=sys.stderr)

    out["decode_step"] = decode_step(cfg, params, args.max_seq_len)
    read = out["decode_step"]["weight_bytes_read"] + out["decode_step"]["cache_bytes_read"]
    out["decode_step"]["read_gib_s"] = read * out["warm"]["decode_tokens_per_s"] / 2**30
    out["rss_before_spec_gib"] = rss_gib()

    if not args.skip_spec:
        out["spec"] = spec_costs(args, cfg, params, ks)
    out["peak_rss_gib"] = peak_rss_gib()
    return out


def bytes_only(args) -> dict:
    """:func:`decode_step` from the model's config alone: its parameters' shapes, no weights loaded."""
    import jax

    from peagle_jax.loading import target_config
    from peagle_jax.models import model as M

    cfg = target_config(args.model, args.dtype, experts=args.experts)
    params = jax.eval_shape(lambda: M.init_params(cfg, jax.random.key(0)))
    return {"experts": cfg.moe.experts if cfg.moe is not None else None, **decode_step(cfg, params, args.max_seq_len)}


def random_params(shapes, dtype, seed: int = 1, chunk: int = 1 << 22):
    """Random normal parameters (standard deviation 0.02) of the shapes of ``shapes`` in ``dtype``, drawn on
    the host ``chunk`` values at a time and placed leaf by leaf: the memory of the parameters plus one leaf,
    never a float32 copy of the largest."""
    import jax
    import numpy as np

    rng = np.random.default_rng(seed)

    def leaf(x):
        out = np.empty(x.shape, dtype)
        flat = out.reshape(-1)
        for i in range(0, flat.size, chunk):
            flat[i : i + chunk] = rng.standard_normal(min(chunk, flat.size - i), np.float32) * 0.02
        return jax.device_put(out)

    return jax.tree.map(leaf, shapes)


def timed_forward(cfg, params, T: int, max_seq_len: int, runs: int) -> float:
    """Median seconds of the jitted forward of ``T`` new tokens at position 8 of a fresh cache (compiled
    first, untimed): a decode step for T = 1, a verify of a chain of K for T = K + 1."""
    import jax
    import jax.numpy as jnp

    from peagle_jax.models import model as M

    forward = jax.jit(M.forward, static_argnames=("cfg",))
    tokens, start = jnp.ones((1, T), jnp.int32), jnp.full((1,), 8, jnp.int32)
    cache = M.new_cache(cfg, 1, max_seq_len)
    jax.block_until_ready(forward(params, cache, tokens, start, cfg=cfg))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(forward(params, cache, tokens, start, cfg=cfg))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def spec_costs(args, cfg, params, ks: list[int]) -> dict:
    """The speculative step's cost against a plain decode step, for a chain of each K: the target's verify
    of K + 1 tokens, plus the drafter's one parallel pass over K tokens, timed as a forward of the released
    drafter's layer stack (its Llama layers at the target's width with the full-vocabulary head, random
    weights), over the target's decode step (a forward of one token)."""
    import jax
    import jax.numpy as jnp

    from peagle_jax.drafter.config import random_drafter_config
    from peagle_jax.models import model as M
    from peagle_jax.neuron.targets import released_drafter_config, released_for

    released = released_for(cfg)
    if released is not None and released.drafter_layers == args.drafter_layers:  # the released drafter's shape
        dcfg = released_drafter_config(cfg, released)
    else:
        dcfg = random_drafter_config(cfg, layers=args.drafter_layers)
    # One vocabulary matrix (tied): its head's product is the drafter's; its own embedding, which a step reads
    # one row of, would only take memory.
    stack = dcfg.layer.replace(aux_layer_ids=(), tie_word_embeddings=True)
    dparams = random_params(jax.eval_shape(lambda: M.init_params(stack, jax.random.key(1))), jnp.dtype(args.dtype))
    out = {"drafter_layers": dcfg.layer.num_layers, "drafter_gib": tree_bytes(dparams) / 2**30, "k": {}}
    runs = args.steps
    out["decode_s"] = timed_forward(cfg, params, 1, args.max_seq_len, runs)
    for K in ks:
        verify = timed_forward(cfg, params, K + 1, args.max_seq_len, runs)
        draft = timed_forward(stack, dparams, K, args.max_seq_len, runs)
        ratio = (verify + draft) / out["decode_s"]
        out["k"][K] = {"verify_s": verify, "draft_s": draft, "step_over_plain": ratio}
        print(f"K={K}: verify + draft = {ratio:.2f}x a decode step", file=sys.stderr)
    return out


if __name__ == "__main__":
    sys.exit(main())
