"""Random tiny PyTorch reference drafters from ``speculators``, shared by the parity tests.

Import it after ``pytest.importorskip("speculators")``.
"""

from __future__ import annotations

import torch
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig, Qwen3Config

V, H, U = 96, 32, 40  # target vocab, width, draft vocab


def layer_config(family: str, layers: int, kv_heads: int):
    """A tiny Llama or Qwen3 layer config with eager attention (CPU-friendly, dense masks)."""
    cls = LlamaConfig if family == "llama" else Qwen3Config
    cfg = cls(
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=8,
        vocab_size=V,
        max_position_embeddings=512,
    )
    cfg._attn_implementation = "eager"
    return cfg


def reference_drafter(kind: str, family: str, layers: int, kv_heads: int, seed: int, flags: dict, path):
    """A random speculators drafter (``peagle`` or ``eagle3``), saved to ``path``: non-trivial norm weights
    (so that a skipped norm shows), fan-in scaled matrices (activations of order one), a draft vocab."""
    torch.manual_seed(seed)
    common = dict(
        transformer_layer_config=layer_config(family, layers, kv_heads),
        draft_vocab_size=U,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm=kind,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=4)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=[]),
        ),
        **flags,
    )
    if kind == "peagle":
        model = PEagleDraftModel(PEagleSpeculatorConfig(mask_token_id=V - 1, **common))
    else:
        model = Eagle3DraftModel(Eagle3SpeculatorConfig(**common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif p.ndim == 2:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn_like(p))
        model.d2t.copy_(torch.randint(0, V - U, (U,)))
        model.t2d.zero_()
        model.t2d[torch.arange(U) + model.d2t] = True
    model.eval()
    model.save_pretrained(path)
    return model, path
