"""Parity of our drafter with the PyTorch reference drafters of the ``speculators`` package.

speculators' own forward passes are run (P-EAGLE's training forward with chosen sampling indices, EAGLE-3's
test-time-training forward), with eager attention, and the logits are captured at their LM head. Our side
loads the checkpoint speculators saved.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

speculators = pytest.importorskip("speculators", reason="install with: pip install --no-deps speculators==0.9.0")

from speculators.losses import resolve_loss_config  # noqa: E402
from speculators_ref import H, V, reference_drafter  # noqa: E402

from peagle_jax.drafter.draft import DraftContext, drafter_forward, fuse_aux, fused_mask_hidden, parallel_draft  # noqa: E402
from peagle_jax.drafter.load import load_drafter  # noqa: E402
from peagle_jax.drafter.model import new_drafter_cache  # noqa: E402

CASES = [
    # id, layer family, layers, kv heads, seed, flags
    ("llama-1L-gqa", "llama", 1, 2, 0, {}),
    ("llama-3L-gqa-normfc", "llama", 3, 2, 1, {"norm_before_fc": True}),
    ("llama-1L-mha-fcnorm", "llama", 1, 4, 2, {"fc_norm": True}),
    ("llama-3L-resid-out", "llama", 3, 1, 3, {"norm_before_residual": True, "norm_output": True}),
    ("qwen3-1L", "qwen3", 1, 2, 4, {}),
    ("qwen3-3L-all", "qwen3", 3, 2, 5, {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}),
]


def _reference(kind, family, layers, kv_heads, seed, flags, tmp_path):
    return reference_drafter(kind, family, layers, kv_heads, seed, flags, tmp_path / kind)


def _capture_lm_head(model):
    captured = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().numpy().copy()))
    return captured


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_parallel_layout_logits_match_speculators(case, tmp_path, monkeypatch):
    _, family, layers, kv_heads, seed, flags = case
    model, path = _reference("peagle", family, layers, kv_heads, seed, flags, tmp_path)
    n, K = 6, 4  # 6 context elements, then K-1 mask elements anchored at the last one
    rng = np.random.RandomState(seed)
    ids = torch.tensor(rng.randint(0, V - 1, (1, n + K - 1)))
    aux = torch.tensor(rng.randn(1, n + K - 1, 3 * H).astype(np.float32))
    anchor = torch.tensor(list(range(n)) + [n - 1] * (K - 1))
    depth = torch.tensor([0] * n + list(range(1, K)))
    monkeypatch.setattr("speculators.models.peagle.core.generate_cod_sample_indices", lambda **_: (anchor, depth))
    captured = _capture_lm_head(model)
    with torch.no_grad():
        model(
            hidden_states=aux,
            input_ids=ids,
            document_ids=torch.zeros_like(ids),
            verifier_last_hidden_states=torch.randn(1, n + K - 1, H),
            loss_config=resolve_loss_config("kl_div", "eager"),
            num_depths=K,
        )
    ref = captured[0][0]  # [n + K - 1, U]

    cfg, params = load_drafter(path)
    mask_g = fused_mask_hidden(params, cfg=cfg)
    g = fuse_aux(params, jnp.asarray(aux.numpy()[:, :n]), cfg=cfg)
    tokens = jnp.concatenate([jnp.asarray(ids.numpy()[:, :n]), jnp.full((1, K - 1), cfg.mask_token_id)], axis=1)
    g = jnp.concatenate([g, jnp.broadcast_to(mask_g, (1, K - 1, H))], axis=1)
    out, _ = drafter_forward(params, new_drafter_cache(cfg, 1, 16), tokens, g, jnp.zeros(1, jnp.int32), cfg=cfg)
    np.testing.assert_allclose(np.asarray(out.logits[0]), ref, atol=1e-4, rtol=0)

    # The fixed-window graph gives the same K depths as log-probabilities.
    draft, _ = parallel_draft(
        params,
        new_drafter_cache(cfg, 1, 16),
        DraftContext(
            jnp.asarray(ids.numpy()[:, :n]),
            jnp.asarray(aux.numpy()[:, :n]),
            jnp.array([n], jnp.int32),
            jnp.zeros(1, jnp.int32),
        ),
        mask_g,
        cfg=cfg,
        K=K,
        top_n=1,
    )
    ref_lp = torch.log_softmax(torch.tensor(ref[n - 1 :]), dim=-1).numpy()
    best = ref_lp.argmax(-1)
    np.testing.assert_array_equal(np.asarray(draft.tokens[0, :, 0]), best + model.d2t.numpy()[best])
    np.testing.assert_allclose(np.asarray(draft.logprobs[0, :, 0]), ref_lp.max(-1), atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sequential_ttt_logits_match_speculators(case, tmp_path):
    """EAGLE-3's training-time test: step k at row i is the k-th sequential draft pass from anchor i, fed
    the teacher-forced token and the previous step's hidden state. Our step-by-step drafter forward from
    anchor i must give the same logits."""
    _, family, layers, kv_heads, seed, flags = case
    model, path = _reference("eagle3", family, layers, kv_heads, seed, flags, tmp_path)
    n, steps = 7, 3
    rng = np.random.RandomState(seed + 100)
    ids = torch.tensor(rng.randint(0, V, (1, n)))
    aux = torch.tensor(rng.randn(1, n, 3 * H).astype(np.float32))
    model.embed_tokens.weight.data.normal_()  # EAGLE-3 checkpoints may omit it; here it is saved
    model.save_pretrained(path)
    captured = _capture_lm_head(model)
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=steps)
    cfg, params = load_drafter(path)
    ids_np = ids.numpy()
    for anchor in (2, n - steps):
        cache = new_drafter_cache(cfg, 1, 32)
        g = fuse_aux(params, jnp.asarray(aux.numpy()[:, : anchor + 1]), cfg=cfg)
        out, cache = drafter_forward(
            params, cache, jnp.asarray(ids_np[:, : anchor + 1]), g, jnp.zeros(1, jnp.int32), cfg=cfg
        )
        np.testing.assert_allclose(np.asarray(out.logits[0, anchor]), captured[0][0, anchor], atol=1e-4, rtol=0)
        hidden = out.hidden[:, anchor : anchor + 1]
        for k in range(1, steps):
            token = jnp.asarray(ids_np[:, anchor + k : anchor + k + 1])  # teacher forcing, as in TTT
            out, cache = drafter_forward(params, cache, token, hidden, jnp.full(1, anchor + k, jnp.int32), cfg=cfg)
            np.testing.assert_allclose(np.asarray(out.logits[0, 0]), captured[k][0, anchor], atol=1e-4, rtol=0)
            hidden = out.hidden
