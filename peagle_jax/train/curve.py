"""``python -m peagle_jax.train.curve RUN_DIR``: a training run's learning curve in acceptance on held-out MT-Bench.

A run with ``run.export_steps`` leaves a drafter at each of those steps in ``RUN_DIR/drafters/step-N``
(:func:`peagle_jax.train.pipeline.run`), and ``metrics.jsonl`` records each step's loss tokens, so every
export sits at a known number of training tokens. For each export (and the final ``RUN_DIR/drafter``) this
measures, on the held-out half of the MT-Bench questions (the odd ones; never trained on), the acceptance
length of greedy speculative decoding with each ``--trees`` tree (default: the served tree ``0,1,2,3,4,00,01``
and a chain of 7) and the accepted drafts per position, without decoding: the target answers each question
greedily once, and one drafter pass per answer ranks the answer's tokens among the drafts at every root
(:func:`peagle_jax.bench.trees.candidate_ranks`, tested equal to decoding). An EAGLE-3 run's drafters are
ranked from their training-time-test passes along the answer, which decide the acceptance of sequential
drafting exactly for trees whose nodes all hang off the top candidates (both default trees; others are
refused for them).

Writes each run's curve to ``RUN_DIR/curve.json`` and a plot of acceptance length against training tokens
to ``RUN_DIR/curve.png`` (with one run, ``--json`` and ``--plot`` move them). Several runs are compared on one
plot: ``--json`` and ``--plot`` then name the combined curve, e.g. P-EAGLE against EAGLE-3 trained on the same
data. The target answers the held-out questions once for all runs, and a run whose ``curve.json`` already
measured the same drafters (by content) with the same settings is read rather than measured again.
``--reference DRAFTER`` measures another drafter (a shipped one by name) on the same answers and trees, to read
a run's drafters against it: a horizontal line per tree on the plot.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from peagle_jax import errors
from peagle_jax.errors import UserError

DEFAULT_TREES = ("0,1,2,3,4,00,01", "0,00,000,0000,00000,000000,0000000")
WIDTH = 5  # candidates ranked per depth: every rank the default trees use, and room for others


def cumulative_tokens(run: Path) -> dict[int, int]:
    """Step -> loss tokens trained on up to and including it, from ``metrics.jsonl``."""
    total, out = 0, {}
    path = run / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            total += int(rec.get("loss_tokens", 0))
            out[int(rec["step"]) + 1] = total
    return out


def exports(run: Path) -> list[tuple[int, Path]]:
    """``(step, drafter dir)`` of the run's milestone exports and its final drafter, by step."""
    found = []
    for d in (run / "drafters").glob("step-*"):
        if (d / "config.json").exists() and d.name[5:].isdigit():
            found.append((int(d.name[5:]), d))
    summary = run / "summary.json"
    if (run / "drafter" / "config.json").exists() and summary.exists():
        step = int(json.loads(summary.read_text())["steps"])
        if step not in {s for s, _ in found}:
            found.append((step, run / "drafter"))
    return sorted(found)


def exports_of(run: Path) -> list[tuple[int, Path]]:
    """:func:`exports`, refusing a run that has none."""
    found = exports(run)
    if not found:
        raise UserError(f"{run}: no exported drafters (drafters/step-N or drafter/ with summary.json)")
    return found


def drafter_digest(path: Path) -> str:
    """sha256 over a drafter directory's config and weights: a re-exported drafter is measured again."""
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.is_file() and f.suffix in (".json", ".safetensors"):
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


def held_out_answers(model_dir, questions_file, limit, max_new_tokens: int, K: int):
    """``(cfg, params, prompts, answers, stops)``: the target's greedy answers to the held-out (odd) half
    of the MT-Bench questions, ``max_new_tokens + K`` tokens each (the last root's drafts are checked
    against K tokens past it)."""
    from peagle_jax.bench.mtbench import chat_prompts, generate_all, load_questions, stop_ids
    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.engine.generator import Generator
    from peagle_jax.loading import load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(model_dir)
    tok = load_tokenizer(model_dir)
    if tok is None:
        raise UserError(f"{model_dir} has no tokenizer (the questions are put in its chat template)")
    questions = load_questions(questions_file, limit)[1::2]
    if not questions:
        raise UserError("at least 2 questions are needed (the held-out half is the odd ones)")
    prompts = chat_prompts(tok, questions)
    cfg, params = load_target_any(model_dir)
    need = max_new_tokens + K
    plain = Generator(cfg, params, max_seq_len=max(len(p) for p in prompts) + need + 1)
    answers = generate_all(plain, prompts, batch=8, max_new_tokens=need, temperature=0.0, stops=[])
    return cfg, params, prompts, answers, stop_ids(cfg, tok)


def acceptance(target, drafter_dir: Path, trees, *, max_new_tokens: int) -> dict:
    """Per tree: acceptance length and accepted drafts per position over the held-out answers."""
    from peagle_jax.bench.trees import candidate_ranks, check_sequential_tree, paths_of, tokens_per_step
    from peagle_jax.drafter.load import load_drafter

    cfg, params, prompts, answers, stops = target
    dcfg, dparams = load_drafter(drafter_dir)
    if not dcfg.parallel:
        for t in trees:
            check_sequential_tree(paths_of(t))
    if tuple(dcfg.aux_layer_ids or cfg.aux_layer_ids) != tuple(cfg.aux_layer_ids):
        cfg = cfg.replace(aux_layer_ids=tuple(dcfg.aux_layer_ids))
    K = max(max(map(len, paths_of(t))) for t in trees)
    items = [
        (candidate_ranks(cfg, params, dcfg, dparams, p, a, K=K, width=WIDTH), a)
        for p, a in zip(prompts, answers, strict=True)
    ]
    kw = {"max_new_tokens": max_new_tokens, "stops": stops}
    return {t: tokens_per_step(items, paths_of(t), WIDTH, **kw) for t in trees}


def settings_of(*, model: str, questions_file=None, questions=None, max_new_tokens=128, trees=DEFAULT_TREES) -> dict:
    """What a curve's numbers depend on besides the drafters (recorded in its JSON; a reread must match)."""
    return {
        "model": str(model),
        "questions_file": None if questions_file is None else str(questions_file),
        "questions_limit": questions,
        "max_new_tokens": max_new_tokens,
        "trees": list(trees),
    }


def curve(run: Path, *, model: str, questions_file=None, questions=None, max_new_tokens=128, trees=DEFAULT_TREES,
          target=None):  # fmt: skip
    """The curve's points: per export, its step, training tokens and acceptance per tree. ``target``: the
    :func:`held_out_answers` to use (several runs share one); computed when None."""
    from peagle_jax.bench.trees import paths_of

    points = exports_of(run)
    K = max(max(map(len, paths_of(t))) for t in trees)
    if target is None:
        target = held_out_answers(model, questions_file, questions, max_new_tokens, K)
    tokens = cumulative_tokens(run)
    out = []
    for step, path in points:
        print(f"step {step}: {path}", file=sys.stderr, flush=True)
        res = acceptance(target, path, trees, max_new_tokens=max_new_tokens)
        point = {"step": step, "tokens": tokens.get(step), "drafter": str(path), "drafter_sha256": drafter_digest(path)}
        out.append({**point, "trees": res})
    settings = settings_of(model=model, questions_file=questions_file, questions=questions,
                           max_new_tokens=max_new_tokens, trees=trees)  # fmt: skip
    return {"questions": len(target[2]), "max_new_tokens": max_new_tokens, "settings": settings, "points": out}


def measured(path: Path, run: Path, settings: dict) -> dict | None:
    """The curve in ``path`` if it measured ``run``'s present exports (same steps, same drafter contents) with
    ``settings``; else None."""
    if not path.is_file():
        return None
    try:
        res = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    if res.get("settings") != settings:
        return None
    have = [(p.get("step"), p.get("drafter_sha256")) for p in res.get("points", [])]
    want = [(step, drafter_digest(d)) for step, d in exports(run)]
    return res if have == want else None


def reference_dir(ref: str) -> Path:
    """A ``--reference``: a drafter directory, or the name of a shipped drafter (``smollm2-peagle``)."""
    from peagle_jax.drafter.shipped import shipped_drafter

    path = Path(ref)
    if (path / "config.json").is_file():
        return path
    if path.exists() or len(path.parts) > 1:
        raise UserError(f"--reference {ref}: no drafter there (no config.json)")
    return shipped_drafter(ref)  # its error names the shipped drafters


def curves(runs: list[Path], *, json_paths: list[Path], model: str, questions_file=None, questions=None,
           max_new_tokens=128, trees=DEFAULT_TREES, references=()) -> tuple[list[dict], dict]:  # fmt: skip
    """Each run's curve, read from its ``json_paths`` entry where that measured the same drafters with the
    same settings, else measured (the target's held-out answers computed once, on the first need); and each
    of ``references`` (:func:`reference_dir`: e.g. the shipped drafters, to compare the runs with) measured on
    the same answers and trees: ``{reference: {"label", "drafter", "drafter_sha256", "trees"}}`` (the label
    of a shipped drafter: "shipped NAME")."""
    from peagle_jax.bench.trees import paths_of
    from peagle_jax.drafter.shipped import SHIPPED_DIR

    kw = {"model": model, "questions_file": questions_file, "questions": questions, "max_new_tokens": max_new_tokens}
    settings = settings_of(**kw, trees=trees)
    K = max(max(map(len, paths_of(t))) for t in trees)
    dirs = {ref: reference_dir(ref) for ref in references}  # refused before anything is measured
    target, out = None, []
    for run, path in zip(runs, json_paths, strict=True):
        exports_of(run)  # refused before any other run is measured
        res = measured(path, run, settings)
        if res is None:
            if target is None:
                target = held_out_answers(model, questions_file, questions, max_new_tokens, K)
            res = curve(run, **kw, trees=trees, target=target)
        else:
            print(f"{run}: the curve in {path} measured these drafters; read", file=sys.stderr, flush=True)
        out.append({k: v for k, v in res.items() if k != "references"})
    refs = {}
    for ref, d in dirs.items():
        if target is None:
            target = held_out_answers(model, questions_file, questions, max_new_tokens, K)
        print(f"reference {ref}: {d}", file=sys.stderr, flush=True)
        res = acceptance(target, d, trees, max_new_tokens=max_new_tokens)
        label = f"shipped {d.resolve().name}" if d.resolve().parent == SHIPPED_DIR else ref
        refs[ref] = {"label": label, "drafter": str(d), "drafter_sha256": drafter_digest(d), "trees": res}
    return out, refs


def tree_label(tree: str) -> str:
    return f"chain of {tree.count(',') + 1}" if set(tree) <= {"0", ","} else f"tree {tree}"


def plot(res: dict, path: Path, references=None) -> None:
    """One run's curve: acceptance length per tree against training tokens."""
    plot_runs([("", res)], path, references)


def plot_runs(named: list[tuple[str, dict]], path: Path, references=None) -> None:
    """``(name, curve)`` pairs on one plot: a colour per run, a line style per tree; each of ``references``
    (:func:`curves`) a horizontal line per tree in a grey of its own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5) if len(named) > 1 else (6, 4))
    styles = ("o-", "s--", "^:", "d-.")
    for i, (name, res) in enumerate(named):
        pts = [p for p in res["points"] if p["tokens"]]
        trees = list(pts[0]["trees"]) if pts else []
        for j, t in enumerate(trees):
            label = f"{name}: {tree_label(t)}" if name else tree_label(t)
            ys = [p["trees"][t]["acceptance_length"] for p in pts]
            ax.plot([p["tokens"] for p in pts], ys, styles[j % len(styles)], color=f"C{i}", label=label)
    lines = ("-", "--", ":", "-.")
    for i, r in enumerate((references or {}).values()):
        grey = str(0.2 + 0.5 * i / max(len(references) - 1, 1))
        for j, t in enumerate(r["trees"]):
            y = r["trees"][t]["acceptance_length"]
            ax.axhline(
                y, color=grey, linestyle=lines[j % len(lines)], linewidth=1, label=f"{r['label']}: {tree_label(t)}"
            )
    ax.set_xscale("log")
    ax.set_xlabel("training loss tokens")
    ax.set_ylabel("acceptance length (held-out MT-Bench)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def references_markdown(references: dict) -> str:
    """The references' acceptance lengths (and the first tree's accepted drafts per position) as a table."""
    trees = list(next(iter(references.values()))["trees"]) if references else []
    lines = ["| reference | " + " | ".join(f"AL `{t}`" for t in trees) + " | accepted per position (first tree) |"]
    lines.append("|" + "---|" * (2 + len(trees)))
    for r in references.values():
        als = " | ".join(f"{r['trees'][t]['acceptance_length']:.3f}" for t in trees)
        per = ", ".join(f"{x:.2f}" for x in r["trees"][trees[0]]["accepted_per_position"])
        lines.append(f"| {r['label']} | {als} | {per} |")
    return "\n".join(lines)


def markdown(res: dict) -> str:
    trees = list(res["points"][0]["trees"]) if res["points"] else []
    head = (
        "| step | training tokens | "
        + " | ".join(f"AL `{t}`" for t in trees)
        + " | accepted per position (first tree) |"
    )
    lines = [head, "|" + "---|" * (3 + len(trees))]
    for p in res["points"]:
        als = " | ".join(f"{p['trees'][t]['acceptance_length']:.3f}" for t in trees)
        per = ", ".join(f"{x:.2f}" for x in p["trees"][trees[0]]["accepted_per_position"])
        tokens = f"{p['tokens']:,}" if p["tokens"] else "?"
        lines.append(f"| {p['step']} | {tokens} | {als} | {per} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.train.curve", description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help="training run directories (train/train.py --output)")
    p.add_argument("--model", default="smollm2", help="the target (default smollm2, the embedded default)")
    p.add_argument("--questions-file", help="MT-Bench-style question.jsonl (default: the pinned MT-Bench asset)")
    p.add_argument("--questions", type=int, default=0, help="use the first N questions (0 = all 80); odd ones held out")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (default 128)")
    p.add_argument("--trees", default=";".join(DEFAULT_TREES), help="semicolon-separated trees (default: %(default)s)")
    p.add_argument("--json", help="one run: write its curve here (default RUN/curve.json); several: the combined curve")
    p.add_argument("--plot", help="one run: write its plot here (default RUN/curve.png); several: all runs on one plot")
    p.add_argument(
        "--reference",
        action="append",
        default=[],
        metavar="DRAFTER",
        help="a drafter to compare the runs with, measured on the same answers and trees: a drafter directory or "
        "a shipped drafter's name (smollm2-peagle, smollm2-eagle3); a horizontal line per tree on the plot, "
        "recorded under 'references' in the JSON; repeatable",
    )
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    runs = [Path(r) for r in args.runs]
    one = len(runs) == 1
    json_paths = [Path(args.json) if one and args.json else r / "curve.json" for r in runs]
    plot_paths = [Path(args.plot) if one and args.plot else r / "curve.png" for r in runs]
    try:
        if args.max_new_tokens < 2:
            raise UserError("--max-new-tokens must be >= 2")
        if len(set(runs)) < len(runs):
            raise UserError("a run is named twice")
        trees = [t.strip() for t in args.trees.split(";") if t.strip()]
        if not trees:
            raise UserError("--trees names no tree")
        if len(set(args.reference)) < len(args.reference):
            raise UserError("a --reference is named twice")
        results, refs = curves(runs, json_paths=json_paths, model=args.model, questions_file=args.questions_file,
                               questions=args.questions or None, max_new_tokens=args.max_new_tokens, trees=trees,
                               references=args.reference)  # fmt: skip
    except (UserError, ValueError) as e:
        return errors.report(e)
    for res, jp, pp in zip(results, json_paths, plot_paths, strict=True):
        # one run: its curve file and plot carry the references; several: the combined ones do
        jp.write_text(json.dumps({**res, "references": refs} if one and refs else res, indent=1))
        plot(res, pp, refs if one else None)
    ref_table = f"\n\n{references_markdown(refs)}" if refs else ""
    if one:
        print(markdown(results[0]) + ref_table)
        return 0
    names = [str(r) for r in runs]
    if args.json:
        combined = {"runs": dict(zip(names, results, strict=True)), **({"references": refs} if refs else {})}
        Path(args.json).write_text(json.dumps(combined, indent=1))
    if args.plot:  # labelled by directory name where those differ
        labels = [r.name for r in runs] if len({r.name for r in runs}) == len(runs) else names
        plot_runs(list(zip(labels, results, strict=True)), Path(args.plot), refs)
    for name, res in zip(names, results, strict=True):
        print(f"### {name}\n\n{markdown(res)}\n")
    if refs:
        print(f"### References{ref_table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
