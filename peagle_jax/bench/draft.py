"""``python -m peagle_jax.bench.draft``: one parallel (P-EAGLE) draft pass against K sequential (EAGLE-3)
passes of the same drafter, for K = 1..8, measured side by side in one run.

The drafter is SmolLM2-sized (width 576, 9 query / 3 kv heads of 64, MLP 1536, 2 layers, 49152-token
target vocabulary) with random weights: latency does not depend on the values. It is measured with the
full vocabulary as draft vocabulary and with a reduced one (EAGLE-3 drafters use about a quarter of the
target's), because on a CPU the LM head over K rows is the larger part of a parallel pass. Each round
times, interleaved, the parallel graph at K, the sequential graph at K and the sequential graph at
K = 1 (one pass), each compiled beforehand; medians are reported with their ratios. Prints a markdown
table; ``--json FILE`` writes the numbers too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax import errors
from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.draft import DraftContext, fused_mask_hidden, parallel_draft, sequential_draft
from peagle_jax.drafter.model import init_drafter_params, new_drafter_cache
from peagle_jax.models.config import ModelConfig


def smollm2_sized_drafter(layers: int = 2, draft_vocab: int = 49152) -> DrafterConfig:
    layer = ModelConfig(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=layers,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope=ModelConfig.__dataclass_fields__["rope"].default,
        tie_word_embeddings=True,
    )
    return DrafterConfig(layer=layer, algorithm="peagle", draft_vocab_size=draft_vocab, mask_token_id=0)


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.draft", description=__doc__.split("\n")[0])
    p.add_argument("--max-k", type=int, default=8, help="largest K measured (default 8)")
    p.add_argument("--layers", type=int, default=2, help="drafter layers (default 2)")
    p.add_argument(
        "--draft-vocab",
        default="49152,12288",
        help="comma-separated draft vocabulary sizes to measure (default 49152,12288)",
    )
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per K; medians reported (default 30)")
    p.add_argument("--context", type=int, default=200, help="committed context length in the cache (default 200)")
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        vocabs = errors.comma_ints(args.draft_vocab, "--draft-vocab", "49152,12288", minimum=1)
        errors.at_least(1, {"--max-k": args.max_k, "--layers": args.layers, "--rounds": args.rounds})
        errors.at_least(0, {"--context": args.context})
    except errors.UserError as err:
        return errors.report(err)
    window = 256 if args.context + 2 * args.max_k <= 256 else 512
    rows = []
    for vocab in vocabs:
        rows += measure(smollm2_sized_drafter(args.layers, vocab), args, window)
    print(
        "| draft vocab | K | parallel pass (ms) | K sequential passes (ms) | one sequential pass (ms) "
        "| parallel / one pass | sequential / parallel |\n|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['draft_vocab']} | {r['K']} | {r['parallel_ms']:.2f} | {r['sequential_ms']:.2f} "
            f"| {r['one_pass_ms']:.2f} | {r['parallel_over_one_pass']:.2f}x | {r['sequential_over_parallel']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"layers": args.layers, "context": args.context, "rows": rows, "jax": jax.__version__}, f, indent=2
            )
    return 0


def measure(cfg: DrafterConfig, args, window: int) -> list[dict]:
    """Interleaved medians of the three graphs for K = 1..max_k."""
    from tqdm import tqdm

    params = init_drafter_params(cfg, jax.random.key(0))
    mask_g = fused_mask_hidden(params, cfg=cfg)
    rng = np.random.RandomState(0)
    rows = []
    for K in tqdm(range(1, args.max_k + 1), desc=f"K (draft vocab {cfg.draft_vocab_size})", file=sys.stderr):
        C = K + 1
        tokens = jnp.asarray(rng.randint(0, cfg.layer.vocab_size, (1, C)), jnp.int32)
        aux = jnp.asarray(rng.randn(1, C, cfg.num_aux * cfg.target_hidden_size).astype(np.float32))
        count = jnp.asarray([max(1, K // 2)], jnp.int32)
        start = jnp.asarray([args.context], jnp.int32)
        caches = {name: new_drafter_cache(cfg, 1, 1024) for name in ("par", "seq", "one")}

        def run(name, caches=caches, tokens=tokens, aux=aux, count=count, start=start, K=K):
            if name == "par":
                out, caches[name] = parallel_draft(
                    params, caches[name], DraftContext(tokens, aux, count, start), mask_g, cfg=cfg, K=K, window=window
                )
            else:
                k = K if name == "seq" else 1
                out, caches[name] = sequential_draft(
                    params, caches[name], DraftContext(tokens, aux, count, start), cfg=cfg, K=k, window=window
                )
            jax.block_until_ready(out)

        times = {name: [] for name in caches}
        for name in caches:
            run(name)  # compile
        for _ in range(args.rounds):
            for name in caches:
                t0 = time.perf_counter()
                run(name)
                times[name].append(time.perf_counter() - t0)
        par, seq, one = (statistics.median(times[n]) for n in ("par", "seq", "one"))
        rows.append(
            {
                "draft_vocab": cfg.draft_vocab_size,
                "K": K,
                "parallel_ms": par * 1e3,
                "sequential_ms": seq * 1e3,
                "one_pass_ms": one * 1e3,
                "parallel_over_one_pass": par / one,
                "sequential_over_parallel": seq / par,
            }
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
