"""Compiled graphs shipped with the model (``serve --warmup-only`` into ``MODEL/jax-cache``): a server started
on that model directory finds every graph in it and compiles none (the executable store's loads and JAX's
persistent cache lookups, counted in /metrics); other flags (graphs the artifact lacks) still compile, and are
counted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from serve_fixtures import ServerProcess, http, parse_metrics, write_tiny_model

FLAGS = ["--max-batch", "2", "--max-seq-len", "64", "--compile", "first"]


def _lookups(server) -> dict[str, float]:
    """JAX's persistent cache lookups (hit, miss) and the executable store's (store, compiled)."""
    m = parse_metrics(http(server.base, "GET", "/metrics")[2].decode())
    found = {r: m[f'peagle_compilation_cache_lookups_total{{result="{r}"}}'] for r in ("hit", "miss")}
    return found | {s: m[f'peagle_executables_total{{source="{s}"}}'] for s in ("store", "compiled")}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("aot") / "model")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "peagle_jax.serve", "--model", str(model), *FLAGS, "--warmup-only"]
    proc = subprocess.run(
        [*cmd, "--compilation-cache", str(model / "jax-cache")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "graphs into" in proc.stdout and any((model / "jax-cache").iterdir())
    return model


def test_a_model_that_brings_its_graphs_starts_without_compiling(artifact, tmp_path):
    server = ServerProcess("--model", str(artifact), *FLAGS, log=tmp_path / "server.log").wait()
    try:
        lookups = _lookups(server)
        # the decoding graphs come from the executable store (untraced), the few others from JAX's cache
        assert lookups["miss"] == lookups["compiled"] == 0 and lookups["store"] > 0, lookups
        body = '{"model": "model", "prompt": "ab", "max_tokens": 4, "temperature": 0}'
        assert http(server.base, "POST", "/v1/completions", body)[0] == 200
        after = _lookups(server)
        assert after["miss"] == after["compiled"] == 0, after  # nor on the request path
        assert f"compilation cache: {artifact / 'jax-cache'}" in server.log.read_text()
    finally:
        assert server.stop() == 0
    # Flags the artifact was not compiled for: those graphs compile (and are counted as misses).
    other = ServerProcess("--model", str(artifact), *FLAGS[:2], "--max-seq-len", "96", log=tmp_path / "other.log")
    try:
        assert _lookups(other.wait())["compiled"] > 0
    finally:
        other.stop()


def test_a_read_only_artifact_cache_is_copied_where_it_can_grow(tmp_path, monkeypatch):
    from peagle_jax import platform

    (tmp_path / "model" / "jax-cache").mkdir(parents=True)
    (tmp_path / "model" / "jax-cache" / "entry").write_text("x")
    monkeypatch.setenv("PEAGLE_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(platform.os, "access", lambda path, mode: False)  # as /opt/ml/model on SageMaker
    copy = platform.artifact_cache(tmp_path / "model")
    assert copy == tmp_path / "cache" / "jax-cache-artifact" and (copy / "entry").read_text() == "x"
    assert platform.artifact_cache(tmp_path / "elsewhere") is None


def test_warmup_only_needs_a_cache(artifact):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "peagle_jax.serve", "--model", str(artifact), *FLAGS, "--warmup-only"]
    proc = subprocess.run([*cmd, "--compilation-cache", "none"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "error: --warmup-only needs a compilation cache" in proc.stderr
