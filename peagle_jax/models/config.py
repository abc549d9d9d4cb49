"""Target model configuration: the static, hashable dataclasses every jitted function takes (read from and
written back to a Hugging Face ``config.json`` by :mod:`peagle_jax.models.hf_config`).

Shape letters in names (``logits_BTV``) and einsum strings: docs/glossary.md.

Families: dense Llama / Qwen2 / Qwen3, and the mixture-of-experts GPT-OSS (attention sinks, per-layer
sliding windows, YaRN RoPE) and Qwen3-MoE. A config attribute that changes the math but is not implemented
(another RoPE type, sliding windows outside GPT-OSS, ...) is refused with :class:`ConfigError` naming it,
never silently ignored.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from peagle_jax.errors import UserError

FAMILIES = ("llama", "qwen2", "qwen3", "gpt_oss", "qwen3_moe")
MOE_FAMILIES = ("gpt_oss", "qwen3_moe")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
ROPE_TYPES = ("default", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
EXPERT_FORMATS = ("unpacked", "packed")
MXFP4_BLOCK = 32  # values per MXFP4 scale: packed experts need widths that are multiples of it


class ConfigError(UserError):
    """A config.json this implementation cannot run faithfully; the message names the attribute."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings. ``llama3`` scales low frequencies as in Llama 3.1; ``yarn`` blends
    interpolated and extrapolated frequencies between ``beta_fast`` and ``beta_slow`` rotations and scales
    cos/sin by ``attention_factor`` (default ``0.1 * ln(factor) + 1``), as transformers' YaRN."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (E = ``num_experts``). The router and expert math follow the family:

    - ``gpt_oss``: router with bias, top-k of the logits then softmax over the k; experts with biases and the
      clamped SwiGLU ``(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``.
    - ``qwen3_moe``: router without bias, softmax over all E in fp32, top-k, renormalised when
      ``norm_topk_prob``; experts ``down(silu(gate) * up)`` without bias.

    ``sparse_layers`` are the layers that use it; the others keep the dense MLP of ``intermediate_size``.

    ``experts`` says how the expert matrices are held: ``"unpacked"`` in the run dtype (``gate_up_proj``,
    ``down_proj``), or ``"packed"`` (GPT-OSS only) as the checkpoint's MXFP4 uint8 blocks and scales, which
    each call unpacks for the experts it reads (:mod:`peagle_jax.models.mxfp4_jax`). A storage choice, not
    architecture: ``config.json`` does not carry it; the loaders pick it from the checkpoint
    (:func:`peagle_jax.models.weights.resolve_experts`).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    sparse_layers: tuple[int, ...]
    norm_topk_prob: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    dispatch: str = "auto"  # how tokens reach experts: "auto", "dense" or "gather" (peagle_jax.models.moe)
    experts: str = "unpacked"  # how expert weights are held: "unpacked" or "packed" (MXFP4, GPT-OSS)

    def __post_init__(self):
        if self.dispatch not in ("dense", "gather", "auto"):
            raise ConfigError(f"MoE dispatch {self.dispatch!r}: choose dense, gather or auto")
        if self.experts not in EXPERT_FORMATS:
            raise ConfigError(f"MoE experts {self.experts!r}: choose {' or '.join(EXPERT_FORMATS)}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static, hashable architecture of a Llama / Qwen2 / Qwen3 decoder.

    It is passed to jitted functions as a static argument, so every field must be hashable.
    ``aux_layer_ids`` follows the vLLM convention: id j taps the residual stream *entering* layer j,
    which equals Hugging Face ``output_hidden_states[j]``.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    aux_layer_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    attn_sinks: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    moe: MoEConfig | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ConfigError(f"unsupported model family {self.family!r}; supported: {', '.join(FAMILIES)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} not supported; choose one of {sorted(DTYPES)}")
        if self.layer_types and (
            len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types)
        ):
            raise ConfigError(
                f"layer_types={list(self.layer_types)} must give one of {LAYER_TYPES} for each of the "
                f"{self.num_layers} layers"
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")
        if (self.moe is not None) != (self.family in MOE_FAMILIES):
            raise ConfigError(f"a {self.family} model {'needs' if self.moe is None else 'has no'} mixture of experts")
        if self.moe is not None and self.moe.experts == "packed":
            if self.family != "gpt_oss":
                raise ConfigError(f"packed (MXFP4) experts are GPT-OSS's; a {self.family} model keeps them unpacked")
            for what, width in (("hidden_size", self.hidden_size), ("intermediate_size", self.moe.intermediate_size)):
                if width % MXFP4_BLOCK:
                    raise ConfigError(f"packed (MXFP4) experts need {what} a multiple of {MXFP4_BLOCK}, got {width}")
        if not self.aux_layer_ids:
            object.__setattr__(self, "aux_layer_ids", default_aux_layer_ids(self.num_layers))
        for j in self.aux_layer_ids:
            if not 0 <= j < self.num_layers:
                raise ConfigError(
                    f"eagle_aux_hidden_state_layer_ids: {j} is outside 0..{self.num_layers - 1} (an id j taps "
                    "the residual stream entering layer j)"
                )

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends over a sliding window of ``sliding_window`` positions."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default taps ``[2, L//2, L-3]`` (always three, as the drafter's ``fc`` expects), clamped
    into ``0..L-1`` for tiny test models."""
    return tuple(sorted(min(max(j, 0), num_layers - 1) for j in (2, num_layers // 2, num_layers - 3)))
