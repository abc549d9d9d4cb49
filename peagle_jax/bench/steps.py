"""``python -m peagle_jax.bench.steps``: what each step length costs in the serving engine, against a plain step.

The adaptive step length (:mod:`peagle_jax.spec.adaptive`) picks, per step, a plain step (K' = 0), a chain of 1
or K, whichever emits the most tokens per second; it can only match a plain server where its own plain
step costs what the plain engine's decode step costs. This measures both in one loop: for each number of
busy rows, a plain :class:`~peagle_jax.serve.slots.SlotEngine` and a speculative one (the shipped drafter
by default) hold that many requests of the same chat prompt, and the steps are timed interleaved (plain,
K' = 0, 1, K in rotating order), so that the machine's noise hits all of them alike. ``--tree SPEC`` times a
static tree as the longest step instead of a chain of K (its column is the tree's depth). Prints a markdown
table (medians) and with ``--json FILE`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from peagle_jax import errors

PROMPT = "Explain in a few paragraphs how a CPU cache works and why it matters for performance."


def _fill(engine, prompt, rows: int, max_new: int) -> None:
    engine.reset()
    for _ in range(rows):
        engine.admit(_request(prompt, max_new))


def _request(prompt, max_new):
    from peagle_jax.serve.slots import SlotRequest

    return SlotRequest(prompt, max_new, stop_token_ids=[])


def measure(plain_gen, spec_gen, prompt, rows: int, steps: int, progress=None, logprobs: bool = False) -> dict:
    """Median seconds per step of the plain engine and of each K' of the speculative one, with ``rows``
    busy slots, and the tokens a row gains per step at each K'; ``logprobs``: engines that also return the
    emitted tokens' log-probabilities (as the server's)."""
    from peagle_jax.serve.slots import SlotEngine
    from peagle_jax.spec.tree import chain

    K = spec_gen.K
    modes = {"plain": None, 0: chain(0), 1: chain(1), K: spec_gen.tree}
    engines = {m: SlotEngine(plain_gen if m == "plain" else spec_gen, rows, logprobs=logprobs) for m in modes}
    for eng in engines.values():
        eng.overlap = False  # each step read by its own call: the loop times one step of each mode in turn
    max_new = spec_gen.max_seq_len - len(prompt) - 1
    # Every step stays inside the prompt's attention window (the requests restart before leaving it), so
    # that each mode compiles one graph per step length, in the untimed steps below: a process that compiles
    # every window and row bucket can run out of memory mappings (see peagle_jax.platform.MapBudget).
    limit = spec_gen.window(len(prompt) + 2 * K + 4)
    times = {m: [] for m in modes}
    tokens = {m: 0 for m in modes}
    order = list(modes)
    for m, eng in engines.items():
        _fill(eng, prompt, rows, max_new)
        for _ in range(K + 3):  # compiles; runs of plain steps also reach flush_context
            eng.step(modes[m]) if modes[m] is not None else eng.step()
    for i in range(steps):
        for m in order[i % len(order) :] + order[: i % len(order)]:
            eng, tree = engines[m], modes[m]
            # Stay clear of the context's end: restart the requests before a step could run out of room.
            top = eng.state.q.max()  # plain and speculative engines alike
            if eng.active < rows or top + 2 * K + 4 >= limit:
                _fill(eng, prompt, rows, max_new)
            t0 = time.perf_counter()
            events = eng.step(tree) if tree is not None else eng.step()
            times[m].append(time.perf_counter() - t0)
            tokens[m] += sum(len(e.tokens) for e in events)
        if progress:
            progress()
    plain_s = statistics.median(times["plain"])
    out = {"rows": rows, "plain_ms": plain_s * 1e3, "k": {}}
    for m in modes:
        if m == "plain":
            continue
        s = statistics.median(times[m])
        per_row = tokens[m] / (steps * rows)
        out["k"][m] = {
            "step_ms": s * 1e3,
            "step_over_plain": s / plain_s,
            "tokens_per_row_step": per_row,
            "throughput_over_plain": per_row * plain_s / s,
        }
    return out


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.steps", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="target directory or 'smollm2' (default)")
    p.add_argument("--drafter", help="drafter directory (default: the shipped drafter of the model)")
    p.add_argument(
        "--k",
        type=int,
        help="the speculative step's K (default: as serve, a shipped drafter's own tree, else the drafter config's K)",
    )
    p.add_argument("--tree", help="a static draft tree for the longest step instead of a chain of --k, e.g. 0,1,00,10")
    p.add_argument("--rows", default="1,4,16", help="busy slots, comma-separated (default 1,4,16)")
    p.add_argument("--steps", type=int, default=40, help="timed steps per mode and row count (default 40)")
    p.add_argument("--max-seq-len", type=int, default=256, help="context length (default 256)")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and compute (default float32)"
    )
    p.add_argument("--logprobs", action="store_true", help="steps that also return log-probabilities, as the server's")
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from tqdm import tqdm

    from peagle_jax.errors import UserError
    from peagle_jax.loading import load_tokenizer, resolve_model_dir

    try:
        rows = errors.comma_ints(args.rows, "--rows", "1,4,16", minimum=1)
        errors.at_least(1, {"--steps": args.steps, "--k": 1 if args.k is None else args.k})
        if args.tree and args.k is not None:
            raise UserError("give --k or --tree, not both")
        plain, spec, prompt = _generators(args, resolve_model_dir(args.model), load_tokenizer)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    results = []
    with tqdm(total=len(rows) * args.steps, desc="steps", file=sys.stderr) as bar:
        for r in rows:
            results.append(measure(plain, spec, prompt, r, args.steps, progress=bar.update, logprobs=args.logprobs))
    K = spec.K
    tree = None if spec.tree.is_chain else spec.tree.spec()
    longest = f"tree {tree} (depth {K})" if tree else f"K = {K}"
    print(
        f"{args.dtype}, {len(prompt)}-token chat prompt, {longest}; "
        "per mode: median ms per step, x the plain engine's step, "
    )
    print("tokens per row and step, throughput x plain\n")
    print(f"| rows | plain step | K'=0 | K'=1 | K'={K} |\n|---|---|---|---|---|")
    for res in results:
        cells = [
            f"{v['step_ms']:.1f} ms, {v['step_over_plain']:.2f}x, {v['tokens_per_row_step']:.2f} tok, "
            f"**{v['throughput_over_plain']:.2f}x**"
            for v in res["k"].values()
        ]
        print(f"| {res['rows']} | {res['plain_ms']:.1f} ms | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"k": K, "tree": tree, "dtype": args.dtype, "prompt_tokens": len(prompt), "results": results},
                f,
                indent=2,
            )
    return 0


def _generators(args, model_dir, load_tokenizer):
    """The plain and speculative generators and the chat prompt's ids."""
    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.drafter.load import load_drafter
    from peagle_jax.drafter.shipped import default_tree, resolve_drafter
    from peagle_jax.engine.generator import Generator
    from peagle_jax.errors import UserError
    from peagle_jax.spec.generator import SpeculativeGenerator
    from peagle_jax.spec.tree import parse_tree

    drafter = args.drafter or resolve_drafter(args.model, None, None)
    if not drafter:
        raise UserError(f"no shipped drafter for {args.model}: give --drafter DIR")
    dcfg, dparams = load_drafter(drafter, dtype=args.dtype)
    cfg, params = load_target_any(model_dir, dtype=args.dtype, aux_layer_ids=dcfg.aux_layer_ids)
    tok = load_tokenizer(model_dir)
    messages = [{"role": "user", "content": PROMPT}]
    prompt = list(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    )
    plain = Generator(cfg, params, max_seq_len=args.max_seq_len)
    spec_tree = default_tree(drafter, args.k, args.tree)
    tree = parse_tree(spec_tree) if spec_tree else None
    spec = SpeculativeGenerator(cfg, params, dcfg, dparams, k=args.k, tree=tree, max_seq_len=args.max_seq_len)
    return plain, spec, prompt


if __name__ == "__main__":
    sys.exit(main())
