"""``python -m peagle_jax.bench.grammar``: structured outputs, in two parts.

1. Grammar libraries (``--part libraries``): llguidance (what the server uses) and outlines-core side by side on
   the model's tokenizer, per JSON schema: the time to compile the schema (llguidance: its grammar and
   matcher; outlines-core: its regex and its index over the vocabulary) and the mean time per token mask
   while a valid answer is walked token by token. outlines-core is optional (``pip install outlines-core``).
2. Serving (``--part serving``): the slot engine on the model with its drafter, the same JSON-asking chat
   prompts as free requests, as JSON-schema requests with grammar-aware drafting and without it; per number
   of concurrent requests, tokens per second (the three modes interleaved round by round), the tokens per
   target forward (acceptance length) and the host seconds per step spent on grammar masks.
3. Forced tool calls (``--part tools``): the same measurement with chat prompts that ask for a tool, answered
   freely, and as a forced call (``tool_choice: "required"``, the grammar of
   :mod:`peagle_jax.chat.tool_grammar` in the ``hermes`` syntax: ``<tool_call>`` JSON) with grammar-aware
   drafting and without it: what drafting inside a tool call's markup is worth.

Prints markdown tables; ``--json FILE`` writes the results.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from peagle_jax import errors

# Schemas with one valid answer each (what the libraries' masks are timed along).
SCHEMAS = {
    "flat": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["name", "age", "ok"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "ok": True},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "tags": {"type": "array", "items": {"enum": ["old", "new", "big", "small"]}, "maxItems": 4},
                "where": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"],
                    "additionalProperties": False,
                },
            },
            "required": ["city", "tags", "where"],
            "additionalProperties": False,
        },
        {"city": "Lisbon", "tags": ["old", "big"], "where": {"lat": 38.72, "lon": -9.14}},
    ),
    "wide": (
        {
            "type": "object",
            "properties": {f"field_{i}": {"type": "string", "maxLength": 12} for i in range(12)},
            "required": [f"field_{i}" for i in range(12)],
            "additionalProperties": False,
        },
        {f"field_{i}": f"value {i}" for i in range(12)},
    ),
}
# The serving part's requests: a chat prompt per subject, answered under this schema.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "born": {"type": "integer", "minimum": 0, "maximum": 2100},
        "field": {"type": "string", "maxLength": 40},
        "known_for": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["name", "born", "field", "known_for"],
    "additionalProperties": False,
}
SUBJECTS = ["Marie Curie", "Alan Turing", "Ada Lovelace", "Isaac Newton", "Charles Darwin", "Grace Hopper"]
# The tools part's requests: a question per city, with these tools, answered by a forced call.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast of a city",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "maxLength": 40}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
         "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days", "unit"]}}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web",
     "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 60}},
                    "required": ["query"]}}},
]  # fmt: skip
CITIES = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Santiago", "Oslo"]


def _answer_ids(tok, answer) -> list[int]:
    from peagle_jax.grammar import JSON_LAYOUT

    text = json.dumps(answer, separators=(JSON_LAYOUT["item_separator"], JSON_LAYOUT["key_separator"]))
    return tok.encode(text, add_special_tokens=False)


def libraries(tok, vocab: int, rounds: int) -> list[dict]:
    """Compile and per-mask seconds of llguidance and (when installed) outlines-core per schema (medians)."""
    import numpy as np

    from peagle_jax.grammar import Grammars
    from peagle_jax.logit_rules import mask_words

    grammars = Grammars(tok, vocab, [tok.eos_token_id])
    try:
        import outlines_core as oc

        vocabulary = {}
        for i in range(len(tok)):
            if i != tok.eos_token_id:
                vocabulary.setdefault(tok.decode([i]), []).append(i)
        oc_vocab = oc.Vocabulary(tok.eos_token_id, vocabulary)
    except ImportError:
        oc = None
    out = []
    for name, (schema, answer) in SCHEMAS.items():
        ids = _answer_ids(tok, answer)
        row = {"schema": name, "answer_tokens": len(ids)}
        mask = np.zeros(mask_words(vocab), np.int32)
        compile_s, mask_s = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            c = grammars.constraint(grammars.compile("json_schema", schema))
            compile_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for t in ids:
                c.mask(mask)
                c.consume([t])
            mask_s.append((time.perf_counter() - t0) / len(ids))
        row["llguidance"] = {
            "compile_ms": statistics.median(compile_s) * 1e3,
            "mask_ms": statistics.median(mask_s) * 1e3,
        }
        if oc is not None:
            compile_s, mask_s = [], []
            buf = np.zeros(mask_words(vocab), np.int32)
            for _ in range(rounds):
                t0 = time.perf_counter()
                regex = oc.json_schema.build_regex_from_schema(json.dumps(schema), r"[ ]?")  # ", " and ": " fit
                guide = oc.Guide(oc.Index(regex, oc_vocab))
                compile_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for t in ids:
                    guide.write_mask_into(buf.ctypes.data, buf.size, 4)
                    guide.advance(t, return_tokens=False)
                mask_s.append((time.perf_counter() - t0) / len(ids))
            row["outlines_core"] = {
                "compile_ms": statistics.median(compile_s) * 1e3,
                "mask_ms": statistics.median(mask_s) * 1e3,
            }
        out.append(row)
    return out


def serving(engines, prompts, grammar, rows: int, rounds: int, max_new: int) -> dict:
    """Per mode (free, schema with grammar-aware drafting, schema without): tokens per second over ``rounds``
    interleaved rounds of ``rows`` concurrent requests, tokens per target forward, grammar host ms per step."""
    from peagle_jax.serve.slots import SlotRequest

    modes = {"free": None, "schema_aware": grammar, "schema_plain_draft": grammar}
    wall = {m: 0.0 for m in modes}
    tokens = {m: 0 for m in modes}
    steps = {m: 0 for m in modes}
    forwards = {m: [0, 0] for m in modes}  # target forwards, emitted
    for eng in engines.values():
        eng.rows.grammar_s = 0.0
    for i in range(rounds):
        order = list(modes)[i % 3 :] + list(modes)[: i % 3]
        for m in order:
            eng = engines[m]
            eng.reset()
            gen = eng.gen
            before = (gen.spec.target_forwards, gen.spec.emitted, dict(eng.structured))
            batch = [prompts[(i * rows + j) % len(prompts)] for j in range(rows)]
            t0 = time.perf_counter()
            for p in batch:
                eng.admit(SlotRequest(p, max_new, grammar=modes[m]))
            while eng.active:
                for ev in eng.step():
                    tokens[m] += len(ev.tokens)
                steps[m] += 1
            wall[m] += time.perf_counter() - t0
            tokens[m] += len(batch)  # the first tokens, from the admissions
            if modes[m] is None:
                forwards[m][0] += gen.spec.target_forwards - before[0]
                forwards[m][1] += gen.spec.emitted - before[1]
            else:
                forwards[m][0] += eng.structured["target_forwards"] - before[2]["target_forwards"]
                forwards[m][1] += eng.structured["emitted"] - before[2]["emitted"]
    out = {"rows": rows}
    for m in modes:
        f, e = forwards[m]
        out[m] = {
            "tokens_per_s": tokens[m] / wall[m],
            "over_free": (tokens[m] / wall[m]) / (tokens["free"] / wall["free"]),
            "acceptance_length": e / f if f else 0.0,
            "grammar_ms_per_step": engines[m].rows.grammar_s / max(steps[m], 1) * 1e3,
        }
    return out


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.grammar", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="target directory or 'smollm2' (default)")
    p.add_argument("--drafter", help="drafter directory (default: the shipped drafter of the model)")
    p.add_argument(
        "--part",
        choices=["libraries", "serving", "tools", "both"],
        default="both",
        help="what to run: libraries, serving (JSON schemas), tools (forced tool calls), or both of the first two "
        "(default both)",
    )
    p.add_argument(
        "--rows", default="1,4", help="concurrent requests of the serving part, comma-separated (default 1,4)"
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode and row count (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens per answer at most (default 96)")
    p.add_argument("--max-seq-len", type=int, default=256, help="context length (default 256)")
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from peagle_jax.errors import UserError
    from peagle_jax.loading import load_tokenizer, resolve_model_dir

    try:
        rows = errors.comma_ints(args.rows, "--rows", "1,4", minimum=1)
        errors.at_least(1, {"--rounds": args.rounds, "--max-new-tokens": args.max_new_tokens})
        model_dir = resolve_model_dir(args.model)
        tok = load_tokenizer(model_dir)
        if tok is None:
            raise UserError(f"{model_dir} has no tokenizer: structured outputs need one")
        results = {}
        if args.part in ("libraries", "both"):
            from peagle_jax.loading import target_config

            vocab = target_config(args.model, "float32").vocab_size
            results["libraries"] = libraries(tok, vocab, args.rounds)
            print("| schema | answer tokens | llguidance compile | llguidance per mask | outlines-core compile | "
                  "outlines-core per mask |\n|---|---|---|---|---|---|")  # fmt: skip
            for r in results["libraries"]:
                o = r.get("outlines_core")
                other = f"{o['compile_ms']:.1f} ms | {o['mask_ms']:.3f} ms" if o else "not installed | -"
                ll = r["llguidance"]
                mine = f"{ll['compile_ms']:.1f} ms | {ll['mask_ms']:.3f} ms"
                print(f"| {r['schema']} | {r['answer_tokens']} | {mine} | {other} |")
        if args.part in ("serving", "both"):
            results["serving"] = _serving(args, model_dir, tok, rows)
        if args.part == "tools":
            results["tools"] = _serving(args, model_dir, tok, rows, tools=True)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "max_new_tokens": args.max_new_tokens, **results}, f, indent=2)
    return 0


def _serving(args, model_dir, tok, rows, tools: bool = False) -> list[dict]:
    from tqdm import tqdm

    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.drafter.load import load_drafter
    from peagle_jax.drafter.shipped import default_tree, resolve_drafter
    from peagle_jax.errors import UserError
    from peagle_jax.grammar import Grammars
    from peagle_jax.serve.slots import SlotEngine
    from peagle_jax.spec.generator import SpeculativeGenerator
    from peagle_jax.spec.tree import parse_tree

    drafter = args.drafter or resolve_drafter(args.model, None, None)
    if not drafter:
        raise UserError(f"no shipped drafter for {args.model}: give --drafter DIR")
    dcfg, dparams = load_drafter(drafter)
    cfg, params = load_target_any(model_dir, aux_layer_ids=dcfg.aux_layer_ids)
    spec_tree = default_tree(drafter, None, None)
    tree = parse_tree(spec_tree) if spec_tree else None
    gen = SpeculativeGenerator(cfg, params, dcfg, dparams, tree=tree, max_seq_len=args.max_seq_len)
    stops = sorted(set(cfg.eos_token_ids) | {tok.eos_token_id})
    grammars = Grammars(tok, cfg.vocab_size, stops)
    if tools:
        from peagle_jax.chat.tool_grammar import forced_call_grammar

        grammar = grammars.compile("lark", forced_call_grammar("hermes", TOOLS, None, parallel=False))
        system = "You may call these tools, one per <tool_call></tool_call> block, as JSON with name and arguments:\n"
        system += "\n".join(json.dumps(t) for t in TOOLS)
        chats = [[{"role": "system", "content": system}, {"role": "user", "content": f"Weather in {c} for 3 days?"}]
                 for c in CITIES]  # fmt: skip
    else:
        grammar = grammars.compile("json_schema", PERSON)
        asks = [f"Describe {s} as a JSON object with the keys name, born, field and known_for." for s in SUBJECTS]
        chats = [[{"role": "user", "content": a}] for a in asks]
    prompts = []
    for chat in chats:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
        prompts.append(list(ids["input_ids"]))
    out = []
    for r in rows:
        engines = {m: SlotEngine(gen, r, grammars=grammars) for m in ("free", "schema_aware", "schema_plain_draft")}
        engines["schema_plain_draft"].rows.grammar_drafting = False
        # Untimed: every prompt once in every mode, which compiles every graph the timed rounds call (the
        # answers are the same: greedy).
        serving(engines, prompts, grammar, r, -(-len(prompts) // r), args.max_new_tokens)
        with tqdm(total=1, desc=f"{r} rows", file=sys.stderr) as bar:
            res = serving(engines, prompts, grammar, r, args.rounds, args.max_new_tokens)
            bar.update()
        out.append(res)
    print(f"\n{spec_tree or 'chain'} drafts, {args.max_new_tokens} tokens at most; per mode: tokens/s (x free), "
          "tokens per target forward, grammar host ms per step\n")  # fmt: skip
    what = "forced tool call" if tools else "schema"
    print(f"| rows | free | {what}, grammar-aware drafting | {what}, drafts as drafted |\n|---|---|---|---|")
    for res in out:
        cells = [
            f"{v['tokens_per_s']:.1f} tok/s ({v['over_free']:.2f}x), {v['acceptance_length']:.2f}, "
            f"{v['grammar_ms_per_step']:.2f} ms"
            for v in (res["free"], res["schema_aware"], res["schema_plain_draft"])
        ]
        print(f"| {res['rows']} | " + " | ".join(cells) + " |")
    return out


if __name__ == "__main__":
    sys.exit(main())
