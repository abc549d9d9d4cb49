"""Tiny random chat models that carry the real tokenizers and chat templates of GPT-OSS, Qwen3, Qwen3-Coder and
Llama 3.1 (:func:`peagle_jax.chat.tokenizers.hf_tokenizer`, the pinned llama.cpp templates), written with
``save_pretrained``: the real vocabulary size, special ids and generation config; two layers of width 64.

:func:`chat_model_dir` writes each (kind, seed) once per pytest session: the embeddings of a 200k vocabulary
are most of the cost.
"""

from __future__ import annotations

from pathlib import Path

KINDS = ("gpt-oss", "qwen3", "qwen3-coder", "llama3.1")
# kind -> (pinned vocabulary, pinned chat template)
TOKENIZERS = {
    "gpt-oss": ("o200k", "template-gpt-oss"),
    "qwen3": ("qwen3", "template-qwen3"),
    "qwen3-coder": ("qwen3", "template-qwen3-coder"),
    "llama3.1": ("llama3", "template-llama3.1"),
}
# kind -> the special ids of the real config.json and generation_config.json (gpt-oss-20b, Qwen3-0.6B,
# Qwen3-Coder-30B-A3B-Instruct, Llama-3.1-8B-Instruct)
CONFIG_IDS = {
    "gpt-oss": dict(eos_token_id=200002, pad_token_id=199999),
    "qwen3": dict(bos_token_id=151643, eos_token_id=151645),
    "qwen3-coder": dict(bos_token_id=151643, eos_token_id=151645),
    "llama3.1": dict(bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
}
GENERATION_IDS = {
    "gpt-oss": dict(bos_token_id=199998, eos_token_id=[200002, 199999, 200012], pad_token_id=199999),
    "qwen3": dict(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643),
    "qwen3-coder": dict(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643),
    "llama3.1": dict(bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
}
# initializer_range 0.2 rather than 0.02: logits spread over units, so greedy argmaxes are far from ties
_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    initializer_range=0.2,
)


def tiny_chat_model(kind: str, seed: int = 0):
    """A random tiny transformers model of ``kind`` with the real vocabulary size and special ids, in eval mode."""
    import torch
    import transformers

    if kind == "gpt-oss":
        yarn = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0)
        config = transformers.GptOssConfig(
            **{**_TINY, "intermediate_size": 64},
            vocab_size=201088,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={**yarn, "truncate": False, "original_max_position_embeddings": 4096},
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            **CONFIG_IDS[kind],
        )
        model_cls = transformers.GptOssForCausalLM
    elif kind == "qwen3":
        config = transformers.Qwen3Config(
            **_TINY,
            vocab_size=151936,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            max_position_embeddings=40960,
            tie_word_embeddings=True,
            **CONFIG_IDS[kind],
        )
        model_cls = transformers.Qwen3ForCausalLM
    elif kind == "qwen3-coder":
        config = transformers.Qwen3MoeConfig(
            **_TINY,
            vocab_size=151936,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rope_parameters=dict(rope_type="default", rope_theta=10000000.0),
            max_position_embeddings=262144,
            tie_word_embeddings=False,
            **CONFIG_IDS[kind],
        )
        model_cls = transformers.Qwen3MoeForCausalLM
    elif kind == "llama3.1":
        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
        config = transformers.LlamaConfig(
            **_TINY,
            vocab_size=128256,
            rope_parameters={**rope, "original_max_position_embeddings": 8192},
            max_position_embeddings=131072,
            tie_word_embeddings=False,
            **CONFIG_IDS[kind],
        )
        model_cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown chat model kind {kind!r}; known: {', '.join(KINDS)}")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # non-trivial norms, biases and sinks so that their mapping counts too
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "bias", "sinks")):
                p.add_(0.1 * torch.randn_like(p))
    return model


def chat_tokenizer(kind: str):
    """The real tokenizer of ``kind`` with its chat template set."""
    from peagle_jax.assets import fetch
    from peagle_jax.chat.tokenizers import hf_tokenizer

    vocab, template = TOKENIZERS[kind]
    return hf_tokenizer(vocab, chat_template=fetch(template).read_text())


def write_chat_model(path: Path, kind: str, seed: int = 0) -> Path:
    """A tiny random ``kind`` model (see :data:`KINDS`) with its real tokenizer, chat template and generation
    config, in ``path``."""
    import transformers

    model = tiny_chat_model(kind, seed)
    model.generation_config = transformers.GenerationConfig(**GENERATION_IDS[kind])
    model.save_pretrained(path)
    chat_tokenizer(kind).save_pretrained(path)
    return path


_WRITTEN: dict[tuple[str, int], Path] = {}


def chat_model_dir(tmp_path_factory, kind: str, seed: int = 0) -> Path:
    """:func:`write_chat_model` into the session's pytest tmp root, once per (kind, seed) and session."""
    key = (kind, seed)
    if key not in _WRITTEN or not (_WRITTEN[key] / "config.json").is_file():
        root = tmp_path_factory.getbasetemp() / "chat-models"
        root.mkdir(exist_ok=True)
        _WRITTEN[key] = write_chat_model(root / f"{kind}-{seed}", kind, seed)
    return _WRITTEN[key]


VOCAB = {"gpt-oss": 201088, "qwen3": 151936, "qwen3-coder": 151936, "llama3.1": 128256}


def write_chat_drafter(path: Path, kind: str, k: int = 3) -> Path:
    """A random one-layer P-EAGLE drafter for :func:`write_chat_model` of ``kind`` (full vocabulary, sharing
    the target's embedding; mask token: the last id, which no tokenizer uses)."""
    from serve_fixtures import write_tiny_drafter

    return write_tiny_drafter(path, k, vocab=VOCAB[kind], mask_token_id=VOCAB[kind] - 1)
