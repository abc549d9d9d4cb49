"""``python -m peagle_jax.bench.startup``: how soon ``python -m peagle_jax.serve`` answers, cold and warm.

For each server setting (``--setting NAME=FLAGS``; by default the default server and ``--max-batch 16
--max-seq-len 4096``) and each ``--compile`` mode (``background``, the default, and ``first``), it starts the
server twice on one fresh compilation cache directory: cold (the directory empty), then warm (filled by the
cold run). Each run measures, from the process start: when ``/health`` turns ready (``ready_s``), when the
first greedy chat request sent at that moment is answered (``first_answer_s``), and when no graph is left to
compile (``all_s``, from ``/health``'s ``graphs_pending``); then the graphs compiled before ready and in all,
the server's compile seconds, and the executables it loaded from the compilation cache's store and
compiled (``/metrics``). The runs of one setting go one after the other, so their
ratios are measured side by side. Prints a markdown table; ``--json FILE`` writes the results.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from peagle_jax import errors
from peagle_jax.bench.server import ServerProcess
from peagle_jax.errors import UserError

DEFAULT_SETTINGS = {"default": [], "16x4096": ["--max-batch", "16", "--max-seq-len", "4096"]}
MODES = ("background", "first")


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.startup", description=__doc__.split("\n")[0])
    p.add_argument(
        "--setting",
        action="append",
        metavar="NAME=FLAGS",
        help="a server setting: a name and the serve flags it adds, e.g. 'small=--max-batch 2 --max-seq-len 256' "
        "(repeatable; default: 'default=' and '16x4096=--max-batch 16 --max-seq-len 4096')",
    )
    p.add_argument("--modes", default="background,first", help="--compile modes to run (default background,first)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens of the first request (default 16)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take (default 3600)")
    p.add_argument("--json", help="write the results to this file")
    return p


def parse_settings(items: list[str] | None) -> dict[str, list[str]]:
    if not items:
        return dict(DEFAULT_SETTINGS)
    settings = {}
    for item in items:
        name, sep, flags = item.partition("=")
        if not sep or not name:
            raise UserError(f"--setting {item!r}: expected NAME=FLAGS, e.g. 'small=--max-batch 2'")
        settings[name] = shlex.split(flags)
    return settings


def one_run(flags: list[str], cache: Path, log: Path, max_tokens: int, timeout: float) -> dict:
    """Start a server with ``flags`` on compilation cache ``cache``, measure it (see the module docstring)
    and stop it."""
    server = ServerProcess([*flags, "--compilation-cache", str(cache)], log)
    try:
        health = server.wait_ready(timeout)
        ready = time.perf_counter() - server.started
        body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": max_tokens, "temperature": 0}
        body["model"] = server.model_id()
        req = urllib.request.Request(
            server.url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer = json.loads(r.read())
        first_answer = time.perf_counter() - server.started
        server.wait_ready(timeout, all_graphs=True)
        all_ready = time.perf_counter() - server.started
        m = server.metrics()
        graphs = int(m["peagle_graphs_compiled"] + m["peagle_graphs_pending"])
    finally:
        server.stop()
    return {
        "ready_s": round(ready, 2),
        "first_answer_s": round(first_answer, 2),
        "all_s": round(all_ready, 2),
        "graphs_before_ready": graphs - health["graphs_pending"],
        "graphs": graphs,
        "compile_s": m["peagle_compile_seconds"],
        "executables_loaded": int(m['peagle_executables_total{source="store"}']),
        "executables_compiled": int(m['peagle_executables_total{source="compiled"}']),
        "completion_tokens": answer["usage"]["completion_tokens"],
    }


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = parse_settings(args.setting)
        modes = errors.comma_list(args.modes, "--modes", ",".join(MODES))
        if any(m not in MODES for m in modes):
            raise UserError(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
        if args.max_tokens < 1:
            raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    results = []
    logdir = Path(tempfile.mkdtemp(prefix="peagle-bench-startup-"))
    for name, flags in settings.items():
        for mode in modes:
            cache = Path(tempfile.mkdtemp(prefix="jax-cache-", dir=logdir))
            for temperature in ("cold", "warm"):
                log = logdir / f"{name}-{mode}-{temperature}.log"
                print(f"{name}, --compile {mode}, {temperature} cache (log: {log})", file=sys.stderr, flush=True)
                try:
                    run = one_run([*flags, "--compile", mode], cache, log, args.max_tokens, args.timeout)
                except UserError as err:  # the server exited or took too long: its log says why
                    return errors.report(err)
                results.append({"setting": name, "flags": flags, "compile": mode, "cache": temperature, **run})
    header = "| setting | --compile | cache | graphs before ready / all | ready | first answer | all graphs |"
    print(header)
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['setting']} | {r['compile']} | {r['cache']} | {r['graphs_before_ready']} / {r['graphs']} | "
            f"{r['ready_s']:.1f} s | {r['first_answer_s']:.1f} s | {r['all_s']:.1f} s |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
