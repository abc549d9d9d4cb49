"""Run by tests/test_train_mesh.py in a fresh process with 8 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``): a sharded training step equals the single-device
step, and a checkpoint written on one mesh restores on another. Exits non-zero on any mismatch."""

from __future__ import annotations

import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.model import init_drafter_params
from peagle_jax.models.config import ModelConfig
from peagle_jax.train.cod import cod_batch, max_elements
from peagle_jax.train.config import TrainConfig
from peagle_jax.train.loop import (
    checkpoint_manager,
    init_train_state,
    loss_and_grad,
    partition,
    restore_state,
    save_state,
    train_step,
)
from peagle_jax.train.mesh import global_batch, make_mesh, place, replicated, sharded_train_step, state_shardings
from peagle_jax.train.objective import PEagleBatch

V, H, Ht, U, K, B, T = 128, 64, 32, 64, 4, 8, 16
LAYER = ModelConfig(
    family="llama",
    vocab_size=V,
    hidden_size=H,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
CFG = DrafterConfig(layer=LAYER, draft_vocab_size=U, target_hidden_size=Ht, mask_token_id=V - 1)
# Adam's eps well above the gradients' rounding differences (see the parameter check below)
TCFG = TrainConfig(lr=1e-3, warmup_steps=1, total_steps=10, save_every=1, eps=1e-4)


def close(a, b, what, tol=1e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    if not err <= tol * max(scale, 1.0):
        print(f"MISMATCH {what}: max abs diff {err:.3g} (scale {scale:.3g})")
        sys.exit(1)


def main():
    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(0)
    params = init_drafter_params(CFG, jax.random.key(0))
    params["d2t"] = jnp.asarray(rng.integers(0, V - U, U), jnp.int32)
    params["t2d"] = jnp.zeros((V,), bool).at[jnp.arange(U) + params["d2t"]].set(True)
    head = rng.standard_normal((U, Ht)).astype(np.float32)
    loss_mask = (rng.random((B, T)) < 0.8).astype(np.int32)
    batch = PEagleBatch(
        rng.integers(0, V - 1, (B, T)).astype(np.int32),
        rng.standard_normal((B, T, 3 * Ht)).astype(np.float32),
        rng.standard_normal((B, T, Ht)).astype(np.float32),
        loss_mask,
        np.zeros((B, T), np.int32),
        *cod_batch(loss_mask, max_elements(T, K), num_depths=K, rng=rng),
    )
    one = jax.tree.map(jnp.asarray, batch)

    # Loss and gradients: single device vs the (2, 4) mesh.
    trainable, frozen = partition(params, CFG)
    lg = jax.jit(lambda tr, fr, b, h: loss_and_grad(tr, fr, b, h, None, cfg=CFG, tcfg=TCFG, num_depths=K))
    (loss1, m1), g1 = lg(trainable, frozen, one, head)
    for data, fsdp in ((2, 4), (1, 8), (8, 1)):
        mesh = make_mesh(data, fsdp)
        sh = state_shardings(trainable, mesh)
        (loss8, m8), g8 = lg(
            place(trainable, sh), frozen, global_batch(batch, mesh), jax.device_put(head, replicated(mesh))
        )
        close(loss8, loss1, f"loss on mesh {data}x{fsdp}")
        for key in ("loss_sum_K", "correct_K", "count_K"):
            close(m8[key], m1[key], f"{key} on mesh {data}x{fsdp}")
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g8), jax.tree.leaves(g1), strict=True):
            close(a, b, f"grad {jax.tree_util.keystr(path)} on mesh {data}x{fsdp}")

    # Three optimizer steps: the sharded step keeps its shardings, compiles once, matches one device.
    mesh = make_mesh(2, 4)
    state1 = init_train_state(params, CFG, TCFG)
    shardings = state_shardings(state1, mesh)
    state8 = place(init_train_state(params, CFG, TCFG), shardings)
    assert any(len(s.spec) and "fsdp" in s.spec for s in jax.tree.leaves(shardings)), "nothing is fsdp-sharded"
    step8 = sharded_train_step(mesh, shardings, cfg=CFG, tcfg=TCFG, num_depths=K)
    for _ in range(3):
        state1, r1 = train_step(state1, one, head, cfg=CFG, tcfg=TCFG, num_depths=K)
        state8, r8 = step8(state8, global_batch(batch, mesh), jax.device_put(head, replicated(mesh)))
        close(r8["loss"], r1["loss"], "step loss")
    assert step8.jitted._cache_size() == 1, step8.jitted._cache_size()
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(state8.params), jax.tree.leaves(state1.params), strict=True
    ):
        # Adam divides each update by the root of its second moment plus eps, so a rounding difference d in
        # a gradient (the gradients above agree to ~3e-8; the order of a sum differs between meshes) moves an
        # update by up to lr * d / eps. With the default eps of 1e-8 that is a visible fraction of lr where a
        # gradient is near zero (seen: 5.4% of lr on an AVX2 machine, under 5% on AVX-512 ones); with eps
        # 1e-4 it is under 1e-3 lr, and parameters are compared to 1% of one step's size.
        close(a, b, f"param {jax.tree_util.keystr(path)} after 3 steps", tol=0.01 * TCFG.lr)

    # A checkpoint written on the (2, 4) mesh restores on (8, 1) and on one device, values intact.
    with tempfile.TemporaryDirectory() as tmp:
        manager = checkpoint_manager(tmp, TCFG)
        save_state(manager, state8, force=True)
        manager.wait_until_finished()
        for target_mesh in (make_mesh(8, 1), None):
            template = init_train_state(params, CFG, TCFG)
            if target_mesh is not None:
                template = place(template, state_shardings(template, target_mesh))
            restored = restore_state(manager, template)
            for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state8), strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            for a, t in zip(jax.tree.leaves(restored), jax.tree.leaves(template), strict=True):
                assert a.sharding.is_equivalent_to(t.sharding, a.ndim), (a.sharding, t.sharding)
    print("OK")


if __name__ == "__main__":
    main()
