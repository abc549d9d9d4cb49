"""The executable store (:mod:`peagle_jax.executables`): a second process (here: the same process with its
in-memory executables dropped) loads every decoding graph from the store and traces none, and decodes the
same tokens as ``jax.jit`` without a store; keys separate what must be separate; a store that cannot be read
or written costs a compile, never an error."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peagle_jax import executables
from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.model import init_drafter_params
from peagle_jax.engine.generator import Generator
from peagle_jax.models import model as M
from peagle_jax.models.config import ModelConfig
from peagle_jax.platform import static_graphs
from peagle_jax.spec.generator import SpeculativeGenerator
from peagle_jax.spec.tree import parse_tree

CFG = ModelConfig(
    family="llama", vocab_size=6, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=8,
)  # fmt: skip
DCFG = DrafterConfig(
    layer=CFG.replace(num_layers=1, aux_layer_ids=(0,)), algorithm="peagle", mask_token_id=5, own_embedding=False
)
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 0, 1, 2], [3, 4, 1]]
SAMPLING = dict(temperature=[0.0, 1.1], top_k=[0, 4], seed=[3, 4])


_TRACES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _secs, **_: (
        _TRACES.append(event) if event.endswith(("jaxpr_trace_duration", "mlir_module_duration")) else None
    )
)


@pytest.fixture(scope="module")
def models():
    def scaled(tree):
        return jax.tree.map(lambda x: x * 30 if x.dtype == jnp.float32 and x.ndim > 1 else x, tree)

    return scaled(M.init_params(CFG, jax.random.key(1))), scaled(init_drafter_params(DCFG, jax.random.key(2)))


@pytest.fixture
def store(tmp_path):
    executables.configure(tmp_path / "executables")
    yield tmp_path / "executables"
    executables.configure(None)


def _decode(models, tree):
    params, dparams = models
    gen = SpeculativeGenerator(CFG, params, DCFG, dparams, tree=parse_tree(tree), max_seq_len=64)
    spec = gen.generate(PROMPTS, max_new_tokens=16, stop_token_ids=[], **SAMPLING)
    plain = Generator(CFG, params, max_seq_len=64).generate(PROMPTS, max_new_tokens=16, stop_token_ids=[], **SAMPLING)
    return [r.token_ids for r in spec], [r.token_ids for r in plain]


def test_a_restart_loads_every_graph_and_decodes_the_same_tokens(models, store):
    executables.configure(None)
    without = _decode(models, "0,1,00")
    assert without[0] == without[1]  # speculative == plain, the reference for what follows
    executables.configure(store)
    assert _decode(models, "0,1,00") == without
    first = executables.counts()
    files = sorted(p.name for p in store.rglob("*.jexec"))
    assert first["loaded"] == 0 and first["compiled"] == len(files) > 5, (first, files)
    assert any(f.startswith("verify-") for f in files) and any(f.startswith("prefill-") for f in files)

    executables.clear()  # as a new process: nothing in memory, the files on disk
    _TRACES.clear()
    assert _decode(models, "0,1,00") == without
    assert executables.counts() == {"loaded": len(files), "compiled": 0}
    assert sorted(p.name for p in store.rglob("*.jexec")) == files
    assert _TRACES == []  # no graph traced or lowered


def test_keys_separate_statics_shapes_and_fingerprints(store, monkeypatch):
    x = np.arange(8, dtype=np.float32)

    @executables.jit
    def double(v):
        return v * 2

    scale = executables.jit(lambda v, *, s: v * s, static_argnames=("s",))
    np.testing.assert_array_equal(double(x), x * 2)
    np.testing.assert_array_equal(double(x[:4]), x[:4] * 2)  # another shape
    np.testing.assert_array_equal(double(x.astype(np.int32)), x * 2)  # another dtype
    np.testing.assert_array_equal(double(jnp.asarray(x)), x * 2)  # a device array: its sharding is in the key
    np.testing.assert_array_equal(scale(x, s=3), x * 3)
    np.testing.assert_array_equal(scale(x, s=4), x * 4)  # another static value
    assert executables.counts() == {"loaded": 0, "compiled": 6}
    assert len(list(store.rglob("*.jexec"))) == 6
    executables.clear()
    np.testing.assert_array_equal(scale(x, s=4), x * 4)
    assert executables.counts() == {"loaded": 1, "compiled": 0}
    # Another package source, jax version or device set: nothing found, compiled and stored apart.
    executables.clear()
    monkeypatch.setattr(executables, "_fingerprint", "another process")
    np.testing.assert_array_equal(scale(x, s=4), x * 4)
    assert executables.counts() == {"loaded": 0, "compiled": 1} and len(list(store.rglob("*.jexec"))) == 7


def test_other_fingerprints_folders_are_pruned(store):
    for age, name in enumerate(["a", "b", "c", "d"]):  # "a" the newest
        (store / name).mkdir()
        (store / name / "x.jexec").write_bytes(b"")
        os.utime(store / name, (1e9 - age, 1e9 - age))
    executables.jit(lambda v: v - 1)(np.ones(2, np.float32))
    kept = sorted(p.name for p in store.iterdir())
    assert kept == sorted(["a", "b", executables.fingerprint()[:24]]) and executables.KEEP == 3


def test_inside_a_trace_and_without_a_store_it_is_jax_jit(store, tmp_path):
    inner = executables.jit(lambda v: v + 1)
    outer = jax.jit(lambda v: inner(v) * 2)
    np.testing.assert_array_equal(outer(np.ones(3, np.float32)), np.full(3, 4.0))
    assert executables.counts()["compiled"] == 0 and not list(store.rglob("*.jexec"))  # inlined into outer's graph
    with static_graphs():  # branch-free graphs are not told apart by the key: jax.jit's own
        np.testing.assert_array_equal(inner(np.ones(3, np.float32)), np.full(3, 2.0))
    assert executables.counts()["compiled"] == 0 and not list(store.rglob("*.jexec"))
    executables.configure(None)
    np.testing.assert_array_equal(inner(np.ones(3, np.float32)), np.full(3, 2.0))
    assert inner._cache_size() == 1 and executables.counts()["compiled"] == 0


def test_donation_holds_through_a_loaded_executable(store):
    step = executables.jit(lambda c, v: c + v, donate_argnums=0)
    c = jnp.zeros(4)
    c = step(c, jnp.ones(4))
    executables.clear()
    old = c
    c = step(c, jnp.ones(4))
    assert executables.counts()["loaded"] == 1 and old.is_deleted()
    np.testing.assert_array_equal(c, np.full(4, 2.0))


def test_an_unreadable_or_unwritable_store_costs_a_compile(store, caplog):
    triple = executables.jit(lambda v: v * 3)
    x = np.arange(4, dtype=np.float32)
    triple(x)
    (path,) = store.rglob("*.jexec")
    path.write_bytes(path.read_bytes()[:100])  # cut short
    executables.clear()
    with caplog.at_level(logging.WARNING, "peagle_jax.executables"):
        np.testing.assert_array_equal(triple(x), x * 3)
    assert "unreadable" in caplog.text and executables.counts() == {"loaded": 0, "compiled": 1}
    executables.clear()
    np.testing.assert_array_equal(triple(x), x * 3)  # rewritten whole
    assert executables.counts() == {"loaded": 1, "compiled": 0}

    shutil.rmtree(store)
    store.write_text("")  # the store's folder is a file now: every write fails, whoever runs this
    executables.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, "peagle_jax.executables"):
        np.testing.assert_array_equal(triple(x), x * 3)
        np.testing.assert_array_equal(triple(x), x * 3)  # held in memory: one compile, one warning
    assert caplog.text.count("could not write") == 1 and executables.counts() == {"loaded": 0, "compiled": 1}


AFRESH = """
import json, pathlib, sys
import jax, jax.numpy as jnp, numpy as np
from peagle_jax import executables
from peagle_jax.platform import select_platform

select_platform("cpu", compilation_cache=sys.argv[1])


def gather_matmul(table, idx):
    return jnp.tanh(table[idx] @ table.T).sum(-1)


table, idx = np.random.default_rng(0).random((64, 32), dtype=np.float32), np.array([3, 5, 7], np.int32)
jax.jit(lambda v: v + 1)(1.0)  # JAX's cache in use before the stored graph compiles, as in a server
if sys.argv[2] == "jit":
    fn = jax.jit(gather_matmul)
else:
    jax.jit(gather_matmul)(table, idx)  # the graph as JAX's cache loaded it, held in this process too
    fn = executables.jit(gather_matmul)
    if sys.argv[2] == "store twice":  # compiled, its file lost, compiled again in the same process
        fn(table, idx)
        for path in pathlib.Path(sys.argv[1], "executables").rglob("*.jexec"):
            path.unlink()
        executables.clear()
print(json.dumps({"out": np.asarray(fn(table, idx)).tolist(), **executables.counts()}))
"""


def test_the_store_compiles_afresh_beside_jax_cache(tmp_path):
    """XLA:CPU serializes an executable that JAX's persistent cache loaded without all of its code: stored
    and loaded by the next process, it failed to run or computed wrong values. So the store's compiles
    neither read JAX's caches (persistent and in-process) nor write the persistent one. Processes: plain
    ``jax.jit`` fills JAX's cache; the store compiles the same graph (JAX's executable of it held in the
    process); the next loads it; with the store lost, one compiles it twice (its file lost in between); the
    next loads that."""
    (tmp_path / "afresh.py").write_text(AFRESH)
    cache = tmp_path / "cache"

    def run(kind):
        cmd = [sys.executable, str(tmp_path / "afresh.py"), str(cache), kind]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": ""})
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.splitlines()[-1])

    def jax_entries():
        return sorted(p.name for p in cache.iterdir() if p.name != "executables")

    want = run("jit")["out"]
    entries = jax_entries()
    assert len(entries) >= 2  # the two graphs of the run above
    assert run("store") == {"out": want, "loaded": 0, "compiled": 1}
    assert jax_entries() == entries  # the store's compile left nothing in JAX's cache
    assert run("store") == {"out": want, "loaded": 1, "compiled": 0}
    shutil.rmtree(cache / "executables")  # the store lost: compiled again, where JAX's cache has the graph
    assert run("store twice") == {"out": want, "loaded": 0, "compiled": 1}
    assert run("store") == {"out": want, "loaded": 1, "compiled": 0}


def test_loading_ahead_hands_calls_their_executables(store):
    with pytest.raises(ValueError, match="one per definition"):  # they would share their files
        [executables.jit(lambda v, k=k: v * k) for k in range(2)]
    fns = [
        executables.jit(lambda v: v * 0),
        executables.jit(lambda v: v * 1),
        executables.jit(lambda v: v * 2),
        executables.jit(lambda v: v * 3),
    ]  # fmt: skip
    x = np.arange(3, dtype=np.float32)
    for f in fns:
        f(x)
    executables.clear()
    executables.load_ahead()
    for _ in range(200):  # the thread loads the four files, oldest first
        if len(executables._ahead) == 4 and all(f.done() for f in executables._ahead.values()):
            break
        time.sleep(0.05)
    assert len(executables._ahead) == 4
    np.testing.assert_array_equal(fns[2](x), x * 2)  # taken from what was loaded ahead
    assert len(executables._ahead) == 3 and executables.counts() == {"loaded": 1, "compiled": 0}
    executables.stop_ahead()  # nothing more is loaded; what is loaded still goes to its call
    np.testing.assert_array_equal(fns[1](x), x * 1)
    assert len(executables._ahead) == 2
    executables.drop_ahead()  # the rest is dropped; a later call reads its file
    assert not executables._ahead
    np.testing.assert_array_equal(fns[3](x), x * 3)
    assert executables.counts() == {"loaded": 3, "compiled": 0}
