"""``python -m peagle_jax.bench.trees``: the static draft tree a drafter is accepted most with, per node budget.

Greedy speculative decoding emits exactly plain decoding's tokens, so along the target's greedy answer the
draft at every root depends on the committed prefix only. One target forward and one drafter forward per
answer (the P-EAGLE training layout, every anchor and depth at once, whose elements draft what
:func:`peagle_jax.drafter.draft.parallel_draft` drafts, tested) give the rank of the answer's next tokens
among the drafter's top ``--width`` candidates at every root and depth. From these ranks the acceptance of any tree
follows without decoding: from the first root, a step accepts the deepest tree path whose ranks match the
answer, emits that many tokens plus the bonus token, and the next root is the last of them (counted as
:class:`peagle_jax.spec.state.SpecStats` counts a greedy run, stop tokens included; tested equal).

The search grows a tree one node at a time (a child of a tree node or of the root, rank < width, depth <= K),
adding the node that raises the tokens per step most on the search half of the questions, and reports each
budget's tree with its tokens per step on both halves (the held-out half is the honest number), beside the
``--trees`` given. ``--dynamic`` adds, per budget, a tree chosen anew at every root: the ``budget`` paths whose
drafter probabilities multiply to the most (depths are drafted independently in P-EAGLE, so the product
stands in for a path's probability), as EAGLE-2's dynamic trees choose: what a verify graph taking its
tree as data would accept with that rule. Which budget to serve is a question of cost: see the step costs in
docs/bench/steps/README.md and, in docs/performance.md, "Weight products" (``linear`` pads a product's rows
to the next power of two up to 16, so a verify of 8 tokens multiplies as many rows as one of 5).
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import sys
from collections.abc import Iterable, Sequence

import numpy as np

from peagle_jax import errors
from peagle_jax.errors import UserError

RankPath = tuple[int, ...]  # per-depth candidate ranks from the root, e.g. (1, 0) = "10"


def spec(paths: Iterable[RankPath]) -> str:
    """``--tree`` spec of a set of paths, parents before children."""
    return ",".join("".join(map(str, p)) for p in sorted(paths, key=lambda p: (len(p), p)))


def paths_of(tree_spec: str) -> frozenset[RankPath]:
    from peagle_jax.spec.tree import parse_tree

    return frozenset(parse_tree(tree_spec).paths())  # parse_tree validates


def accepted_depths(ranks: np.ndarray, paths: frozenset[RankPath], width: int) -> np.ndarray:
    """Per root, the depth of the deepest tree path whose ranks equal ``ranks`` ([roots, K]; ``width`` = not
    among the candidates): the drafts a step from that root accepts."""
    roots, K = ranks.shape
    base = width + 1
    acc, ok = np.zeros(roots, np.int64), np.ones(roots, bool)
    code = np.zeros(roots, np.int64)
    for d in range(1, K + 1):
        code = code * base + ranks[:, d - 1]
        want = [int(np.polyval(p, base)) for p in paths if len(p) == d]  # the same code of each path
        ok &= np.isin(code, want)
        acc += ok
    return acc


def dynamic_paths(probs: np.ndarray, budget: int) -> frozenset[RankPath]:
    """The ``budget`` paths (depth <= K, ranks < width) whose candidate probabilities ``probs`` ([K, width])
    multiply to the most (ties: the smaller rank tuple). Prefix-closed: a path never scores above its
    parent, and a parent is chosen before its children are candidates."""
    K, width = probs.shape
    heap = [(-float(probs[0, r]), (r,)) for r in range(width)]
    heapq.heapify(heap)
    chosen: set[RankPath] = set()
    while heap and len(chosen) < budget:
        value, path = heapq.heappop(heap)
        chosen.add(path)
        if len(path) < K:
            for r in range(width):
                heapq.heappush(heap, (value * float(probs[len(path), r]), (*path, r)))
    return frozenset(chosen)


def dynamic_accepted_depths(ranks: np.ndarray, probs: np.ndarray, budget: int) -> np.ndarray:
    """As :func:`accepted_depths`, with each root's own tree :func:`dynamic_paths` of ``budget`` nodes
    (``probs`` [roots, K, width])."""
    width = probs.shape[-1]
    return np.array(
        [
            accepted_depths(root_ranks[None], dynamic_paths(root_probs, budget), width)[0]
            for root_ranks, root_probs in zip(ranks, probs, strict=True)
        ],
        np.int64,
    )


def simulate(ranks, answer, paths, width, *, max_new_tokens, stops=()) -> tuple[int, int, list[int]]:
    """``(target forwards, tokens emitted, accepted per depth)`` of one greedy speculative run: ``answer`` is
    the target's greedy continuation (the first token from the prefill), root i (0-based) is ``answer[i]``."""
    acc = accepted_depths(ranks, paths, width)
    return run_accepted(acc, answer, K=ranks.shape[1], max_new_tokens=max_new_tokens, stops=stops)


def run_accepted(acc, answer, *, K: int, max_new_tokens, stops=()) -> tuple[int, int, list[int]]:
    """:func:`simulate` from the drafts accepted at each root, ``acc`` [roots]."""
    forwards, emitted, per_depth = 0, 0, [0] * K
    done, stop = 1, set(stops)
    if answer[0] in stop:
        return 0, 0, per_depth
    while done < max_new_tokens:
        a = int(acc[done - 1])
        forwards, emitted = forwards + 1, emitted + a + 1
        for d in range(a):
            per_depth[d] += 1
        new = answer[done : done + a + 1]
        done += a + 1
        if stop.intersection(new):
            break
    return forwards, emitted, per_depth


def candidate_ranks(cfg, params, dcfg, dparams, prompt, answer, *, K: int, width: int, probs: bool = False):
    """``[len(answer) - K, K]``: at root i (``answer[i]``, after ``prompt + answer[:i]``), the rank of
    ``answer[i + d]`` among the drafter's top-``width`` candidates at depth d (``width`` if not among them).
    With ``probs``, also ``[len(answer) - K, K, width]``: those candidates' drafter probabilities.

    A P-EAGLE drafter's depths come from one pass (its COD elements over the answer); an EAGLE-3 drafter's
    from its training-time-test passes (:func:`peagle_jax.train.ttt.ttt_forward`): depth d fed the answer's
    tokens and the drafter's own hidden state of depth d - 1. Sequential drafting feeds the drafted top
    candidate instead, which is the answer's token wherever the draft is right up to depth d - 1, so these
    ranks decide acceptance exactly for trees whose every node below the root hangs off the top candidates
    (:func:`check_sequential_tree`)."""
    import jax
    import jax.numpy as jnp

    from peagle_jax.drafter.draft import to_target_ids
    from peagle_jax.train.features import target_features
    from peagle_jax.train.objective import PEagleBatch

    x = list(prompt) + list(answer)
    n_prompt, roots = len(prompt), len(answer) - K
    if roots < 1:
        raise UserError(f"an answer of {len(answer)} tokens is too short for depth {K}")
    T = len(x) - 1  # slot r: input token x[r + 1] with the target's aux states at r (the EAGLE shift)
    Tp = -(-T // 64) * 64  # padded: one compilation per 64 slots
    tokens = np.zeros((1, Tp), np.int32)
    tokens[0, :T] = x[1:]
    inputs = np.zeros((1, Tp), np.int32)
    inputs[0, :T] = x[:T]
    document = np.full((1, Tp), -1, np.int32)
    document[0, :T] = 0
    positions = np.arange(Tp, dtype=np.int32)[None]
    aux, _ = target_features(
        params, jnp.asarray(inputs), jnp.asarray(positions), jnp.asarray(document), cfg=cfg, dtype="float32"
    )
    # Root i = x[n_prompt + i] is the input token of slot n_prompt + i - 1: its anchor.
    anchors = np.arange(n_prompt - 1, n_prompt - 1 + roots)
    # P-EAGLE's elements: every slot at depth 0 (the committed context), then depths 1..K-1 of each anchor.
    # (EAGLE-3's passes read only the per-position fields.)
    anchor = np.concatenate([np.arange(Tp)] + [anchors] * (K - 1))
    depth = np.concatenate([np.zeros(Tp, np.int32)] + [np.full(roots, d) for d in range(1, K)])
    Y = len(anchor)
    Yp = -(-Y // 256) * 256
    valid = np.zeros(Yp, bool)
    valid[:Y] = True
    anchor, depth = np.pad(anchor, (0, Yp - Y)), np.pad(depth, (0, Yp - Y))
    batch = PEagleBatch(
        jnp.asarray(tokens),
        aux,
        jnp.zeros((1, Tp, 1), jnp.float32),  # the target's final states only enter the loss
        jnp.ones((1, Tp), jnp.int32),
        jnp.asarray(document),
        jnp.asarray(anchor[None].astype(np.int32)),
        jnp.asarray(depth[None].astype(np.int32)),
        jnp.asarray(valid[None]),
    )
    embed = None if dcfg.own_embedding else params["embed_tokens"]
    if dcfg.parallel:
        logits, _ = _element_logits()(dparams, batch, embed, cfg=dcfg, num_depths=K)
        per_depth = [
            logits[0, anchors] if d == 0 else logits[0, Tp + (d - 1) * roots : Tp + d * roots] for d in range(K)
        ]
    else:
        per_depth = [logits[0, anchors] for logits in _ttt_logits()(dparams, batch, embed, cfg=dcfg, num_depths=K)]
    logits_RKU = jnp.stack(per_depth, axis=1)
    top_l, top_i = jax.lax.top_k(logits_RKU, width)  # ranked as the draft ranks them
    top = np.asarray(to_target_ids(dparams, top_i, dcfg))  # [roots, K, width]
    labels = np.stack([np.asarray(answer[d + 1 : d + 1 + roots]) for d in range(K)], axis=1)
    hit = top == labels[:, :, None]  # root i's depth-(d+1) draft is answer[i + d + 1]
    out = np.where(hit.any(axis=2), hit.argmax(axis=2), width).astype(np.int64)
    if not probs:
        return out
    lse = jax.nn.logsumexp(logits_RKU.astype(jnp.float32), axis=-1)[..., None]
    return out, np.asarray(jnp.exp(top_l.astype(jnp.float32) - lse))


def check_sequential_tree(paths) -> None:
    """Refuse a tree that sequential (EAGLE-3) drafting cannot rank from :func:`candidate_ranks`: one with
    a node under a candidate other than the top one (sequential drafting drafts only the top one's
    children)."""
    for path in paths:
        if any(path[:-1]):
            node = "".join(map(str, path))
            raise UserError(
                f"tree node {node} hangs off a candidate other than the top one: sequential (EAGLE-3) drafting "
                "drafts only below the top candidates (use nodes such as 0, 1, 00, 01, 000)"
            )


@functools.cache
def _element_logits():
    """:func:`peagle_jax.train.objective.element_logits`, jitted once per process."""
    import jax

    from peagle_jax.train.objective import element_logits

    return jax.jit(element_logits, static_argnames=("cfg", "num_depths"))


@functools.cache
def _ttt_logits():
    """Per depth, the logits [B, T, U] of :func:`peagle_jax.train.ttt.ttt_forward`, jitted once per process."""
    import jax

    from peagle_jax.train.ttt import ttt_forward

    def logits(params, batch, embed_VD, *, cfg, num_depths):
        return [out[0] for out in ttt_forward(params, batch, embed_VD, cfg=cfg, num_depths=num_depths)]

    return jax.jit(logits, static_argnames=("cfg", "num_depths"))


def tokens_per_step(items, paths, width, **kw) -> dict:
    """Acceptance over answers ``items`` (``(ranks, answer)`` pairs) of the tree ``paths``."""
    return _pooled(simulate(ranks, answer, paths, width, **kw) for ranks, answer in items)


def dynamic_tokens_per_step(items, probs, budget: int, **kw) -> dict:
    """:func:`tokens_per_step` of dynamic trees of ``budget`` nodes (``probs``: each item's candidate
    probabilities, as :func:`candidate_ranks` gives them)."""
    runs = (
        run_accepted(dynamic_accepted_depths(r, p, budget), answer, K=r.shape[1], **kw)
        for (r, answer), p in zip(items, probs, strict=True)
    )
    return _pooled(runs)


def _pooled(runs) -> dict:
    """Tokens per step and accepted per depth, pooled over :func:`run_accepted` results."""
    f = e = 0
    per = None
    for a, b, p in runs:
        f, e = f + a, e + b
        per = p if per is None else [x + y for x, y in zip(per, p, strict=True)]
    return {
        "acceptance_length": e / f if f else 0.0,
        "accepted_per_position": [x / f for x in per] if f else [],
        "target_forwards": f,
    }


def grow(items, budgets: Sequence[int], *, K: int, width: int, **kw) -> dict[int, frozenset[RankPath]]:
    """Greedy tree growth on ``items``: per budget n, the tree of n nodes reached by adding, one at a time,
    the node that raises the tokens per step most (ties: the shallower, then lower ranks)."""
    tree: frozenset[RankPath] = frozenset()
    out = {}
    for n in range(1, max(budgets) + 1):
        frontier = {p + (r,) for p in tree | {()} if len(p) < K for r in range(width)} - tree
        score = {c: tokens_per_step(items, tree | {c}, width, **kw)["acceptance_length"] for c in frontier}
        best = max(sorted(frontier, key=lambda c: (len(c), c)), key=lambda c: score[c])
        tree = tree | {best}
        if n in budgets:
            out[n] = tree
    return out


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.trees", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="target directory or 'smollm2' (default)")
    p.add_argument("--drafter", help="P-EAGLE drafter directory (default: the shipped drafter of --model smollm2)")
    p.add_argument("--questions", type=int, default=0, help="use the first N MT-Bench questions (default all 80)")
    p.add_argument("--questions-file", help="JSONL of {'turns': [...]} instead of the MT-Bench asset")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens per answer (default 96)")
    p.add_argument("--depth", type=int, default=4, help="deepest draft depth K a tree may use (default 4)")
    p.add_argument("--width", type=int, default=8, help="candidates per depth, at most 10 (default 8)")
    p.add_argument("--budgets", default="1,3,7,15", help="tree sizes in nodes to report (default 1,3,7,15)")
    p.add_argument("--trees", default="0,1,2,00,10,20,000", help="';'-separated trees to compare with")
    p.add_argument(
        "--dynamic",
        action="store_true",
        help="also report, per budget, trees chosen anew at each root from the drafter's probabilities",
    )
    p.add_argument("--batch", type=int, default=16, help="answers generated per call (default 16)")
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        res = run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(res))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


def _budgets(text: str) -> list[int]:
    return sorted(set(errors.comma_ints(text, "--budgets", "3,7,15", minimum=1)))


def run(args) -> dict:
    from tqdm import tqdm

    from peagle_jax.bench.mtbench import chat_prompts, default_drafters, generate_all, load_questions, stop_ids
    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.drafter.load import load_drafter
    from peagle_jax.engine.generator import Generator
    from peagle_jax.loading import load_tokenizer, resolve_model_dir

    if not 1 <= args.width <= 10:
        raise UserError(f"--width {args.width}: must be 1..10 (a tree spec writes each rank as one digit)")
    if args.depth < 1 or args.max_new_tokens < 2:
        raise UserError("--depth must be >= 1 and --max-new-tokens >= 2")
    budgets = _budgets(args.budgets)
    given = {t: paths_of(t) for t in args.trees.split(";") if t.strip()}
    wide = [t for t, ps in given.items() if max(max(p) for p in ps) >= args.width]
    if wide:
        raise UserError(f"--trees {wide[0]}: uses a candidate rank >= --width {args.width}")
    K = max([args.depth] + [max(map(len, ps)) for ps in given.values()])
    args.eagle3_drafter = ""
    default_drafters(args)
    model_dir = resolve_model_dir(args.model)
    tok = load_tokenizer(model_dir)
    questions = load_questions(args.questions_file, args.questions or None)
    if len(questions) < 2:
        raise UserError("at least 2 questions are needed (a search half and a held-out half)")
    if tok is None:
        raise UserError(f"{model_dir} has no tokenizer (the questions are put in its chat template)")
    prompts = chat_prompts(tok, questions)
    dcfg, dparams = load_drafter(args.drafter)
    if dcfg.algorithm != "peagle":
        raise UserError(f"{args.drafter}: an {dcfg.algorithm} drafter; trees here rank P-EAGLE's parallel drafts")
    cfg, params = load_target_any(model_dir, aux_layer_ids=dcfg.aux_layer_ids)
    need = args.max_new_tokens + K  # the last root's drafts are checked against K tokens past it
    plain = Generator(cfg, params, max_seq_len=max(len(p) for p in prompts) + need + 1)
    print(f"answering {len(prompts)} questions ({need} greedy tokens each) ...", file=sys.stderr, flush=True)
    answers = generate_all(plain, prompts, batch=args.batch, max_new_tokens=need, temperature=0.0, stops=[])
    items, probs = [], []
    for prompt, answer in tqdm(list(zip(prompts, answers, strict=True)), desc="ranks", unit="answer"):
        ranks, cand_probs = candidate_ranks(
            cfg, params, dcfg, dparams, prompt, answer, K=K, width=args.width, probs=True
        )
        items.append((ranks, answer))
        probs.append(cand_probs)
    kw = {"max_new_tokens": args.max_new_tokens, "stops": stop_ids(cfg, tok)}
    search, held = items[0::2], items[1::2]  # alternate questions: MT-Bench is ordered by category
    grown = grow(search, budgets, K=K, width=args.width, **kw)
    rows = []
    for label, paths in [*((f"grown, {n} nodes", ps) for n, ps in grown.items()), *given.items()]:
        rows.append(
            {
                "tree": label if label in given else f"{label}: {spec(paths)}",
                "grown": label not in given,
                "spec": spec(paths),
                "nodes": len(paths),
                "search": tokens_per_step(search, paths, args.width, **kw),
                "held_out": tokens_per_step(held, paths, args.width, **kw),
            }
        )
    if args.dynamic:
        for n in budgets:
            rows.append(
                {
                    "tree": f"dynamic, {n} nodes",
                    "grown": False,
                    "dynamic": True,
                    "spec": None,
                    "nodes": n,
                    "search": dynamic_tokens_per_step(search, probs[0::2], n, **kw),
                    "held_out": dynamic_tokens_per_step(held, probs[1::2], n, **kw),
                }
            )
    all_ranks = np.concatenate([r[: args.max_new_tokens - 1] for r, _ in items])
    hits = [[float((all_ranks[:, d] == r).mean()) for r in range(args.width)] for d in range(K)]
    return {
        "drafter": str(args.drafter),
        "questions": len(questions),
        "max_new_tokens": args.max_new_tokens,
        "width": args.width,
        "depth": K,
        "rank_share": hits,
        "trees": rows,
    }


def markdown(res: dict) -> str:
    lines = [
        f"{res['questions']} questions, {res['max_new_tokens']} tokens each; search on every other question, "
        "held out the rest. Tokens per target forward (1 + accepted drafts):",
        "",
        "| tree | nodes | search | held out | held out accepted per depth |",
        "|---|---|---|---|---|",
    ]
    for r in res["trees"]:
        per = " / ".join(f"{x:.1%}" for x in r["held_out"]["accepted_per_position"])
        given = "" if r["grown"] else " (given)"
        name = f"{r['tree']} (per root)" if r.get("dynamic") else f"`{r['spec']}`{given}"
        lines.append(
            f"| {name} | {r['nodes']} | {r['search']['acceptance_length']:.3f} | "
            f"{r['held_out']['acceptance_length']:.3f} | {per} |"
        )
    lines += [
        "",
        "Share of roots whose token at depth d is the drafter's rank-r candidate (r = 0, 1, ...):",
        "",
    ]
    for d, h in enumerate(res["rank_share"], start=1):
        lines.append(f"- depth {d}: " + ", ".join(f"{x:.1%}" for x in h) + f" (in the top {len(h)}: {sum(h):.1%})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
