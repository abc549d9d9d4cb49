"""``python -m peagle_jax.bench.serve``: throughput and latency of ``python -m peagle_jax.serve`` at several
concurrency levels, speculation off and on, in one run.

For each mode (plain; speculative with ``--drafter``, by default the shipped drafter of the embedded
SmolLM2, or a random P-EAGLE drafter of SmolLM2's size for other models, drafting K tokens at every step
(``--load-k none``); the server's default, which picks plain, 1 or K drafts per step by measured throughput
(``--load-k auto``); optionally another ``--load-k`` policy, and the default with other attention windows
(``--window-buckets``)) the benchmark starts a server with the same
model and flags and waits until its graphs are compiled; all servers stay up, and at each concurrency level c
each mode in turn runs ``--rounds`` x c streamed completions (greedy, or sampled at ``--temperature``) from
c client threads (each client sends its next request when the previous one ends). Per request it records
the time to the first token (TTFT) and the time per output token after it (TPOT); per level the
output-token throughput (generated tokens / wall time) and the engine steps at each draft length K' (from
/metrics). With ``--repeats N`` each level is measured N times, the modes taking turns, and the table adds
the range of the N side-by-side ratios to plain, which shows how far a ratio is from this machine's noise.
Prints a markdown table and, with ``--json FILE``, the raw numbers.

A random drafter accepts almost nothing, so its numbers show the cost of speculation without its gain:
they are a floor, not what a trained drafter reaches. The acceptance length each speculative server
reached is scraped from its /metrics and printed under the table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

from peagle_jax import errors
from peagle_jax.bench.server import ServerProcess
from peagle_jax.errors import UserError

READY_TIMEOUT_S = 1800  # each server's start-up, warm-up included

PROMPTS = [
    "Explain how a CPU cache works.",
    "Write a short story about a lighthouse keeper.",
    "List five uses of a paperclip.",
    "What is speculative decoding in language models?",
    "Describe the water cycle to a child.",
    "Give three tips for writing clear code.",
    "Summarize the plot of a heist movie you invent.",
    "Why is the sky blue?",
]


def _percentile(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def one_request(client, model: str, prompt: str, max_tokens: int, sampling: dict | None = None) -> dict:
    """One streamed completion: greedy, or with ``sampling``'s ``temperature`` / ``top_p`` / ``seed``."""
    t0 = time.perf_counter()
    first = None
    usage = None
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, stream=True, **(sampling or {"temperature": 0})
    ):
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
        if chunk.usage:
            usage = chunk.usage
    end = time.perf_counter()
    first = first or end
    n = usage.completion_tokens
    return {"ttft": first - t0, "tpot": (end - first) / (n - 1) if n > 1 else float("nan"), "tokens": n, "end": end}


def run_level(
    base: str, model: str, concurrency: int, rounds: int, max_tokens: int, temperature: float = 0.0, top_p=1.0
) -> dict:
    """``rounds`` x ``concurrency`` streamed completions from ``concurrency`` client threads (greedy at
    ``temperature`` 0; else sampled, each request with its own seed): each request's TTFT, TPOT and
    tokens, and the wall time."""
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=3600)
    results: list[dict] = []
    lock = threading.Lock()

    errors: list[str] = []

    def worker(i):
        for r in range(rounds):
            prompt = f"{PROMPTS[(i + r) % len(PROMPTS)]} (#{i}.{r})"
            sampling = {"temperature": temperature, "top_p": top_p, "seed": 1000 * i + r} if temperature else None
            try:
                out = one_request(client, model, prompt, max_tokens, sampling)
            except Exception as err:  # reported below: a failed request makes the level meaningless
                with lock:
                    errors.append(f"{type(err).__name__}: {err}")
                return
            with lock:
                results.append(out)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed at concurrency {concurrency}; first: {errors[0]}")
    return {"results": results, "wall_s": wall}


def _throughput(run: dict) -> float:
    """Output tokens per second of one :func:`run_level` output."""
    return sum(r["tokens"] for r in run["results"]) / run["wall_s"]


def summarize(concurrency: int, runs: list[dict]) -> dict:
    """One level's numbers over its repeats (:func:`run_level` outputs): throughput = all tokens / all wall
    time, percentiles over every request, and each repeat's throughput on its own."""
    results = [r for run in runs for r in run["results"]]
    tokens = sum(r["tokens"] for r in results)
    wall = sum(run["wall_s"] for run in runs)
    tpots = [r["tpot"] for r in results if r["tpot"] == r["tpot"]]
    ttfts = [r["ttft"] for r in results]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "tokens": tokens,
        "wall_s": wall,
        "throughput_tok_s": tokens / wall,
        "throughput_per_repeat": [_throughput(run) for run in runs],
        "ttft_p50_s": _percentile(ttfts, 0.5),
        "ttft_p99_s": _percentile(ttfts, 0.99),
        "tpot_p50_s": _percentile(tpots, 0.5),
        "tpot_p99_s": _percentile(tpots, 0.99),
    }


# The drafter work the default (--load-k auto) skipped under load, and caught up: JSON key -> metric.
LAZY_DRAFTER = {
    "unsynced_admissions": "peagle_unsynced_admissions_total",
    "drafter_resyncs": "peagle_drafter_resyncs_total",
}


def steps_by_k(metrics: dict[str, float]) -> dict[int, float]:
    """Engine steps at each draft length K' (0: plain) so far."""
    prefix = 'peagle_speculative_steps_total{k="'
    return {int(name[len(prefix) : -2]): v for name, v in metrics.items() if name.startswith(prefix)}


def policy_step_ms(metrics: dict[str, float]) -> dict[str, float]:
    """The ``--load-k auto`` policy's step times, ``"{rows}x{K'}"`` -> ms (empty for a server without it)."""
    sample = re.compile(r'peagle_policy_step_seconds\{rows="(\d+)",k="(\d+)"\}')
    times = {}
    for name, v in metrics.items():
        if m := sample.fullmatch(name):
            times[int(m[1]), int(m[2])] = round(v * 1e3, 3)
    return {f"{rows}x{k}": ms for (rows, k), ms in sorted(times.items())}


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="target directory or 'smollm2' (default)")
    p.add_argument(
        "--drafter",
        help="drafter directory (default: the shipped drafter for smollm2, else a random SmolLM2-sized P-EAGLE one)",
    )
    p.add_argument(
        "--k",
        type=int,
        help="draft tokens per step (a chain of K) in the speculative modes (default: the server's: a shipped "
        "drafter's own tree, else the drafter config's K)",
    )
    p.add_argument(
        "--tree",
        help="a static draft tree for the speculative modes instead of a chain of --k, e.g. 0,1,00,10 (default: "
        "the server's, see --k)",
    )
    p.add_argument(
        "--load-k", default="", help="also run speculation with this --load-k policy, e.g. 4:1,12:0 (default: none)"
    )
    p.add_argument(
        "--window-buckets",
        action="append",
        default=[],
        help="also run the server's default (--load-k auto) with this server --window-buckets, e.g. none "
        "(every step attends over the whole cache); repeatable, a server each (default: none run)",
    )
    p.add_argument(
        "--no-fixed",
        action="store_true",
        help="leave out the speculative mode that drafts at every step (--load-k none): one server fewer "
        "(each holds its compiled graphs: several GiB at long --max-seq-len)",
    )
    p.add_argument(
        "--sync",
        action="store_true",
        help="also run plain and --load-k auto with --sync-steps (each step read before the next is launched)",
    )
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts (default 1,4,16)")
    p.add_argument("--rounds", type=int, default=2, help="requests per client per level (default 2)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure each level this many times, the modes taking turns (default 1); the table adds the range "
        "of the per-repeat ratios to plain",
    )
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every request (default 0: greedy); each request gets its own seed",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="top_p of every request (default 1: off)")
    p.add_argument("--max-seq-len", type=int, default=256, help="server --max-seq-len (default 256)")
    p.add_argument("--platform", help="server --platform (default: the server's, cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="server --dtype (default: the server's, float32)")
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from peagle_jax.drafter.shipped import default_tree, resolve_drafter
    from peagle_jax.engine.buckets import parse_window_buckets
    from peagle_jax.sampling import check_sampling_args
    from peagle_jax.spec.tree import parse_tree

    try:
        levels = _levels(args.concurrency)
        for flag in ("rounds", "repeats", "max_tokens"):
            if getattr(args, flag) < 1:
                raise UserError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
        if args.tree:
            parse_tree(args.tree)
        for windows in args.window_buckets:
            try:
                parse_window_buckets(windows)
            except ValueError as err:
                raise UserError(f"--window-buckets: {err}") from None
        check_sampling_args(args.temperature, 0, args.top_p)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    drafter = args.drafter or resolve_drafter(args.model, None, None)
    args.tree = default_tree(drafter, args.k, args.tree)  # named as the server resolves it
    if drafter is None:
        import jax

        from peagle_jax.bench.draft import smollm2_sized_drafter
        from peagle_jax.drafter.load import save_drafter
        from peagle_jax.drafter.model import init_drafter_params

        dcfg = smollm2_sized_drafter(2, 49152).replace(own_embedding=False)
        drafter = tempfile.mkdtemp(prefix="peagle-bench-drafter-")
        save_drafter(drafter, dcfg, init_drafter_params(dcfg, jax.random.key(0)))
    common = ["--model", args.model, "--max-batch", str(max(levels)), "--max-seq-len", str(args.max_seq_len)]
    common += ["--compile", "first"]  # every graph compiled before the clients start: steady-state numbers
    if args.platform:
        common += ["--platform", args.platform]
    if args.dtype:
        common += ["--dtype", args.dtype]
    model = "smollm2" if args.model == "smollm2" else Path(args.model).resolve().name
    shape = ["--tree", args.tree] if args.tree else ["--k", str(args.k)] if args.k is not None else []
    spec = [*common, "--drafter", drafter, *shape]
    what = f"tree {args.tree}" if args.tree else f"K={args.k}" if args.k is not None else "the drafter config's K"
    modes = {
        "plain": [*common, "--k", "0"],
        f"speculative {what}": [*spec, "--load-k", "none"],
        f"speculative {what}, --load-k auto (default)": [*spec, "--load-k", "auto"],
    }
    if args.no_fixed:
        del modes[f"speculative {what}"]
    if args.load_k:
        modes[f"speculative {what}, --load-k {args.load_k}"] = [*spec, "--load-k", args.load_k]
    for windows in args.window_buckets:
        name = f"speculative {what}, --load-k auto, --window-buckets {windows}"
        modes[name] = [*spec, "--load-k", "auto", "--window-buckets", windows]
    if args.sync:
        modes["plain, --sync-steps"] = [*modes["plain"], "--sync-steps"]
        modes[f"speculative {what}, --load-k auto, --sync-steps"] = [*spec, "--load-k", "auto", "--sync-steps"]
    try:
        out = run_modes(modes, levels, model, args)
    except (RuntimeError, UserError) as err:  # a failed request, or a server that did not start
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(table(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def _levels(text: str) -> list[int]:
    """``--concurrency``'s client counts."""
    return errors.comma_ints(text, "--concurrency", "1,4", minimum=1)


def run_modes(modes: dict[str, list[str]], levels: list[int], model: str, args) -> dict:
    """Start one server per mode (all alive at once), then at each concurrency level measure the modes one
    after the other, ``args.repeats`` times over in a rotating order, so that a drift in the machine's speed
    hits every mode alike."""
    out = {"config": vars(args), "modes": {name: {"levels": []} for name in modes}}
    logdir = Path(tempfile.mkdtemp(prefix="peagle-bench-serve-"))
    servers: dict[str, ServerProcess] = {}
    try:
        for i, (name, flags) in enumerate(modes.items()):
            servers[name] = server = ServerProcess(flags, logdir / f"mode{i}.log")
            server.wait_ready(READY_TIMEOUT_S)
            out["modes"][name]["ready_s"] = time.perf_counter() - server.started
        for name, server in servers.items():
            metrics = server.metrics()
            out["modes"][name]["graphs"] = int(metrics.get("peagle_graphs_compiled", 0))
            # What the adaptive policy's warm-up calibrated (empty for the other modes): why it drafts or not.
            if calibrated := policy_step_ms(metrics):
                out["modes"][name]["calibrated_step_ms"] = calibrated
        for c in levels:
            for server in servers.values():
                # One short request to every server before each level: a server that idled while the others
                # compiled or ran (minutes) serves a request before the timed ones.
                run_level(server.url, model, 1, 1, 4)
            runs: dict[str, list[dict]] = {name: [] for name in servers}
            before = {name: server.metrics() for name, server in servers.items()}
            for rep in range(args.repeats):
                # The order rotates with each repeat, so that no mode always runs right after the same one
                # (e.g. the plain server after the tree's compute-bound run, on a machine whose speed drifts).
                order = list(servers.items())
                order = order[rep % len(order) :] + order[: rep % len(order)]
                for name, server in order:
                    runs[name].append(
                        run_level(server.url, model, c, args.rounds, args.max_tokens, args.temperature, args.top_p)
                    )
                    tok_s = _throughput(runs[name][-1])
                    print(f"{name} c={c} [{rep + 1}/{args.repeats}]: {tok_s:.1f} tok/s", file=sys.stderr, flush=True)
            for name, server in servers.items():
                row = summarize(c, runs[name])
                after, was = server.metrics(), before[name]
                steps_before = steps_by_k(was)
                row["steps_by_k"] = {k: n - steps_before.get(k, 0) for k, n in sorted(steps_by_k(after).items())}
                for key, metric in LAZY_DRAFTER.items():
                    if metric in after:
                        row[key] = after[metric] - was[metric]
                if policy := policy_step_ms(after):
                    row["policy_step_ms"] = policy  # the policy's step times after the level
                out["modes"][name]["levels"].append(row)
        for name, server in servers.items():
            out["modes"][name]["acceptance_length"] = server.metrics().get("peagle_acceptance_length")
    finally:
        for server in servers.values():
            server.proc.terminate()
        for server in servers.values():
            server.stop(30)
    return out


def table(out: dict) -> str:
    names = list(out["modes"])
    lines = [
        "| mode | clients | requests | throughput tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | vs plain "
        "| steps by K' |",
        "|---|---|---|---|---|---|---|---|",
    ]
    plain = {r["concurrency"]: r for r in out["modes"][names[0]]["levels"]}
    for name in names:
        for r in out["modes"][name]["levels"]:
            lines.append(
                f"| {name} | {r['concurrency']} | {r['requests']} | {r['throughput_tok_s']:.1f} | "
                f"{1e3 * r['ttft_p50_s']:.0f} / {1e3 * r['ttft_p99_s']:.0f} | "
                f"{1e3 * r['tpot_p50_s']:.0f} / {1e3 * r['tpot_p99_s']:.0f} | "
                f"{_ratio(r, plain[r['concurrency']])} | {_share(r.get('steps_by_k') or {})} |"
            )
    for name in names[1:]:
        acc = out["modes"][name]["acceptance_length"]
        if acc is not None:
            lines.append(f"\n{name}: acceptance length {acc:.3f} tokens per speculative target forward")
    return "\n".join(lines)


def _ratio(row: dict, plain: dict) -> str:
    """Throughput over plain's, and with several repeats the range of the repeats' own ratios (each repeat's
    modes ran back to back): ``1.08x (1.02-1.15)``."""
    text = f"{row['throughput_tok_s'] / plain['throughput_tok_s']:.2f}x"
    pairs = list(zip(row.get("throughput_per_repeat", []), plain.get("throughput_per_repeat", []), strict=False))
    if len(pairs) > 1:
        ratios = [a / b for a, b in pairs]
        text += f" ({min(ratios):.2f}-{max(ratios):.2f})"
    return text


def _share(steps: dict) -> str:
    """``{0: 90, 3: 10}`` -> ``0: 90%, 3: 10%`` (the steps at each draft length K'; empty for plain)."""
    total = sum(steps.values())
    return ", ".join(f"{k}: {100 * n / total:.0f}%" for k, n in sorted(steps.items()) if n) if total else ""


if __name__ == "__main__":
    sys.exit(main())
