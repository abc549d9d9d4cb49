"""Tests of `peagle_jax.models.gguf`: hermetic ones on tiny GGUF files written here, and a slow one on the
real embedded SmolLM2 against transformers' own GGUF loader."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from peagle_jax.models import gguf as gguf_loader
from peagle_jax.models.gguf import GGUFError, hf_name, read_gguf, unpermute_rope_rows

D, F, N, G, H, L = 32, 64, 4, 2, 8, 2  # width, MLP width, query heads, kv heads, head dim, layers
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGED = ["hi", "12", "Ġhi"]
MERGES = ["h i", "1 2", "Ġ hi"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

_GGUF_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def llamacpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: per head, view rows as (2, H/2) and swap the axes."""
    return (
        weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def tiny_hf_weights(seed: int, vocab: int, untied: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (vocab, D), "model.norm.weight": (D,)}
    if untied:
        shapes["lm_head.weight"] = (vocab, D)
    for i in range(L):
        layer = {
            "self_attn.q_proj.weight": (N * H, D),
            "self_attn.k_proj.weight": (G * H, D),
            "self_attn.v_proj.weight": (G * H, D),
            "self_attn.o_proj.weight": (D, N * H),
            "mlp.gate_proj.weight": (F, D),
            "mlp.up_proj.weight": (F, D),
            "mlp.down_proj.weight": (D, F),
            "input_layernorm.weight": (D,),
            "post_attention_layernorm.weight": (D,),
        }
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _gguf_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if name in top:
        return top[name]
    if name == "lm_head.weight":
        return "output.weight"
    _, _, index, rest = name.split(".", 3)
    return f"blk.{index}.{_GGUF_LAYER_NAMES[rest]}"


def write_tiny_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    pre: str = "smollm",
    quantize_embedding: bool = False,
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """A GGUF laid out as llama.cpp writes one: GGUF names, q/k rows permuted, dims reversed on disk."""
    tokens = CONTROL + _byte_alphabet() + MERGED
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(L)
    writer.add_context_length(128)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(F)
    writer.add_head_count(N)
    writer.add_head_count_kv(G)
    writer.add_rope_dimension_count(H)
    writer.add_rope_freq_base(100000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    for name, value in weights.items():
        if name.endswith("q_proj.weight"):
            value = llamacpp_permute(value, N)
        elif name.endswith("k_proj.weight"):
            value = llamacpp_permute(value, G)
        if quantize_embedding and name == "model.embed_tokens.weight":
            packed = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(_gguf_name(name), packed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(_gguf_name(name), value)
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


VOCAB = len(CONTROL) + 256 + len(MERGED)


@pytest.mark.parametrize("n_heads,head_dim,width", [(1, 2, 3), (4, 8, 16), (9, 64, 5), (3, 64, 1)])
def test_unpermute_inverts_llamacpp_permute(n_heads: int, head_dim: int, width: int) -> None:
    rng = np.random.default_rng(n_heads * 1000 + head_dim)
    weight = rng.standard_normal((n_heads * head_dim, width)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(llamacpp_permute(weight, n_heads), n_heads), weight)
    np.testing.assert_array_equal(llamacpp_permute(unpermute_rope_rows(weight, n_heads), n_heads), weight)


def test_unpermute_restores_rotate_half_pairs() -> None:
    """In GGUF each head stores the RoPE pair (j, j + H/2) as adjacent rows (2j, 2j + 1)."""
    n_heads, head_dim = 2, 8
    gguf_rows = np.arange(n_heads * head_dim)[:, None]
    hf_rows = unpermute_rope_rows(gguf_rows, n_heads)[:, 0]
    for head in range(n_heads):
        for j in range(head_dim // 2):
            base = head * head_dim
            assert hf_rows[base + j] == base + 2 * j
            assert hf_rows[base + j + head_dim // 2] == base + 2 * j + 1


def test_hf_names() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    for unknown in ("blk.0.attn_qkv.weight", "rope_freqs.weight", "blk.x.attn_q.weight"):
        with pytest.raises(GGUFError, match=unknown.replace(".", r"\.")):
            hf_name(unknown)


@pytest.mark.parametrize("seed", [0, 1])
def test_read_tiny_gguf_round_trips(tmp_path: Path, seed: int) -> None:
    weights = tiny_hf_weights(seed, VOCAB)
    config, state = read_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", weights))
    assert state.keys() == weights.keys()
    for name, value in weights.items():
        assert state[name].dtype == np.float32 and state[name].flags.c_contiguous
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    expected = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": D,
        "intermediate_size": F,
        "num_hidden_layers": L,
        "num_attention_heads": N,
        "num_key_value_heads": G,
        "head_dim": H,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "float32",
    }
    assert {key: config[key] for key in expected} == expected
    json.dumps(config)  # it must be writable as config.json


def test_read_quantized_untied(tmp_path: Path) -> None:
    weights = tiny_hf_weights(2, VOCAB, untied=True)
    path = write_tiny_gguf(tmp_path / "q.gguf", weights, quantize_embedding=True)
    config, state = read_gguf(path)
    assert config["tie_word_embeddings"] is False
    np.testing.assert_array_equal(state["lm_head.weight"], weights["lm_head.weight"])
    embedding = state["model.embed_tokens.weight"]
    assert embedding.shape == (VOCAB, D) and embedding.dtype == np.float32
    original = weights["model.embed_tokens.weight"]
    q8 = gguf.GGMLQuantizationType.Q8_0
    np.testing.assert_array_equal(embedding, gguf.quants.dequantize(gguf.quants.quantize(original, q8), q8))
    # Q8_0 keeps one fp16 scale per 32 values and 8-bit codes: half a code step, plus up to 127 codes
    # times the scale's fp16 rounding (2**-11 relative), so under 0.57 of a step
    step = np.abs(original).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(embedding - original) <= 0.57 * step)


def test_unknown_tensor_in_file_is_an_error(tmp_path: Path) -> None:
    extra = {"blk.0.attn_qkv.weight": np.zeros((3 * D, D), np.float32)}
    path = write_tiny_gguf(tmp_path / "x.gguf", tiny_hf_weights(3, VOCAB), extra=extra)
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_qkv\.weight"):
        read_gguf(path)


def test_refuses_other_architectures(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "g.gguf", tiny_hf_weights(4, VOCAB), arch="gpt2")
    with pytest.raises(GGUFError, match="gpt2"):
        read_gguf(path)


def test_tokenizer_from_gguf_metadata(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "t.gguf", tiny_hf_weights(5, VOCAB))
    tokenizer = gguf_loader.build_tokenizer(path)
    vocab = tokenizer.get_vocab()
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("hi hi")) == ["hi", "Ġhi"]
    # llama.cpp's "smollm" split isolates digits before BPE, so the merge "1 2" never applies
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("12")) == ["1", "2"]
    assert tokenizer.encode("<|im_start|>hi<|im_end|>") == [1, vocab["hi"], 2]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert tokenizer.chat_template == TEMPLATE
    assert tokenizer.decode(tokenizer.encode("hi 12 héllo")) == "hi 12 héllo"
    gpt2 = gguf_loader.build_tokenizer(write_tiny_gguf(tmp_path / "g2.gguf", tiny_hf_weights(5, VOCAB), pre="gpt-2"))
    assert gpt2.convert_ids_to_tokens(gpt2.encode("12")) == ["12"]

    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path / "tok")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "<|im_start|>user\nhi 12 hi<|im_end|>"
    assert reloaded.encode(text) == tokenizer.encode(text)
    assert reloaded.chat_template == TEMPLATE


def test_tokenizer_unsupported_pre_is_refused(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "p.gguf", tiny_hf_weights(6, VOCAB), pre="qwen2")
    with pytest.raises(GGUFError, match="qwen2"):
        gguf_loader.build_tokenizer(path)


def test_conversion_does_not_need_torch(tmp_path: Path) -> None:
    """The library must run without torch: convert a tiny GGUF in a process where torch cannot import."""
    path = write_tiny_gguf(tmp_path / "n.gguf", tiny_hf_weights(7, VOCAB))
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "from peagle_jax.models import gguf as gguf_loader\n"
        f"gguf_loader.write_hf_dir({str(path)!r}, {str(tmp_path / 'out')!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    assert {p.name for p in (tmp_path / "out").iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loader() -> None:
    """The materialized SmolLM2 directory equals what transformers reads from the GGUF itself.

    Exact agreement of weights and logits checks dequantization, shapes and the q/k un-permutation.
    """
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from peagle_jax import assets

    model_dir = gguf_loader.default_model_dir()
    assert gguf_loader.default_model_dir() == model_dir
    gguf_path = assets.fetch("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert tokenizer.chat_template is not None
    assert tokenizer.chat_template == reference_tokenizer.chat_template
    messages = [
        {"role": "user", "content": "What is 17 * 23? Explain in one line."},
        {"role": "assistant", "content": "17 * 23 = 391, since 17 * 20 = 340 and 17 * 3 = 51."},
        {"role": "user", "content": "Now write `def f(x):\n\treturn x ** 2` in Rust. Ünïcödé, 中文, 🙂!"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == reference_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    for sample in (text, "Hello, world! It's 3.14159 in 2024.", "  leading spaces\n\n\ttabs"):
        assert tokenizer.encode(sample) == reference_tokenizer.encode(sample), sample
    # Spaces before a digit: ours follows llama.cpp's "smollm" split (digits isolated first), which is
    # how SmolLM2's own tokenizer splits; transformers' GGUF conversion does not isolate digits.
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("x  1")) == ["x", "ĠĠ", "1"]

    reference = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    model = LlamaForCausalLM.from_pretrained(model_dir)
    assert model.dtype == torch.float32
    ours = load_file(str(model_dir / "model.safetensors"))
    reference_state = reference.state_dict()
    for name, value in ours.items():
        np.testing.assert_array_equal(value, reference_state[name].numpy(), err_msg=name)

    ids = torch.tensor([tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, return_dict=False)])
    with torch.no_grad():
        expected, actual = reference(ids).logits, model(ids).logits
    np.testing.assert_allclose(actual.numpy(), expected.numpy(), rtol=0, atol=1e-4)
