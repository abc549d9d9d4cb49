"""Structured outputs: a request's grammar (a JSON schema, any JSON object, a regular expression or a choice
of strings), compiled and matched on the host by llguidance, its allowed tokens sent to the device as
bitmasks (:mod:`peagle_jax.logit_rules`).

llguidance over xgrammar and outlines-core: it has no run-time dependency (xgrammar requires torch and
triton, which this JAX runtime otherwise never installs), it computes each mask lazily from the current
parser state (about 0.1 ms on SmolLM2's 49152 tokens, and a JSON schema compiles in about a millisecond),
where outlines-core builds a whole automaton index over the vocabulary per schema before the first token,
and it matches speculative decoding's needs directly: consume a drafted path, compute the mask there, roll
back. ``python -m peagle_jax.bench.grammar`` measures both libraries side by side.

Speculation stays exact: every node of a drafted tree gets the mask of the grammar state after its own path
(:meth:`Constraint.tree_masks`; a node whose path the grammar forbids can never be accepted, so its mask is
never used). Grammar-aware drafting: before the verify, each node's token is the best candidate the grammar
allows at its parent's state (the draft's per-depth candidates in rank order; a token the grammar forces;
else the drafted token, which verification then rejects), so that the drafter's proposals are not wasted on
tokens the grammar forbids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from peagle_jax.errors import UserError
from peagle_jax.logit_rules import mask_words

ALL = np.int32(-1)  # a mask word with every token allowed
# JSON is written as json.dumps writes it: ", " and ": " between items and keys, no other whitespace (a model
# cannot pad it with blanks forever, so an answer of a bounded schema always ends).
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ImportError:  # pragma: no cover - a dependency of the package
        raise UserError("structured outputs need llguidance: pip install llguidance") from None
    return llguidance


class Grammars:
    """A served model's side of the grammars: llguidance's view of its tokenizer (built once: ~0.4 s for a
    49152-token vocabulary) and the masks' width."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        llg = _llguidance()
        self.vocab, self.words = vocab_size, mask_words(vocab_size)
        eos = [int(t) for t in eos_ids] or None
        if _has_text_added_tokens(hf_tokenizer):
            tokens = _Tokens(hf_tokenizer, vocab_size, byte_level=True)
            self.tokenizer = llg.LLTokenizer(tokens.wrapper, n_vocab=vocab_size, eos_token=eos)
            return
        try:
            self.tokenizer = llg.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        except ValueError:  # a tokenizer llguidance cannot read (e.g. its decoder): its tokens one by one
            self.tokenizer = llg.LLTokenizer(
                _Tokens(hf_tokenizer, vocab_size).wrapper, n_vocab=vocab_size, eos_token=eos
            )

    def compile(self, kind: str, value) -> str:
        """A grammar for ``kind``: ``json_schema`` (a schema dict), ``json_object`` (any JSON object), ``regex``
        (a pattern), ``choice`` (a list of strings) or ``lark`` (llguidance's lark text: a forced tool call).
        Raises UserError with llguidance's reason when the grammar is not valid."""
        llg = _llguidance()
        M = llg.LLMatcher
        try:
            if kind == "json_object":
                grammar = M.grammar_from_json_schema({"type": "object"}, overrides=JSON_LAYOUT)
            elif kind == "json_schema":
                grammar = M.grammar_from_json_schema(json.dumps(value), overrides=JSON_LAYOUT)
            elif kind == "regex":
                grammar = M.grammar_from_regex(value)
            elif kind == "lark":
                grammar = M.grammar_from_lark(value)
            elif kind == "choice":
                if not value:
                    raise UserError("a choice needs at least one string")
                grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
            else:
                raise ValueError(kind)
        except (ValueError, TypeError) as err:
            raise UserError(f"{kind}: {err}") from None
        error = M.validate_grammar(grammar, self.tokenizer)
        if error:
            raise UserError(f"{kind}: {error.splitlines()[0]}")
        return grammar

    def constraint(self, grammar: str) -> Constraint:
        return Constraint(self, grammar)


def _byte_table() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's), character -> byte: printable bytes stand for themselves, the
    others are shifted to U+0100 and up."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = sorted(set(range(256)) - set(printable))
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def _has_text_added_tokens(hf_tokenizer) -> bool:
    """Whether a byte-level BPE tokenizer has added tokens that are text, not special (Qwen3's ``<think>``,
    ``<tool_call>``). llguidance's reader of tokenizer.json takes every added token for a special one, which a
    grammar's text could never match; :class:`_Tokens` reads such a tokenizer right."""
    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer")) and spec.get("model", {}).get("type") == "BPE"
    return byte_level and any(not t.get("special") for t in spec.get("added_tokens", []))


class _Tokens:
    """A tokenizer as llguidance's ``TokenizerWrapper`` reads it: each token's bytes (ids past the tokenizer's
    vocabulary are empty), its special tokens and an encoder. ``byte_level``: the bytes are read from a
    byte-level BPE vocabulary and the added tokens' text, and only the added tokens marked special are special;
    else each token's text alone, decoded."""

    def __init__(self, hf_tokenizer, vocab_size: int, byte_level: bool = False):
        llg = _llguidance()
        self.eos_token_id, self.bos_token_id = hf_tokenizer.eos_token_id, hf_tokenizer.bos_token_id
        if byte_level:
            table = _byte_table()
            self.tokens = [b""] * vocab_size
            for text, i in hf_tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False).items():
                if i < vocab_size:
                    self.tokens[i] = bytes(table[c] for c in text)
            added = hf_tokenizer.added_tokens_decoder
            for i, token in added.items():
                if i < vocab_size:
                    self.tokens[i] = token.content.encode()
            self.special_token_ids = [i for i, token in added.items() if token.special and i < vocab_size]
        else:
            n = min(len(hf_tokenizer), vocab_size)
            self.tokens = [hf_tokenizer.decode([i]).encode() for i in range(n)] + [b""] * (vocab_size - n)
            self.special_token_ids = list(hf_tokenizer.all_special_ids)
        self._tokenizer = hf_tokenizer
        self.wrapper = llg.TokenizerWrapper(self)

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


class Constraint:
    """One request's grammar state: the tokens committed so far."""

    def __init__(self, grammars: Grammars, grammar: str):
        llg = _llguidance()
        self.grammars, self._fill = grammars, llg.numpy.fill_next_token_bitmask
        self.matcher = llg.LLMatcher(grammars.tokenizer, grammar)
        if self.matcher.is_error():
            raise UserError(f"the grammar does not compile: {self.matcher.get_error()}")

    def consume(self, tokens: Sequence[int]) -> None:
        """Commit tokens (each allowed by the mask it was picked under). A token the grammar cannot take
        (a stop token after the grammar ended) leaves the state as it is."""
        for tok in tokens:
            if self.matcher.is_stopped():
                return
            if not self.matcher.consume_token(int(tok)):
                raise RuntimeError(f"grammar state lost at token {tok}: {self.matcher.get_error()}")

    def mask(self, out_W: np.ndarray) -> None:
        """The current state's allowed tokens into ``out_W`` (int32 [W])."""
        self._fill(self.matcher, out_W[None], 0)

    def tree_masks(self, tree, drafts_KN: np.ndarray | None, out_TW: np.ndarray, *, aware: bool) -> np.ndarray:
        """For a step of ``tree`` (T = size + 1 nodes) drafted as ``drafts_KN`` (the draft's candidates per
        depth, [K, N] target ids; None for a plain step): each node's mask after its own path into
        ``out_TW`` and the nodes' tokens [T - 1], returned. With ``aware`` a node's token is the first of its
        depth's candidates that the grammar allows at its parent and no earlier sibling took, or the token
        the grammar forces there; else (and when neither exists) the draft's own candidate."""
        self.mask(out_TW[0])
        T = tree.size + 1
        parents, depths, ranks = (-1, *tree.parents), (0, *tree.depths), (0, *tree.ranks)
        tokens = np.zeros(T, np.int64)
        valid = np.zeros(T, bool)
        valid[0] = True
        taken: dict[int, set[int]] = {}
        for i in range(1, T):
            p = parents[i]
            tok = int(drafts_KN[depths[i] - 1, ranks[i]])
            siblings = taken.setdefault(p, set())
            if aware and valid[p]:
                tok = self._best(out_TW[p], drafts_KN[depths[i] - 1], siblings, tok)
            siblings.add(tok)
            tokens[i] = tok
            path = []
            j = i
            while j > 0:
                path.append(int(tokens[j]))
                j = parents[j]
            path.reverse()
            done = self.matcher.try_consume_tokens(path) if valid[p] else 0
            valid[i] = done == len(path)
            if valid[i]:
                self.mask(out_TW[i])
            else:  # the grammar forbids this path: the node is never accepted, its mask never used
                out_TW[i] = ALL
            self.matcher.rollback(done)
        return tokens[1:]

    @staticmethod
    def _allows(mask_W: np.ndarray, tok: int) -> bool:
        return bool((int(mask_W[tok >> 5]) >> (tok & 31)) & 1)

    def _best(self, mask_W: np.ndarray, candidates_N: np.ndarray, taken: set[int], drafted: int) -> int:
        """The first candidate the mask allows and no sibling took; the forced token; else ``drafted``."""
        for c in candidates_N:
            c = int(c)
            if c not in taken and c < self.grammars.vocab and self._allows(mask_W, c):
                return c
        bits = np.unpackbits(mask_W.view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: self.grammars.vocab])
        if len(allowed) == 1 and int(allowed[0]) not in taken:
            return int(allowed[0])
        return drafted
