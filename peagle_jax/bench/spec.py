"""``python -m peagle_jax.bench.spec``: where the time of a speculative step goes, against a plain decode step.

On the SmolLM2 target (fp32, batch 1) with a drafter (``--drafter DIR``, or by default a random
SmolLM2-sized 2-layer P-EAGLE drafter: acceptance is then near zero, but a step's cost does not depend on
the weights), for K = 1..8 this runs greedy speculative generation and splits each step into draft, verify
and host time (host = everything after the verify result reaches the host until the next draft starts),
and runs the same request with plain decoding in the same loop, so the ratios compare like with like.
``--fused`` also measures the fused draft+verify graph. Prints a markdown table; ``--json FILE`` too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

import jax

from peagle_jax import errors

PROMPT = "Explain in a few paragraphs how a CPU cache works and why it matters for performance."


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.spec", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="target directory or 'smollm2' (default)")
    p.add_argument("--drafter", help="drafter directory (default: a random SmolLM2-sized P-EAGLE drafter)")
    p.add_argument("--max-k", type=int, default=8, help="largest K (default 8)")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens per run (default 48)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported (default 3)")
    p.add_argument("--fused", action="store_true", help="also measure the fused draft+verify step")
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from peagle_jax.bench.draft import smollm2_sized_drafter
    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.drafter.load import load_drafter, save_drafter
    from peagle_jax.drafter.model import init_drafter_params
    from peagle_jax.engine.generator import Generator
    from peagle_jax.loading import resolve_model_dir
    from peagle_jax.spec.generator import SpeculativeGenerator
    from peagle_jax.spec.state import SpecStats

    model_dir = resolve_model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = list(
        tok.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    drafter_dir = args.drafter
    if drafter_dir is None:
        dcfg = smollm2_sized_drafter(2, 49152).replace(own_embedding=False)
        drafter_dir = tempfile.mkdtemp(prefix="peagle-bench-drafter-")
        save_drafter(drafter_dir, dcfg, init_drafter_params(dcfg, jax.random.key(0)))
    dcfg, dparams = load_drafter(drafter_dir)
    cfg, params = load_target_any(model_dir, aux_layer_ids=dcfg.aux_layer_ids)
    n = args.new_tokens
    plain = Generator(cfg, params, max_seq_len=512)
    plain.generate([prompt], max_new_tokens=n, stop_token_ids=[])  # compile
    variants = [(k, fused) for k in range(1, args.max_k + 1) for fused in ((False, True) if args.fused else (False,))]
    gens = {}
    for k, fused in variants:
        gens[k, fused] = SpeculativeGenerator(cfg, params, dcfg, dparams, k=k, fused=fused, max_seq_len=512)
        gens[k, fused].time_draft = True  # the draft and verify columns: each launch timed alone
        gens[k, fused].generate([prompt], max_new_tokens=n, stop_token_ids=[])  # compile
    plain_step, rows = [], {v: [] for v in variants}
    for _ in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        before = plain.stats.decode_steps, plain.stats.decode_s
        plain.generate([prompt], max_new_tokens=n, stop_token_ids=[])
        plain_step.append((plain.stats.decode_s - before[1]) / (plain.stats.decode_steps - before[0]))
        for v in variants:
            gen = gens[v]
            gen.spec = SpecStats(accepted_per_position=[0] * gen.K)
            gen.generate([prompt], max_new_tokens=n, stop_token_ids=[])
            s = gen.spec
            rows[v].append((s.draft_s / s.steps, s.verify_s / s.steps, s.host_s / s.steps, s.acceptance_length))
    base = statistics.median(plain_step)
    out = []
    for (k, fused), vals in rows.items():
        draft, verify, host, al = (statistics.median(x) for x in zip(*vals, strict=True))
        step = draft + verify + host
        out.append(
            {
                "K": k,
                "fused": fused,
                "draft_ms": draft * 1e3,
                "verify_ms": verify * 1e3,
                "host_ms": host * 1e3,
                "step_ms": step * 1e3,
                "step_over_plain": step / base,
                "host_fraction": host / step,
                "acceptance_length": al,
                "breakeven_acceptance_length": step / base,
            }
        )
    print(f"plain decode step: {base * 1e3:.1f} ms\n")
    print(
        "| K | fused | draft | verify | host | step | step / plain step | host share | acceptance length (this "
        "drafter) |\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in out:
        print(
            f"| {r['K']} | {'yes' if r['fused'] else 'no'} | {r['draft_ms']:.1f} ms | {r['verify_ms']:.1f} ms "
            f"| {r['host_ms']:.2f} ms | {r['step_ms']:.1f} ms | {r['step_over_plain']:.2f}x "
            f"| {100 * r['host_fraction']:.1f}% | {r['acceptance_length']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plain_step_ms": base * 1e3, "rows": out}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
