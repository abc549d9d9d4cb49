"""Drafter configuration, read from and written back to the two PyTorch checkpoint layouts.

- speculators format (what vLLM loads): ``speculators_model_type`` ``peagle`` or ``eagle3``, a nested
  ``transformer_layer_config`` (Llama or Qwen3, ``num_hidden_layers`` = drafter layers), the drafter flags
  and a ``speculators_config`` with proposal methods and verifier;
- EAGLE / AWS layout: one flat Llama config (``LlamaForCausalLMEagle3``) with ``draft_vocab_size`` and the
  mask token as ``ptd_token_id``.

The mask token id is read from ``mask_token_id``, ``ptd_token_id`` or ``pard_token``, whichever is set.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from peagle_jax.models.config import ConfigError, ModelConfig, RopeConfig
from peagle_jax.models.hf_config import from_hf_config, to_hf_config

ALGORITHMS = ("peagle", "eagle3")
MASK_TOKEN_KEYS = ("mask_token_id", "ptd_token_id", "pard_token")
SPECULATORS_ARCHITECTURES = {"peagle": "PEagleDraftModel", "eagle3": "Eagle3DraftModel"}
EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle3"
_DRAFTER_KEYS = {
    "draft_vocab_size",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
    "eagle_aux_hidden_state_layer_ids",
    "target_hidden_size",
    "embed_requires_grad",
    "speculative_tokens",
    *MASK_TOKEN_KEYS,
}


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Static, hashable drafter architecture.

    ``layer`` describes the decoder layers (family, width D, heads, RoPE; ``vocab_size`` is the target
    vocabulary V). The drafter reads A = ``num_aux`` target hidden states of width ``target_hidden_size``
    (X = A * that, concatenated), fuses them with ``fc`` into D, and predicts over ``draft_vocab_size`` (U)
    ids, mapped to target ids by ``d2t`` when ``U < V``. ``own_embedding`` is False when the checkpoint shares
    the target's table.
    """

    layer: ModelConfig
    algorithm: str = "peagle"
    draft_vocab_size: int = 0
    target_hidden_size: int = 0
    num_aux: int = 3
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    mask_token_id: int | None = None
    own_embedding: bool = True
    embed_requires_grad: bool = True
    speculative_tokens: int = 7
    verifier_name_or_path: str | None = None
    verifier_architectures: tuple[str, ...] = ()
    # The checkpoint carries ``d2t`` / ``t2d`` although the draft vocabulary is the whole target vocabulary
    # (the released GPT-OSS P-EAGLE drafters: an identity map), so that conversion writes them back.
    full_vocab_map: bool = False

    def __post_init__(self):
        lc = self.layer
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"unknown drafter algorithm {self.algorithm!r}; supported: {', '.join(ALGORITHMS)}")
        if lc.family not in ("llama", "qwen3"):
            raise ConfigError(f"drafter layers of type {lc.family!r} are not supported (llama or qwen3)")
        if not self.draft_vocab_size:
            object.__setattr__(self, "draft_vocab_size", lc.vocab_size)
        if not self.target_hidden_size:
            object.__setattr__(self, "target_hidden_size", lc.hidden_size)
        if self.aux_layer_ids is not None and len(self.aux_layer_ids) != self.num_aux:
            object.__setattr__(self, "num_aux", len(self.aux_layer_ids))
        if not 0 < self.draft_vocab_size <= lc.vocab_size:
            raise ConfigError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size ({lc.vocab_size})")
        if self.norm_before_fc and self.fc_norm:
            raise ConfigError("norm_before_fc and fc_norm are mutually exclusive")
        if self.algorithm == "peagle":
            if self.mask_token_id is None:
                raise ConfigError(f"a parallel (P-EAGLE) drafter needs a mask token id ({' / '.join(MASK_TOKEN_KEYS)})")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < lc.vocab_size:
            raise ConfigError(f"mask token id {self.mask_token_id} is outside the vocabulary 0..{lc.vocab_size - 1}")
        if self.speculative_tokens < 1:
            raise ConfigError(f"speculative_tokens must be >= 1, got {self.speculative_tokens}")

    @property
    def parallel(self) -> bool:
        return self.algorithm == "peagle"

    @property
    def has_vocab_map(self) -> bool:
        """Whether ``d2t`` / ``t2d`` exist: when U < V, and when a checkpoint with U == V carries them
        (:attr:`full_vocab_map`; speculators omits them then)."""
        return self.draft_vocab_size != self.layer.vocab_size or self.full_vocab_map

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    def replace(self, **changes) -> DrafterConfig:
        return dataclasses.replace(self, **changes)


def _mask_token(d: dict[str, Any]) -> int | None:
    for key in MASK_TOKEN_KEYS:
        if d.get(key) is not None:
            return int(d[key])
    return None


def _layer_config(hf: dict[str, Any], dtype: str) -> ModelConfig:
    hf = {k: v for k, v in hf.items() if k not in _DRAFTER_KEYS and k not in ("eagle_config", "speculators_config")}
    hf.pop("architectures", None)
    return from_hf_config(hf, dtype=dtype, aux_layer_ids=(0,))


def from_speculators_config(d: dict[str, Any], *, dtype: str = "float32") -> DrafterConfig:
    """A speculators ``config.json`` dict (``speculators_model_type`` peagle or eagle3)."""
    algorithm = d.get("speculators_model_type")
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"speculators_model_type {algorithm!r} is not supported; supported: {', '.join(ALGORITHMS)}")
    if not isinstance(d.get("transformer_layer_config"), dict):
        raise ConfigError("a speculators config needs a transformer_layer_config object")
    layer = _layer_config(d["transformer_layer_config"], dtype)
    spec = d.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    default = spec.get("default_proposal_method")
    method = next((m for m in methods if m.get("proposal_type") == default), methods[0])
    verifier = spec.get("verifier") or {}
    aux = d.get("eagle_aux_hidden_state_layer_ids")
    return DrafterConfig(
        layer=layer,
        algorithm=algorithm,
        draft_vocab_size=int(d.get("draft_vocab_size") or layer.vocab_size),
        target_hidden_size=int(d.get("target_hidden_size") or layer.hidden_size),
        aux_layer_ids=tuple(int(j) for j in aux) if aux else None,
        norm_before_residual=bool(d.get("norm_before_residual", False)),
        norm_before_fc=bool(d.get("norm_before_fc", False)),
        fc_norm=bool(d.get("fc_norm", False)),
        norm_output=bool(d.get("norm_output", False)),
        mask_token_id=_mask_token(d),
        embed_requires_grad=bool(d.get("embed_requires_grad", algorithm == "peagle")),
        speculative_tokens=int(method.get("speculative_tokens", 7)),
        verifier_name_or_path=verifier.get("name_or_path"),
        verifier_architectures=tuple(verifier.get("architectures") or ()),
    )


def to_speculators_config(cfg: DrafterConfig) -> dict[str, Any]:
    """The speculators ``config.json`` dict for ``cfg`` (loadable by speculators and vLLM)."""
    layer = to_hf_config(cfg.layer)
    layer.pop("eagle_aux_hidden_state_layer_ids", None)
    layer.pop("architectures", None)
    d: dict[str, Any] = {
        "architectures": [SPECULATORS_ARCHITECTURES[cfg.algorithm]],
        "speculators_model_type": cfg.algorithm,
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids) if cfg.aux_layer_ids else None,
        "target_hidden_size": cfg.target_hidden_size if cfg.target_hidden_size != cfg.hidden_size else None,
        "embed_requires_grad": cfg.embed_requires_grad,
        "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": cfg.algorithm,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": cfg.speculative_tokens,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"name_or_path": cfg.verifier_name_or_path, "architectures": list(cfg.verifier_architectures)},
        },
    }
    if cfg.parallel or cfg.mask_token_id is not None:
        d["mask_token_id"] = cfg.mask_token_id
    return d


def from_eagle_config(d: dict[str, Any], *, dtype: str = "float32") -> DrafterConfig:
    """An EAGLE reference / AWS flat Llama config (``LlamaForCausalLMEagle3``); P-EAGLE when it names a mask
    token (``ptd_token_id``), EAGLE-3 otherwise."""
    layer = _layer_config(d, dtype)
    eagle = d.get("eagle_config") or {}
    aux = d.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    mask = _mask_token(d)
    return DrafterConfig(
        layer=layer,
        algorithm="peagle" if mask is not None else "eagle3",
        draft_vocab_size=int(d.get("draft_vocab_size") or layer.vocab_size),
        target_hidden_size=int(d.get("target_hidden_size") or layer.hidden_size),
        aux_layer_ids=tuple(int(j) for j in aux) if aux else None,
        norm_before_residual=bool(d.get("norm_before_residual", False)),
        norm_before_fc=bool(d.get("norm_before_fc", False)),
        fc_norm=bool(d.get("fc_norm", False)),
        norm_output=bool(d.get("norm_output", False)),
        mask_token_id=mask,
        embed_requires_grad=mask is not None,
        speculative_tokens=int(d.get("speculative_tokens", eagle.get("speculative_tokens", 7))),
    )


def to_eagle_config(cfg: DrafterConfig) -> dict[str, Any]:
    """The flat EAGLE / AWS config dict for ``cfg``."""
    if cfg.layer.family != "llama":
        raise ConfigError("the EAGLE/AWS layout holds Llama drafter layers only; use --layout speculators")
    d = to_hf_config(cfg.layer)
    d.pop("eagle_aux_hidden_state_layer_ids", None)
    d.update(
        architectures=[EAGLE_ARCHITECTURE],
        draft_vocab_size=cfg.draft_vocab_size,
        norm_before_residual=cfg.norm_before_residual,
        norm_before_fc=cfg.norm_before_fc,
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
        speculative_tokens=cfg.speculative_tokens,
    )
    if cfg.aux_layer_ids:
        d["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    if cfg.target_hidden_size != cfg.hidden_size:
        d["target_hidden_size"] = cfg.target_hidden_size
    if cfg.mask_token_id is not None:
        d["ptd_token_id"] = cfg.mask_token_id
    return d


def drafter_config_from_dict(d: dict[str, Any], *, dtype: str = "float32") -> tuple[DrafterConfig, str]:
    """(config, layout) of either format, detected from the dict: ``speculators`` or ``eagle``."""
    if "speculators_model_type" in d:
        return from_speculators_config(d, dtype=dtype), "speculators"
    archs = d.get("architectures") or []
    if d.get("model_type") == "llama" and (EAGLE_ARCHITECTURE in archs or "draft_vocab_size" in d):
        return from_eagle_config(d, dtype=dtype), "eagle"
    raise ConfigError(
        f"not a drafter config: neither speculators_model_type nor an EAGLE layout (architectures={archs})"
    )


def random_drafter_config(cfg: ModelConfig, layers: int = 2) -> DrafterConfig:
    """A P-EAGLE drafter of the target's shape (width, heads, vocabulary), ``layers`` deep, reading the
    target's aux taps; for SmolLM2 this is the SmolLM2-sized drafter of ``peagle_jax.bench.draft``."""
    plain = {}
    if cfg.moe is not None or cfg.attn_sinks or cfg.sliding_window:
        # The released drafters of the MoE targets (GPT-OSS, Qwen3-MoE) are plain Llama layers: dense MLP, no
        # biases, sinks or sliding window, and RoPE of their own (the target's YaRN does not carry over).
        plain = dict(
            family="llama", moe=None, attn_sinks=False, sliding_window=None, layer_types=(), qkv_bias=False,
            o_bias=False, mlp_bias=False, qk_norm=False, rope=RopeConfig(theta=cfg.rope.theta),
        )  # fmt: skip
    layer = cfg.replace(num_layers=layers, aux_layer_ids=(0,), tie_word_embeddings=True, **plain)
    return DrafterConfig(
        layer=layer,
        algorithm="peagle",
        mask_token_id=0,
        target_hidden_size=cfg.hidden_size,
        num_aux=len(cfg.aux_layer_ids),
        aux_layer_ids=cfg.aux_layer_ids,
    )
