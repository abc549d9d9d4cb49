"""The real tokenizers of GPT-OSS (o200k), Qwen3 (and Qwen3-Coder) and Llama 3.1, as transformers fast
tokenizers built offline from the pinned vocabularies (:mod:`peagle_jax.chat.vocab`):

    tok = hf_tokenizer("qwen3", chat_template=fetch("template-qwen3").read_text())

Each is a byte-level BPE whose merges are derived from the ranks the way tiktoken merges (the pair whose
concatenation has the lowest rank goes first; transformers' ``TikTokenConverter`` does the same), behind the
model's own pre-tokenizer regex, with the model's added tokens at their real ids and the special-token roles
(bos, eos, pad) of the model's published ``tokenizer_config.json``. The ids equal tiktoken's and harmony's for
o200k and the expected ids of llama.cpp's tokenizer test vectors for Qwen3 and Llama 3 (tests/test_chat_models.py).

Building one takes seconds (200k merges), so the ``tokenizer.json`` is cached under
``cache_dir()/assets/tokenizers/<name>-v<BUILD>.json``, written atomically under a lock.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from peagle_jax.assets import cache_dir, file_lock
from peagle_jax.chat.vocab import read_specials, read_vocab

__all__ = ["PATTERNS", "ROLES", "hf_tokenizer", "tokenizer_json"]

BUILD = 1  # bump when the recipe below changes: cached files of older recipes are then ignored

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
PATTERNS = {
    # tiktoken's o200k_base (and o200k_harmony): cased words keep their contraction, digits in threes, and a
    # punctuation run takes trailing newlines and slashes.
    "o200k": "|".join(
        [
            rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]*[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}]+{_CONTRACTIONS}?",
            rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{Lu}}\p{{Lt}}\p{{Lm}}\p{{Lo}}\p{{M}}]+[\p{{Ll}}\p{{Lm}}\p{{Lo}}\p{{M}}]*{_CONTRACTIONS}?",
            r"\p{N}{1,3}",
            r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
            r"\s*[\r\n]+",
            r"\s+(?!\S)",
            r"\s+",
        ]
    ),
    # Qwen2's (Qwen3 keeps it): Llama 3's but one digit per piece.
    "qwen3": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    # Llama 3's (cl100k's, written without possessive quantifiers)
    "llama3": _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# the special-token roles of each model's tokenizer_config.json (GPT-OSS, Qwen3 and Qwen3-Coder, Llama 3.1)
ROLES = {
    "o200k": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
    "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 131072},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "model_max_length": 131072},
}
# added tokens that are not special: they are text the model writes, so decode(skip_special_tokens=True) keeps them
_TEXT_TOKENS = {
    "qwen3": {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"},
}
# Llama 3.1's named added tokens: it named three of Llama 3.0's reserved ones (128004, 128008, 128010; the pinned
# file has 3.0's names) and renumbered the rest (<|reserved_special_token_k|>, k counting up from 0)
_LLAMA31 = {
    128000: "<|begin_of_text|>",
    128001: "<|end_of_text|>",
    128004: "<|finetune_right_pad_id|>",
    128006: "<|start_header_id|>",
    128007: "<|end_header_id|>",
    128008: "<|eom_id|>",
    128009: "<|eot_id|>",
    128010: "<|python_tag|>",
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for chr(256 + i)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _specials(name: str) -> list[tuple[int, str]]:
    """(id, text) of the added tokens, one text per id in id order: o200k's duplicate 200018 (harmony's
    ``<|endofprompt|>`` and ``<|reserved_200018|>``) keeps ``<|endofprompt|>`` as GPT-OSS's tokenizer does."""
    specials = read_specials(name)
    if name == "llama3":
        specials = _llama31(specials)
    by_id: dict[int, str] = {}
    for tid, text in specials:
        if tid not in by_id or not text.startswith("<|reserved"):
            by_id[tid] = text
    return sorted(by_id.items())


def _llama31(specials: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Llama 3.0's added tokens under Llama 3.1's names."""
    reserved = iter(range(len(specials)))
    return [(tid, _LLAMA31.get(tid) or f"<|reserved_special_token_{next(reserved)}|>") for tid, _ in specials]


def _build(name: str) -> str:
    """The tokenizer.json text of vocabulary ``name``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    ranks = dict(read_vocab(name))
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{name}: ranks are not 0..{len(ranks) - 1}")
    merges = sorted(
        (rank, ranks[tok[:i]], ranks[tok[i:]], tok[:i], tok[i:])
        for tok, rank in ranks.items()
        for i in range(1, len(tok))
        if tok[:i] in ranks and tok[i:] in ranks
    )
    alphabet = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    # tiktoken (o200k, Llama 3) looks a whole piece up before merging, and Llama 3 needs it (one of llama.cpp's
    # vectors differs without); Qwen's own tokenizer.json does not (its vectors agree either way).
    bpe = models.BPE(
        {text(t): r for t, r in ranks.items()},
        [(text(a), text(b)) for *_, a, b in merges],
        fuse_unk=False,
        ignore_merges=name != "qwen3",
    )
    tok = Tokenizer(bpe)
    if name == "qwen3":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERNS[name]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = _specials(name)
    if [tid for tid, _ in specials] != list(range(len(ranks), len(ranks) + len(specials))):
        raise ValueError(f"{name}: the added tokens do not follow the vocabulary contiguously")
    plain = _TEXT_TOKENS.get(name, set())
    tok.add_tokens([AddedToken(t, normalized=False, special=t not in plain) for _, t in specials])
    if [tok.token_to_id(t) for _, t in specials] != [tid for tid, _ in specials]:
        raise ValueError(f"{name}: an added token did not land on its id")
    byte_level = processors.ByteLevel(trim_offsets=False)
    if name == "llama3":  # Llama 3 prepends <|begin_of_text|> when asked for special tokens
        bos = ROLES[name]["bos_token"]
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    else:
        tok.post_processor = byte_level
    return tok.to_str()


def tokenizer_json(name: str) -> Path:
    """The cached ``tokenizer.json`` of vocabulary ``name`` (o200k, qwen3, llama3), built on first use."""
    if name not in ROLES:
        raise KeyError(f"unknown tokenizer {name!r}; known: {', '.join(ROLES)}")
    path = cache_dir() / "assets" / "tokenizers" / f"{name}-v{BUILD}.json"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.with_suffix(".lock")):
        if not path.is_file():  # another process may have built it while we waited
            text = _build(name)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; a cache is shared read-only
            with os.fdopen(fd, "w") as out:
                out.write(text)
            os.replace(tmp, path)  # a rename within one directory is atomic: the path is absent or whole
    return path


def hf_tokenizer(name: str, chat_template: str | None = None):
    """A transformers ``PreTrainedTokenizerFast`` of vocabulary ``name`` with the model's special-token roles,
    and ``chat_template`` when given (``save_pretrained`` then writes it beside the tokenizer)."""
    from peagle_jax.hf_tokenizers import transformers

    path = tokenizer_json(name)
    tok = transformers().PreTrainedTokenizerFast(
        tokenizer_file=str(path), clean_up_tokenization_spaces=False, **ROLES[name]
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok
