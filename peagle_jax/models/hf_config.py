"""A Hugging Face ``config.json`` to :class:`~peagle_jax.models.config.ModelConfig` and back.

Every attribute is either read, known not to change the forward math, or refused with :class:`ConfigError`
naming it (another RoPE type, sliding windows outside GPT-OSS, a mixture of experts outside GPT-OSS and
Qwen3-MoE, ...): never silently ignored. Both the transformers-5 ``rope_parameters`` form and the older
``rope_theta`` + ``rope_scaling`` are read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from peagle_jax.models.config import (
    ARCHITECTURES,
    FAMILIES,
    LAYER_TYPES,
    MOE_FAMILIES,
    ROPE_TYPES,
    ConfigError,
    ModelConfig,
    MoEConfig,
    RopeConfig,
)

# Attributes read by from_hf_config or known not to change the forward math (training, serving, bookkeeping).
_KNOWN = {
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "initializer_range",
    "attention_dropout",
    "pad_token_id",
    "pretraining_tp",
    "max_window_layers",
    "bos_token_id",
    "eos_token_id",
    "max_position_embeddings",
    "hidden_act",
    "_name_or_path",
    "tokenizer_class",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "id2label",
    "label2id",
    "quantization_config",
    "eagle_aux_hidden_state_layer_ids",
    "use_return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "add_cross_attention",
    "tie_encoder_decoder",
    "problem_type",
    "generation_config",
    "_attn_implementation_autoset",
    "embd_pdrop",
    "resid_pdrop",
    "mlp_bias",
    "attention_bias",
    "rope_scaling",
    "rope_theta",
    "rope_parameters",
    "head_dim",
    "tie_word_embeddings",
    "rms_norm_eps",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "use_sliding_window",
    "sliding_window",
    "layer_types",
    "partial_rotary_factor",
    "router_aux_loss_coef",
    "output_router_logits",
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "swiglu_alpha",
    "swiglu_limit",
}
# Attributes some hub configs carry that transformers does not read for the family (gpt-oss's OpenAI-side
# fields, Qwen3-Coder's leftovers of Qwen2-MoE): accepted where they agree with the math transformers runs,
# refused otherwise. A string names the attribute it must equal ("rope": YaRN's original context).
_MUST_AGREE = {
    "gpt_oss": {"experts_per_token": "num_experts_per_tok", "initial_context_length": "rope"},
    "qwen3_moe": {"qkv_bias": False, "use_qk_norm": True, "shared_expert_intermediate_size": 0},
}
# Attributes read for the mixture-of-experts families only (refused elsewhere through _REFUSED_IF_SET).
_MOE_KEYS = {"num_experts", "num_local_experts", "moe_intermediate_size", "num_experts_per_tok"}
# Attributes whose mere presence with a non-trivial value means an architecture we do not implement.
_REFUSED_IF_SET = {
    "num_experts": "mixture of experts",
    "num_local_experts": "mixture of experts",
    "moe_intermediate_size": "mixture of experts",
    "num_experts_per_tok": "mixture of experts",
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    "no_rope_layers": "layers without RoPE",
    "attention_chunk_size": "chunked attention",
}


_LLAMA3_ROPE_KEYS = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
_YARN_KEYS = {"factor", "original_max_position_embeddings"}
_YARN_OPTIONAL = {"beta_fast", "beta_slow", "truncate", "attention_factor"}


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    """Read RoPE from either transformers-5 ``rope_parameters`` or the older ``rope_theta``/``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    if scaling:
        params = {**scaling, **params} if params else dict(scaling)
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope_type {rope_type!r} is not implemented; supported: {', '.join(ROPE_TYPES)}")
    base = {"rope_theta", "rope_type", "type"}
    if rope_type == "default":
        extra = set(params) - base
        if extra:
            raise ConfigError(f"rope parameters {sorted(extra)} are not implemented for rope_type 'default'")
        return RopeConfig(theta=float(theta))
    needed = _LLAMA3_ROPE_KEYS if rope_type == "llama3" else _YARN_KEYS
    missing = sorted(k for k in needed if params.get(k) is None)
    if missing:
        raise ConfigError(f"rope_type {rope_type!r} needs rope parameters {missing}, which the config lacks")
    extra = sorted(set(params) - base - needed - (_YARN_OPTIONAL if rope_type == "yarn" else set()))
    if extra:
        raise ConfigError(f"rope parameters {extra} are not implemented for rope_type {rope_type!r}")
    common = dict(
        theta=float(theta),
        type=rope_type,
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
    if rope_type == "llama3":
        return RopeConfig(
            **common,
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
        )
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        **common,
        beta_fast=float(params.get("beta_fast") or 32.0),  # transformers: `or 32`, so 0 or None means 32
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )


def _refuse_unsupported(hf: dict[str, Any], family: str) -> None:
    for key, what in _REFUSED_IF_SET.items():
        if family in MOE_FAMILIES and key in _MOE_KEYS:
            continue
        if hf.get(key):
            raise ConfigError(f"config attribute {key}={hf[key]!r} ({what}) is not supported")
    if hf.get("use_sliding_window"):
        raise ConfigError(
            f"config attribute use_sliding_window={hf['use_sliding_window']!r} (sliding_window="
            f"{hf.get('sliding_window')!r}) is not supported"
        )
    if family == "llama" and hf.get("sliding_window"):
        raise ConfigError(f"config attribute sliding_window={hf['sliding_window']!r} is not supported")
    layer_types = hf.get("layer_types")
    if layer_types and any(t not in LAYER_TYPES for t in layer_types):
        raise ConfigError(f"config attribute layer_types={sorted(set(layer_types))} is not supported")
    if family != "gpt_oss" and layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"config attribute layer_types={sorted(set(layer_types))} is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config attribute hidden_act={hf['hidden_act']!r} is not supported (only silu)")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"config attribute partial_rotary_factor={hf['partial_rotary_factor']} is not supported")
    if family != "qwen3_moe" and (hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1):
        raise ConfigError("config attributes mlp_only_layers / decoder_sparse_step are read for qwen3_moe only")
    if family != "gpt_oss" and (hf.get("swiglu_limit") is not None or hf.get("swiglu_alpha") is not None):
        raise ConfigError("config attributes swiglu_limit / swiglu_alpha are read for gpt_oss only")
    if family == "qwen2" and hf.get("attention_bias") is False:
        raise ConfigError("config attribute attention_bias=False is not supported for qwen2")
    agree = _MUST_AGREE.get(family, {})
    for key, want in agree.items():
        if key not in hf:
            continue
        if want == "rope":
            want = _rope_from_hf(hf).original_max_position_embeddings
        elif isinstance(want, str):
            want = hf.get(want)
        if hf[key] != want:
            raise ConfigError(f"config attribute {key}={hf[key]!r} is not supported (transformers runs {want!r})")
    unknown = sorted(k for k in hf if k not in _KNOWN and k not in _REFUSED_IF_SET and k not in agree)
    if unknown:
        logging.getLogger(__name__).warning(
            "config attributes %s are not read by peagle_jax; check they do not change the math", unknown
        )


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def from_hf_config(hf: dict[str, Any], *, dtype: str = "float32", aux_layer_ids=None) -> ModelConfig:
    """Build a :class:`ModelConfig` from a Hugging Face config dict, refusing what is not implemented."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(f"model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    missing = [k for k in _REQUIRED if hf.get(k) is None]
    if missing:
        raise ConfigError(f"config attribute(s) {missing} missing; a {family} config needs them")
    _refuse_unsupported(hf, family)
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // num_heads
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    if aux_layer_ids is None:
        aux_layer_ids = hf.get("eagle_aux_hidden_state_layer_ids") or ()
    attention_bias = bool(hf.get("attention_bias", family == "gpt_oss"))
    num_layers = int(hf["num_hidden_layers"])
    layer_types: tuple[str, ...] = ()
    if family == "gpt_oss":  # transformers' default: even layers slide, odd layers attend fully
        layer_types = tuple(
            hf.get("layer_types")
            or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        )
        if all(t == "full_attention" for t in layer_types):
            layer_types = ()
    return ModelConfig(
        family=family,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=attention_bias if family in ("llama", "gpt_oss", "qwen3_moe") else False,
        mlp_bias=bool(hf.get("mlp_bias", False)) if family == "llama" else False,
        qk_norm=family in ("qwen3", "qwen3_moe"),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        aux_layer_ids=tuple(int(j) for j in aux_layer_ids),
        dtype=dtype,
        attn_sinks=family == "gpt_oss",
        sliding_window=int(hf["sliding_window"]) if layer_types and hf.get("sliding_window") else None,
        layer_types=layer_types,
        moe=_moe_from_hf(hf, family, num_layers),
    )


def _moe_from_hf(hf: dict[str, Any], family: str, num_layers: int) -> MoEConfig | None:
    if family not in MOE_FAMILIES:
        return None
    num_experts = hf.get("num_local_experts") or hf.get("num_experts")
    top_k = hf.get("num_experts_per_tok")
    if not num_experts or not top_k:
        raise ConfigError(f"a {family} config needs num_local_experts (or num_experts) and num_experts_per_tok")
    if not 0 < int(top_k) <= int(num_experts):
        raise ConfigError(f"num_experts_per_tok={top_k} must be within 1..num_experts={num_experts}")
    if family == "gpt_oss":
        return MoEConfig(
            num_experts=int(num_experts),
            top_k=int(top_k),
            intermediate_size=int(hf["intermediate_size"]),
            sparse_layers=tuple(range(num_layers)),
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        )
    if hf.get("moe_intermediate_size") is None:
        raise ConfigError("a qwen3_moe config needs moe_intermediate_size")
    step = int(hf.get("decoder_sparse_step", 1))
    dense = set(hf.get("mlp_only_layers") or ())
    return MoEConfig(
        num_experts=int(num_experts),
        top_k=int(top_k),
        intermediate_size=int(hf["moe_intermediate_size"]),
        sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The Hugging Face config dict (transformers-5 ``rope_parameters`` form) describing ``cfg``."""
    rope: dict[str, Any] = {"rope_theta": cfg.rope.theta, "rope_type": cfg.rope.type}
    if cfg.rope.type == "llama3":
        rope.update(
            factor=cfg.rope.factor,
            low_freq_factor=cfg.rope.low_freq_factor,
            high_freq_factor=cfg.rope.high_freq_factor,
            original_max_position_embeddings=cfg.rope.original_max_position_embeddings,
        )
    elif cfg.rope.type == "yarn":
        rope.update(
            factor=cfg.rope.factor,
            beta_fast=cfg.rope.beta_fast,
            beta_slow=cfg.rope.beta_slow,
            truncate=cfg.rope.truncate,
            original_max_position_embeddings=cfg.rope.original_max_position_embeddings,
        )
        if cfg.rope.attention_factor is not None:
            rope["attention_factor"] = cfg.rope.attention_factor
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "dtype": cfg.dtype,
    }
    if cfg.family == "llama":
        hf["attention_bias"] = cfg.qkv_bias
        hf["mlp_bias"] = cfg.mlp_bias
    elif cfg.family in ("qwen3", "qwen3_moe", "gpt_oss"):
        hf["attention_bias"] = cfg.qkv_bias
    if cfg.family == "gpt_oss":
        hf["layer_types"] = list(cfg.layer_types) or ["full_attention"] * cfg.num_layers
        hf["sliding_window"] = cfg.sliding_window
        hf["num_local_experts"] = cfg.moe.num_experts
        hf["num_experts_per_tok"] = cfg.moe.top_k
        hf["swiglu_alpha"] = cfg.moe.swiglu_alpha
        hf["swiglu_limit"] = cfg.moe.swiglu_limit
    elif cfg.family == "qwen3_moe":
        sparse = set(cfg.moe.sparse_layers)
        hf["num_experts"] = cfg.moe.num_experts
        hf["num_experts_per_tok"] = cfg.moe.top_k
        hf["moe_intermediate_size"] = cfg.moe.intermediate_size
        hf["norm_topk_prob"] = cfg.moe.norm_topk_prob
        hf["decoder_sparse_step"] = 1
        hf["mlp_only_layers"] = [i for i in range(cfg.num_layers) if i not in sparse]
    return hf


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a model directory, as a dict; errors name the file."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json (is this a Hugging Face or speculators model directory?)")
    return read_json_object(path, str(path))


def read_json_object(path: Path, name: str) -> dict[str, Any]:
    """The JSON object in the file ``path``; a :class:`ConfigError` starting with ``name`` otherwise."""
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{name}: not valid JSON ({err})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{name}: expected a JSON object, got {type(d).__name__}")
    return d


def load_hf_config(model_dir: str | Path, **kwargs) -> ModelConfig:
    """Read ``config.json`` from a model directory; errors name the file."""
    return from_hf_config(read_config_json(model_dir), **kwargs)
