"""``python -m peagle_jax.bench.serve`` end to end on a tiny model: three servers (plain, speculative at a
fixed K, the adaptive default, and with --sync the plain and adaptive ones reading every step before the
next), every level measured, the steps each server ran at each K' reported."""

from __future__ import annotations

import json

import pytest
from serve_fixtures import write_tiny_drafter, write_tiny_model

from peagle_jax.bench import serve as bench_serve
from peagle_jax.errors import UserError
from peagle_jax.spec.state import SpecStats


def test_policy_step_times_round_trip_through_metrics():
    from peagle_jax.bench.server import parse_metrics
    from peagle_jax.serve.metrics import Metrics

    def scraped(m):  # what the benchmark reads from /metrics
        return parse_metrics(m.render())

    m = Metrics()
    m.spec_stats = SpecStats(accepted_per_position=[0, 0])
    m.policy_step_s = lambda: {(4, 2): 0.0205, (1, 0): 0.0142, (1, 2): 0.0181, (4, 0): 0.0165}
    assert scraped(m)['peagle_policy_step_seconds{rows="1",k="2"}'] == pytest.approx(0.0181)
    assert bench_serve.policy_step_ms(scraped(m)) == {"1x0": 14.2, "1x2": 18.1, "4x0": 16.5, "4x2": 20.5}
    assert list(bench_serve.policy_step_ms(scraped(m))) == ["1x0", "1x2", "4x0", "4x2"]  # rows, then K'
    m.policy_step_s = None  # a server without --load-k auto: no such samples
    assert "peagle_acceptance_length" in scraped(m) and bench_serve.policy_step_ms(scraped(m)) == {}


@pytest.mark.slow
def test_bench_serve_runs_every_mode_and_reports_steps_by_k(tmp_path, capsys):
    model = write_tiny_model(tmp_path / "target")
    drafter = write_tiny_drafter(tmp_path / "drafter", k=2)
    out = tmp_path / "serve.json"
    argv = ["--model", str(model), "--drafter", str(drafter), "--k", "2", "--concurrency", "1,2", "--rounds", "2"]
    argv += ["--max-tokens", "12", "--max-seq-len", "128", "--load-k", "2:0", "--sync", "--json", str(out)]
    assert bench_serve.main(argv) == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    modes = list(result["modes"])
    auto, fixed = "speculative K=2, --load-k auto (default)", "speculative K=2, --load-k 2:0"
    synced = ["plain, --sync-steps", "speculative K=2, --load-k auto, --sync-steps"]
    assert modes == ["plain", "speculative K=2", auto, fixed, *synced]
    for name in modes:
        levels = result["modes"][name]["levels"]
        assert [r["concurrency"] for r in levels] == [1, 2]
        assert all(r["requests"] == 2 * r["concurrency"] and r["throughput_tok_s"] > 0 for r in levels)
        steps = [{int(k): n for k, n in r["steps_by_k"].items()} for r in levels]
        lazy = [(r.get("unsynced_admissions"), r.get("drafter_resyncs")) for r in levels]
        if name.startswith("plain"):
            assert lazy == [(None, None)] * 2
        elif "auto" not in name:  # a fixed K keeps every drafter current
            assert lazy == [(0, 0)] * 2
        else:
            assert all(n >= 0 and m >= 0 for n, m in lazy)
        if name.startswith("plain"):
            assert steps == [{}, {}]
        elif name == "speculative K=2":
            assert all(set(s) == {2} for s in steps)
        elif "2:0" in name:
            assert steps[0] == {2: steps[0][2]} and steps[1].get(0, 0) > 0  # plain steps with >= 2 busy
        else:
            assert sum(steps[0].values()) > 0 and set(steps[0]) <= {0, 2}  # a plain step or the draft
        # The policy's step times, from /metrics: the warm-up's calibration of every row bucket and K', then
        # after each level; only the --load-k auto servers have one.
        calibrated = result["modes"][name].get("calibrated_step_ms")
        after = [r.get("policy_step_ms") for r in levels]
        if "auto" in name:
            keys = {tuple(int(x) for x in key.split("x")) for key in calibrated}
            assert {k for _, k in keys} == {0, 2} and {r for r, _ in keys} >= {1, 2}
            assert all(t > 0 for t in calibrated.values())
            assert all(set(a) == set(calibrated) and all(t > 0 for t in a.values()) for a in after)
        else:
            assert calibrated is None and after == [None, None]
    assert "| speculative K=2, --load-k auto (default) | 2 |" in table and "steps by K'" in table


@pytest.mark.slow
def test_bench_serve_with_a_tree_in_bfloat16(tmp_path, capsys):
    """--tree replaces the chain of --k in the speculative modes (named after it); --dtype reaches the servers;
    --temperature and --top-p make every request a sampled one."""
    model = write_tiny_model(tmp_path / "target")
    drafter = write_tiny_drafter(tmp_path / "drafter", k=2)
    out = tmp_path / "serve.json"
    argv = ["--model", str(model), "--drafter", str(drafter), "--tree", "0,1,00", "--concurrency", "1"]
    argv += ["--rounds", "1", "--max-tokens", "8", "--max-seq-len", "64", "--dtype", "bfloat16", "--json", str(out)]
    argv += ["--temperature", "0.8", "--top-p", "0.9", "--window-buckets", "32"]
    assert bench_serve.main([*argv, "--repeats", "2"]) == 0
    result = json.loads(out.read_text())
    tree = "speculative tree 0,1,00"
    # The modes take turns in an order that rotates with each repeat.
    captured = capsys.readouterr()
    progress = [line.split(" c=")[0] for line in captured.err.splitlines() if " c=1 [" in line]
    auto, windows = f"{tree}, --load-k auto (default)", f"{tree}, --load-k auto, --window-buckets 32"
    assert progress == ["plain", tree, auto, windows, tree, auto, windows, "plain"]
    assert list(result["modes"]) == ["plain", tree, auto, windows]
    # --window-buckets reaches its server: a 32-slot window below the default's whole-cache one, twice the graphs
    graphs = {name: mode["graphs"] for name, mode in result["modes"].items()}
    assert graphs[auto] > 0 and graphs[windows] > graphs[auto]
    assert result["config"]["dtype"] == "bfloat16"
    assert (result["config"]["temperature"], result["config"]["top_p"]) == (0.8, 0.9)
    assert all(set(r["steps_by_k"]) == {"2"} for r in result["modes"][tree]["levels"])  # K': the tree's depth
    for mode in result["modes"].values():  # two repeats of one request each, pooled
        (level,) = mode["levels"]
        assert level["requests"] == 2 and len(level["throughput_per_repeat"]) == 2
        assert level["throughput_tok_s"] == pytest.approx(level["tokens"] / level["wall_s"])
    mine, plain = (result["modes"][m]["levels"][0]["throughput_per_repeat"] for m in (tree, "plain"))
    ratios = [r / p for r, p in zip(mine, plain, strict=True)]
    row = next(line for line in captured.out.splitlines() if line.startswith(f"| {tree} | 1 |"))
    assert f"({min(ratios):.2f}-{max(ratios):.2f}) |" in row


def test_bench_serve_refuses_a_bad_tree(capsys):
    assert bench_serve.main(["--tree", "1,00"]) == 2
    assert capsys.readouterr().err.startswith("error: --tree '1,00'")


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--concurrency", "1,x"], "--concurrency '1,x': expected comma-separated integers"),
        (["--concurrency", "0"], "--concurrency '0': every value must be >= 1"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--max-tokens", "-3"], "--max-tokens must be at least 1"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--window-buckets", "-5"], "--window-buckets: expected 'none' or comma-separated positive sizes"),
    ],
)
def test_bench_serve_refuses_bad_counts(flags, message, capsys):
    assert bench_serve.main(flags) == 2
    assert message in capsys.readouterr().err


def test_bench_serve_modes_from_flags(tmp_path, monkeypatch, capsys):
    """--no-fixed leaves out the mode drafting at every step; each --window-buckets adds the default with
    those windows."""
    seen = {}

    def record(modes, levels, model, args):
        seen.update(modes)
        raise UserError("recorded")

    monkeypatch.setattr(bench_serve, "run_modes", record)
    drafter = write_tiny_drafter(tmp_path / "drafter", k=2)
    argv = ["--model", str(write_tiny_model(tmp_path / "target")), "--drafter", str(drafter), "--k", "2"]
    argv += ["--no-fixed", "--window-buckets", "none", "--window-buckets", "256,1024"]
    assert bench_serve.main(argv) == 1 and "error: recorded" in capsys.readouterr().err
    auto = "speculative K=2, --load-k auto"
    windows = [f"{auto}, --window-buckets none", f"{auto}, --window-buckets 256,1024"]
    assert list(seen) == ["plain", f"{auto} (default)", *windows]
    assert seen[f"{auto}, --window-buckets 256,1024"][-2:] == ["--window-buckets", "256,1024"]
