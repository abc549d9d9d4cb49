"""``python -m peagle_jax.bench.decode``: plain greedy decoding against transformers, side by side.

Measures, in one process and interleaved round by round so that machine noise hits both alike:

- end-to-end tokens/s of ``Generator`` (prefill + N greedy tokens, graphs compiled beforehand) and of
  transformers' PyTorch ``generate()`` on the same weights, batch 1, fp32; their ratio;
- the decode step time against the memory-bandwidth bound: weight bytes / measured read bandwidth
  (a jitted sum over a buffer as large as the weights, best of several runs, probed in every round);
- that both produce the same greedy tokens.

Needs torch (the ``test`` extra). Prints a markdown table; ``--json FILE`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from peagle_jax import errors

PROMPT = "Explain in a few paragraphs how a CPU cache works and why it matters for performance."


def measure_read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a jitted full read (sum) of a float32 buffer of ``nbytes``; the best of ``repeats``."""
    buf = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(buf).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        total(buf).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    del buf
    return nbytes / best


def run_ours(gen, prompt_ids, n):
    t0 = time.perf_counter()
    steps_before, decode_before = gen.stats.decode_steps, gen.stats.decode_s
    out = gen.generate([prompt_ids], max_new_tokens=n, stop_token_ids=[])[0].token_ids
    total = time.perf_counter() - t0
    steps = gen.stats.decode_steps - steps_before
    return out, total, (gen.stats.decode_s - decode_before) / max(steps, 1)


def run_transformers(hf, prompt_ids, n):
    import torch

    ids = torch.tensor([prompt_ids])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist(), time.perf_counter() - t0


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.decode", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="model directory or 'smollm2' (default)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run (default 64)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported (default 5)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="KV cache slots (default 2048)")
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        print("error: the benchmark needs torch: pip install -e '.[test]'", file=sys.stderr)
        return 2
    from tqdm import tqdm

    from peagle_jax.engine.generator import Generator
    from peagle_jax.loading import resolve_model_dir
    from peagle_jax.models.weights import load_target

    model_dir = resolve_model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt_ids = list(
        tok.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    cfg, params = load_target(model_dir)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    gen = Generator(cfg, params, max_seq_len=args.max_seq_len)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    n = args.new_tokens
    run_ours(gen, prompt_ids, n)  # compile every graph the measured runs use
    run_transformers(hf, prompt_ids, 4)

    ours_s, ours_step_s, theirs_s, bandwidths, fractions = [], [], [], [], []
    same = True
    # Each round measures all three side by side; the bandwidth probe too, since the machine's available
    # bandwidth drifts with its other tenants.
    for _ in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        bw = measure_read_bandwidth(weight_bytes, repeats=5)
        out, total, step = run_ours(gen, prompt_ids, n)
        ours_s.append(total)
        ours_step_s.append(step)
        ref, total = run_transformers(hf, prompt_ids, n)
        theirs_s.append(total)
        same &= out == ref
        bandwidths.append(bw)
        fractions.append(weight_bytes / bw / step)
    ours, theirs, step, bandwidth = (statistics.median(x) for x in (ours_s, theirs_s, ours_step_s, bandwidths))
    floor_s = weight_bytes / bandwidth
    res = {
        "model": str(args.model),
        "prompt_tokens": len(prompt_ids),
        "new_tokens": n,
        "batch": 1,
        "dtype": "float32",
        "jax_tokens_per_s": n / ours,
        "transformers_tokens_per_s": n / theirs,
        "speedup_vs_transformers": theirs / ours,
        "decode_step_ms": step * 1e3,
        "weight_bytes": weight_bytes,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_bound_step_ms": floor_s * 1e3,
        "fraction_of_bandwidth_bound": statistics.median(fractions),
        "greedy_tokens_identical": bool(same),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    print("| measure | value |\n|---|---|")
    rows = [
        ("peagle_jax tokens/s (prefill + decode)", f"{res['jax_tokens_per_s']:.1f}"),
        ("transformers generate() tokens/s", f"{res['transformers_tokens_per_s']:.1f}"),
        ("speedup vs transformers", f"{res['speedup_vs_transformers']:.2f}x"),
        ("decode step", f"{res['decode_step_ms']:.1f} ms"),
        (
            "bandwidth bound (weights / read bandwidth)",
            f"{res['bandwidth_bound_step_ms']:.1f} ms ({weight_bytes / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s)",
        ),
        ("decode step vs bound", f"{100 * res['fraction_of_bandwidth_bound']:.0f}%"),
        ("greedy tokens identical", str(same)),
    ]
    for name, value in rows:
        print(f"| {name} | {value} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
