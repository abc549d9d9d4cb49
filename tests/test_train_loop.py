"""The training loop: overfitting in fp32 and bf16 compute, frozen leaves, the schedule, one compile,
exact resume from an orbax checkpoint, metrics lines and the YAML run config."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.model import init_drafter_params
from peagle_jax.models.config import ConfigError, ModelConfig
from peagle_jax.train.cod import cod_batch, max_elements
from peagle_jax.train.config import TrainConfig, load_config
from peagle_jax.train.loop import (
    checkpoint_manager,
    init_train_state,
    lr_schedule,
    partition,
    restore_state,
    train_loop,
    train_step,
)
from peagle_jax.train.objective import PEagleBatch

V, H, Ht, U, K, B, T = 97, 32, 24, 40, 4, 2, 16
E = max_elements(T, K)
LAYER = ModelConfig(
    family="llama",
    vocab_size=V,
    hidden_size=H,
    intermediate_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
CFG = DrafterConfig(layer=LAYER, draft_vocab_size=U, target_hidden_size=Ht, mask_token_id=V - 1)
TCFG = TrainConfig(lr=3e-3, warmup_steps=3, total_steps=100, weight_decay=0.01, clip_norm=1.0, save_every=1)


def _params(seed=0):
    p = init_drafter_params(CFG, jax.random.key(seed))
    p["d2t"] = jnp.asarray(np.random.default_rng(seed).integers(0, V - U, U), jnp.int32)
    p["t2d"] = jnp.zeros((V,), bool).at[jnp.arange(U) + p["d2t"]].set(True)
    return p


def _head():
    return jnp.asarray(np.random.default_rng(1).standard_normal((U, Ht)).astype(np.float32))


def _batch(pos: int) -> PEagleBatch:
    """The batch for data position ``pos``: a pure function of it, as a resumable loader must be."""
    rng = np.random.default_rng((7, pos))
    loss_mask = np.ones((B, T), np.int32)
    loss_mask[:, :3] = 0
    docs = np.zeros((B, T), np.int32)
    docs[1, 10:] = 1
    elements = cod_batch(loss_mask, E, num_depths=K, rng=rng)
    batch = PEagleBatch(
        rng.integers(0, V - 1, (B, T)).astype(np.int32),
        rng.standard_normal((B, T, 3 * Ht)).astype(np.float32),
        rng.standard_normal((B, T, Ht)).astype(np.float32),
        loss_mask,
        docs,
        *elements,
    )
    return jax.tree.map(jnp.asarray, batch)


def _run(state, steps, tcfg=TCFG, fixed=False, **kw):
    batch_at = (lambda _: _batch(0)) if fixed else _batch
    return train_loop(state, batch_at, _head(), cfg=CFG, tcfg=tcfg, num_depths=K, num_steps=steps, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_overfits_a_fixed_batch(dtype):
    tcfg = TCFG.replace(compute_dtype=dtype)
    state, records = _run(init_train_state(_params(), CFG, tcfg), 30, tcfg, fixed=True)
    losses = [r["loss"] for r in records]
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.5 * losses[0], losses
    # Masters and optimizer moments stay fp32 whatever the compute dtype.
    trainable, _ = partition(state.params, CFG)
    assert {x.dtype for x in jax.tree.leaves(trainable)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim} == {jnp.dtype(jnp.float32)}
    assert int(state.step) == 30 and int(state.data_pos) == 30
    r = records[-1]
    assert len(r["acc_K"]) == K and all(a is not None and 0 <= a <= 1 for a in r["acc_K"])


def test_bf16_compute_runs_in_bf16_close_to_fp32():
    losses, norms = [], []
    for dtype in ("float32", "bfloat16"):
        tcfg = TCFG.replace(compute_dtype=dtype)  # the configs of the test above: no new compile
        _, m = train_step(init_train_state(_params(), CFG, tcfg), _batch(0), _head(), cfg=CFG, tcfg=tcfg, num_depths=K)
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
    assert losses[0] != losses[1]  # the forward really ran in bf16
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-2)
    np.testing.assert_allclose(norms[1], norms[0], rtol=5e-2)


@pytest.mark.parametrize("embed_requires_grad", [True, False])
def test_frozen_leaves_are_not_updated(embed_requires_grad):
    cfg = CFG.replace(embed_requires_grad=embed_requires_grad)
    params = _params()
    trainable, frozen = partition(params, cfg)
    assert set(frozen) == {"d2t", "t2d"} | ({"embed_tokens"} if not embed_requires_grad else set())
    state = init_train_state(params, cfg, TCFG)
    for pos in range(3):
        state, _ = train_step(state, _batch(pos), _head(), cfg=cfg, tcfg=TCFG, num_depths=K)
    for key in frozen:
        np.testing.assert_array_equal(np.asarray(state.params[key]), np.asarray(params[key]))
        assert state.params[key].dtype == params[key].dtype
    for key in ("fc", "mask_hidden", "lm_head"):
        before, after = jax.tree.leaves(params[key]), jax.tree.leaves(state.params[key])
        assert any(not np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_lr_schedule():
    tcfg = TrainConfig(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    sched = lr_schedule(tcfg)
    assert float(sched(0)) == 0.0
    np.testing.assert_allclose(float(sched(5)), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(float(sched(10)), 1e-3, rtol=1e-6)
    np.testing.assert_allclose(float(sched(60)), 0.55e-3, rtol=1e-5)  # half way down the cosine
    np.testing.assert_allclose(float(sched(110)), 1e-4, rtol=1e-6)
    np.testing.assert_allclose(float(sched(500)), 1e-4, rtol=1e-6)
    # The step reports the rate it used.
    state = init_train_state(_params(), CFG, tcfg)
    rates = []
    for pos in range(3):
        state, m = train_step(state, _batch(pos), _head(), cfg=CFG, tcfg=tcfg, num_depths=K)
        rates.append(float(m["lr"]))
    np.testing.assert_allclose(rates, [0.0, 1e-4, 2e-4], rtol=1e-6)


def test_one_compile_across_steps():
    tcfg = TCFG.replace(seed=11)  # a config no other test uses: a fresh cache entry
    state = init_train_state(_params(), CFG, tcfg)
    state, _ = train_step(state, _batch(0), _head(), cfg=CFG, tcfg=tcfg, num_depths=K)
    size = train_step._cache_size()
    for pos in range(1, 5):
        state, _ = train_step(state, _batch(pos), _head(), cfg=CFG, tcfg=tcfg, num_depths=K)
    assert train_step._cache_size() == size


def test_resume_is_exact(tmp_path):
    N = 3
    tcfg = TCFG.replace(keep_last=2)
    full, full_records = _run(init_train_state(_params(), CFG, tcfg), 2 * N, tcfg)

    metrics_path = tmp_path / "metrics.jsonl"
    manager = checkpoint_manager(tmp_path / "ckpt", tcfg)
    first, _ = _run(init_train_state(_params(), CFG, tcfg), N, tcfg, manager=manager, metrics_path=metrics_path)
    manager.close()
    assert sorted(checkpoint_manager(tmp_path / "ckpt", tcfg).all_steps()) == [N - 1, N]  # keep_last

    # A fresh, process-like restore: new manager, new template state from other random params.
    manager = checkpoint_manager(tmp_path / "ckpt", tcfg)
    restored = restore_state(manager, init_train_state(_params(seed=5), CFG, tcfg))
    assert int(restored.step) == N and int(restored.data_pos) == N
    np.testing.assert_array_equal(np.asarray(restored.rng), np.asarray(first.rng))
    resumed, resumed_records = _run(restored, N, tcfg, manager=manager, metrics_path=metrics_path)
    manager.close()

    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-7)
    assert [r["loss"] for r in resumed_records] == [r["loss"] for r in full_records[N:]]

    lines = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(2 * N))
    assert [r["loss"] for r in lines] == [r["loss"] for r in full_records]
    assert set(lines[0]) >= {"loss", "lr", "grad_norm", "loss_K", "acc_K", "count_K"}


def test_load_config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 6e-4\nwarmup_steps: 50\ncompute_dtype: bfloat16\n")
    cfg = load_config(path, ["total_steps=2000", "lr=1.0e-4", "keep_last=5"])
    assert cfg == TrainConfig(lr=1e-4, warmup_steps=50, total_steps=2000, compute_dtype="bfloat16", keep_last=5)
    assert load_config(path).lr == 6e-4  # YAML 1.1 reads 6e-4 as a string; the float field takes it
    assert load_config(None, ["seed=3"]) == TrainConfig(seed=3)
    hash(cfg)  # static argument of the jitted step

    with pytest.raises(ConfigError, match="unknown key.*learning_rate.*known keys: .*lr"):
        load_config(path, ["learning_rate=1e-3"])
    path.write_text("lr: 1e-3\nbatchsize: 4\n")
    with pytest.raises(ConfigError, match="unknown key.*batchsize"):
        load_config(path)
    with pytest.raises(ConfigError, match="warmup_steps expects a int, got 'ten'"):
        load_config(None, ["warmup_steps=ten"])
    with pytest.raises(ConfigError, match="compute_dtype='float16' must be one of float32, bfloat16"):
        load_config(None, ["compute_dtype=float16"])
    with pytest.raises(ConfigError, match="total_steps=10 must be > warmup_steps"):
        load_config(None, ["total_steps=10", "warmup_steps=10"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(None, ["lr"])
    path.write_text("- lr\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(path)
