"""``--platform``: a missing accelerator plugin is one error line naming the install command; the caches are
configured. Each case runs in a fresh process (the backend is chosen before JAX starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from peagle_jax.platform import NEURON_PIP, plugin_installed


@pytest.fixture(autouse=True)
def _keep_the_run_s_caches():
    """Tests here call ``configure_caches(None, ...)`` in the test process, which turns JAX's compilation cache
    and the executables' store off: both are set back for the tests that follow in this process."""
    import jax

    from peagle_jax import executables

    enabled, store = jax.config.jax_enable_compilation_cache, executables.store()
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)
    if executables.store() != store:
        executables.configure(store)


def python(code: str, **env) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )


@pytest.mark.parametrize("platform,hint", [("neuron", NEURON_PIP), ("tpu", "jax[tpu]"), ("gpu", "jax[cuda12]")])
def test_missing_plugin_is_one_error_line(platform, hint):
    if plugin_installed(platform):
        pytest.skip(f"the {platform} plugin is installed here")
    r = subprocess.run(
        [sys.executable, "-m", "peagle_jax.generate", "--platform", platform, "--prompt-ids", "1,2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --platform {platform}") and hint in lines[0]


def test_cpu_selects_the_backend_and_the_compilation_cache(tmp_path):
    code = (
        "import json, jax\n"
        "from peagle_jax.platform import select_platform\n"
        f"devices = select_platform('cpu', compilation_cache={str(tmp_path / 'jc')!r})\n"
        "print(json.dumps([devices[0].platform, jax.config.jax_compilation_cache_dir]))"
    )
    r = python(code)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == ["cpu", str(tmp_path / "jc")]
    assert (tmp_path / "jc").is_dir()


def test_none_disables_a_cache_the_environment_names(tmp_path):
    """``--compilation-cache none`` compiles afresh even where ``$JAX_COMPILATION_CACHE_DIR`` names a cache
    (the test suite sets one, tests/conftest.py), which a process that does not select a cache writes to;
    a directory given is used instead."""
    code = (
        "import sys, jax, jax.numpy as jnp\n"
        "from peagle_jax.platform import select_platform\n"
        "if sys.argv[1] != 'unset':\n"
        "    select_platform('cpu', compilation_cache=None if sys.argv[1] == 'none' else sys.argv[1])\n"
        "jax.jit(lambda x: x * 3 + 1)(jnp.ones(5)).block_until_ready()\n"
    )
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "env"), "JAX_PLATFORMS": "cpu"}
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    written = {}
    for arg in ("none", str(tmp_path / "given"), "unset"):
        r = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        written[arg] = [p.name for p in (tmp_path / "env").glob("jit__lambda-*-cache")]
    assert written["none"] == written[str(tmp_path / "given")] == [] and len(written["unset"]) == 1
    assert len(list((tmp_path / "given").glob("jit__lambda-*-cache"))) == 1


def test_the_default_cache_is_the_one_the_environment_names(tmp_path, monkeypatch):
    """No ``--compilation-cache`` (or ``run.compilation_cache``): ``$JAX_COMPILATION_CACHE_DIR`` where set,
    else the cache root's ``jax-cache``; ``none`` is no cache and a path is itself."""
    from peagle_jax.platform import chosen_cache, default_cache_dir

    monkeypatch.setenv("PEAGLE_JAX_CACHE", str(tmp_path / "root"))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert chosen_cache(None) == chosen_cache("") == default_cache_dir() == tmp_path / "root" / "jax-cache"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "named"))
    assert chosen_cache(None) == chosen_cache("") == tmp_path / "named"
    assert chosen_cache("none") is None and chosen_cache(str(tmp_path / "given")) == tmp_path / "given"


def test_neuron_compile_cache_environment(tmp_path, monkeypatch):
    from peagle_jax.platform import configure_caches

    monkeypatch.setenv("PEAGLE_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL", raising=False)
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    configure_caches(None, "neuron")
    assert os.environ["NEURON_COMPILE_CACHE_URL"] == str(tmp_path / "neuron-cache")
    assert os.environ["NEURON_CC_FLAGS"] == f"--cache_dir={tmp_path / 'neuron-cache'}"
    # What the user set is kept.
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", "s3://bucket/cache")
    monkeypatch.setenv("NEURON_CC_FLAGS", "--model-type transformer")
    configure_caches(None, "neuron")
    assert os.environ["NEURON_COMPILE_CACHE_URL"] == "s3://bucket/cache"
    assert os.environ["NEURON_CC_FLAGS"] == "--model-type transformer"


def test_float32_runs_keep_float32_products_on_neuron():
    """--auto-cast=none for float32 (neuronx-cc's default before Neuron 2.27 cast float32 matrix products to
    bf16); bfloat16 and an unknown dtype keep the compiler's default; a user's --auto-cast is kept."""
    from peagle_jax.platform import neuron_cc_flags

    assert neuron_cc_flags(None, "/c", "float32") == "--cache_dir=/c --auto-cast=none"
    assert neuron_cc_flags(None, "/c", "bfloat16") == "--cache_dir=/c"
    assert neuron_cc_flags(None, "/c", None) == "--cache_dir=/c"
    assert neuron_cc_flags("--model-type transformer", "/c", "float32") == "--model-type transformer --auto-cast=none"
    assert neuron_cc_flags("", "/c", "float32") == "--auto-cast=none"
    for own in ("--auto-cast=matmult", "-O1 --auto-cast all", "--auto-cast none --auto-cast-type fp16"):
        assert neuron_cc_flags(own, "/c", "float32") == own
    assert neuron_cc_flags("--auto-cast-type tf32", "/c", "float32") == "--auto-cast-type tf32 --auto-cast=none"


def test_configure_caches_sets_the_precision_flags(tmp_path, monkeypatch, caplog):
    from peagle_jax.platform import configure_caches

    monkeypatch.setenv("PEAGLE_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL", raising=False)
    monkeypatch.delenv("NEURON_CC_FLAGS", raising=False)
    configure_caches(None, "neuron", "float32")
    assert os.environ["NEURON_CC_FLAGS"] == f"--cache_dir={tmp_path / 'neuron-cache'} --auto-cast=none"
    monkeypatch.delenv("NEURON_CC_FLAGS")
    configure_caches(None, "neuron", "bfloat16")
    assert os.environ["NEURON_CC_FLAGS"] == f"--cache_dir={tmp_path / 'neuron-cache'}"
    monkeypatch.setenv("NEURON_CC_FLAGS", "--auto-cast=matmult")
    configure_caches(None, "neuron", "float32")
    assert os.environ["NEURON_CC_FLAGS"] == "--auto-cast=matmult"
    assert "needs --auto-cast=none" in caplog.text
    monkeypatch.delenv("NEURON_CC_FLAGS")
    configure_caches(None, "cpu", "float32")
    assert "NEURON_CC_FLAGS" not in os.environ


def test_unknown_platform():
    from peagle_jax.errors import UserError
    from peagle_jax.platform import select_platform

    with pytest.raises(UserError, match="choose one of"):
        select_platform("ipu")


def test_static_graphs_forbids_branching_inside_and_nests():
    from peagle_jax.platform import branching_allowed, static_graphs

    assert branching_allowed()  # the CPU backend may branch
    with static_graphs():
        assert not branching_allowed()
        with static_graphs():
            assert not branching_allowed()
        assert not branching_allowed()  # leaving the inner one keeps the outer setting
    assert branching_allowed()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_and_serve_pass_their_dtype_to_the_platform(monkeypatch, dtype):
    """The Neuron compiler's casting follows the run's dtype: ``generate`` and ``serve`` hand theirs to
    :func:`peagle_jax.platform.select_platform` (stopped there, before anything loads)."""
    from peagle_jax import generate, platform
    from peagle_jax.errors import UserError
    from peagle_jax.serve import __main__ as serve

    seen = []

    def fake(name, *, compilation_cache=None, dtype=None):
        seen.append(dtype)
        raise UserError("stopped by the test")

    monkeypatch.setattr(platform, "select_platform", fake)
    assert generate.main(["--dtype", dtype, "--prompt", "x", "--compilation-cache", "none"]) == 2
    assert serve.main(["--dtype", dtype, "--warmup-only", "--compilation-cache", "none"]) == 2
    assert seen == [dtype, dtype]
