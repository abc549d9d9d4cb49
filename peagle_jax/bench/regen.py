"""``python -m peagle_jax.bench.regen``: regeneration throughput of the training pipeline's two paths, side by side.

Both paths answer the same ShareGPT prompts with the embedded SmolLM2 through
:func:`peagle_jax.train.regen.regenerate` (the function a recipe's regeneration calls), into shards in a
temporary directory:

- *batch*: the batch :class:`~peagle_jax.engine.generator.Generator` in fixed batches of ``--batch`` prompts
  sorted by length (``data.regen_batch``), in ``--batch-dtype`` (float32 by default);
- *slots*: :class:`~peagle_jax.train.slot_regen.SlotGenerator`, continuous batching over ``--slots`` rows
  (``data.regen_slots``), in ``--slots-dtype`` (bfloat16 by default), with the regeneration's shape buckets
  or (``--slot-buckets regen,serving``) also a server's; one setting per comma-separated value of each.

``--batch 0`` leaves the batch path out (the ratios are then to the first slots setting).

Each path regenerates the prompts twice and the second pass is timed (the first compiles its graphs).
Prints generated tokens per second per path and each over the first; ``--json FILE`` writes them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from peagle_jax import errors


def _prompts(tokenizer, count: int, max_prompt_tokens: int, skip: int) -> list[list[int]]:
    from peagle_jax.train.prompts import load_prompts
    from peagle_jax.train.regen import chat_prompt_ids

    out = []
    for messages in load_prompts("sharegpt")[skip:]:
        ids = chat_prompt_ids(tokenizer, messages)
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
        if len(out) == count:
            break
    return out


def _timed(gen, prompts, args, stops, batch: int) -> dict:
    from peagle_jax.train.regen import read_shards, regenerate

    t = 0.0
    for _ in range(2):  # the first pass compiles
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            paths = regenerate(
                gen,
                prompts,
                Path(tmp),
                max_prompt_tokens=args.max_prompt_tokens,
                max_new_tokens=args.max_new_tokens,
                batch=batch,
                shard_size=len(prompts),
                temperature=args.temperature,
                stop_token_ids=stops,
                progress=False,
            )
            t = time.perf_counter() - t0
            tokens = sum(len(r["response_ids"]) for r in read_shards(paths))
    return {"seconds": t, "tokens": tokens, "tokens_per_s": tokens / t}


def run(args) -> dict:
    from peagle_jax.checkpoint import cast_floats, load_target_any
    from peagle_jax.engine.generator import Generator
    from peagle_jax.hf_tokenizers import transformers
    from peagle_jax.models.gguf import default_model_dir
    from peagle_jax.train.slot_regen import SlotGenerator

    model_dir = default_model_dir()
    tokenizer = transformers().AutoTokenizer.from_pretrained(str(model_dir))
    cfg32, params32 = load_target_any(model_dir)
    prompts = _prompts(tokenizer, args.prompts, args.max_prompt_tokens, args.skip)
    if len(prompts) < args.prompts:
        raise errors.UserError(
            f"--prompts {args.prompts} --skip {args.skip}: only {len(prompts)} of the salvaged ShareGPT prompts from "
            f"there fit --max-prompt-tokens {args.max_prompt_tokens}"
        )
    print(f"## Regeneration throughput ({args.prompts} ShareGPT prompts, up to {args.max_new_tokens} tokens)\n")
    print("| path | generated |\n|---|---|")
    stops = sorted(set(cfg32.eos_token_ids) | {tokenizer.eos_token_id})
    seq = args.max_prompt_tokens + args.max_new_tokens

    def target(dtype):
        return cfg32.replace(dtype=dtype), cast_floats(params32, dtype)

    rows = []
    if args.batch:
        cfg, params = target(args.batch_dtype)
        gen = Generator(cfg, params, max_seq_len=seq)
        path = f"batch {args.batch} {args.batch_dtype}"
        rows.append({"path": path, **_timed(gen, prompts, args, stops, args.batch)})
        print(f"| {rows[-1]['path']} | {rows[-1]['tokens_per_s']:.0f} tokens/s |", flush=True)
    cfg, params = target(args.slots_dtype)
    for slots in args.slots:
        for buckets in args.slot_buckets:
            gen = SlotGenerator(cfg, params, slots=slots, max_seq_len=seq, buckets=buckets)
            path = f"slots {slots} {args.slots_dtype} {buckets} buckets"
            row = {"path": path, **_timed(gen, prompts, args, stops, len(prompts))}
            rows.append(row)
            print(f"| {row['path']} | {row['tokens_per_s']:.0f} tokens/s |", flush=True)
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["vs_first"] = row["tokens_per_s"] / base
    return {
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "rows": rows,
    }


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.regen", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=128, help="ShareGPT prompts regenerated per pass (default 128)")
    p.add_argument("--skip", type=int, default=0, help="start at this salvaged prompt (default 0)")
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="longer prompts are skipped (default 384)")
    p.add_argument("--max-new-tokens", type=int, default=192, help="answer length cap (default 192)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--batch", type=int, default=16, help="the batch path's batch size (default 16; 0: none)")
    p.add_argument("--batch-dtype", default="float32", choices=("float32", "bfloat16"), help="(default float32)")
    p.add_argument("--slots", default="32,64", help="comma-separated slot counts of the slots path (default 32,64)")
    p.add_argument("--slots-dtype", default="bfloat16", choices=("float32", "bfloat16"), help="(default bfloat16)")
    p.add_argument(
        "--slot-buckets",
        default="regen",
        help="comma-separated shape buckets of the slots path: regen (finer, the default) and/or serving",
    )
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        errors.at_least(1, {"--prompts": args.prompts, "--max-new-tokens": args.max_new_tokens})
        errors.at_least(0, {"--batch": args.batch, "--skip": args.skip})
        args.slots = errors.comma_ints(args.slots, "--slots", "32,64", minimum=1)
        args.slot_buckets = errors.comma_list(args.slot_buckets, "--slot-buckets", "regen,serving")
        if not set(args.slot_buckets) <= {"regen", "serving"}:
            raise errors.UserError(f"--slot-buckets {','.join(args.slot_buckets)}: expected regen and/or serving")
        res = run(args)
    except errors.UserError as err:
        return errors.report(err)
    print()
    for row in res["rows"]:
        print(f"{row['path']}: {row['tokens']} tokens in {row['seconds']:.1f} s, {row['vs_first']:.2f}x the first")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
