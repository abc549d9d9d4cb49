"""Log-probabilities in the OpenAI response shapes, from the engine's per-token values
(:attr:`peagle_jax.serve.slots.SlotEvent.logprobs`: the target's raw log-probabilities, the same with and
without speculation).

- chat (``logprobs: true``, ``top_logprobs`` 0..20): ``choices[i].logprobs = {"content": [{"token",
  "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": None}``, in a
  stream the entries of each chunk's tokens;
- completions (``logprobs`` 0..20): ``choices[i].logprobs = {"tokens", "token_logprobs", "top_logprobs"
  (one dict token -> logprob per token: the top ``logprobs`` and the chosen token, so up to logprobs + 1
  entries, as the OpenAI API says), "text_offset"}``.

A token's text is its own decoding (``tokenizer.decode([id])``; without a tokenizer, ``"<id>,"`` as the
text the server answers); ``bytes`` are that text's UTF-8 bytes. A token that is part of a multi-byte
character decodes alone to U+FFFD, as in vLLM's detokenized log-probabilities.
"""

from __future__ import annotations


class LogprobsWriter:
    """Formats one request's token log-probabilities: ``top`` alternatives per token (0..20)."""

    def __init__(self, tokenizer, chat: bool, top: int):
        self.tokenizer, self.chat, self.top = tokenizer, chat, top
        self.offset = 0  # completions' text_offset of the next token

    def text(self, token: int) -> str:
        if self.tokenizer is None:
            return f"{token},"
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _entry(self, token: int, logprob: float) -> dict:
        text = self.text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat_content(self, tokens: list[int], logprobs: list) -> list[dict]:
        """``logprobs.content`` entries of these tokens."""
        return [
            {**self._entry(tok, lp), "top_logprobs": [self._entry(t, v) for t, v in top[: self.top]]}
            for tok, (lp, top) in zip(tokens, logprobs, strict=True)
        ]

    def completion(self, tokens: list[int], logprobs: list) -> dict:
        """The completions ``logprobs`` object of these tokens (continuing :attr:`offset`); an entry
        ``(None, None)`` (an echoed prompt's first token) has ``null`` values."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, (lp, top) in zip(tokens, logprobs, strict=True):
            text = self.text(tok)
            alternatives = None  # an echoed prompt's first token has none
            if lp is not None:
                alternatives = {self.text(t): v for t, v in top[: self.top]}
                alternatives.setdefault(text, lp)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(alternatives)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def choice(self, tokens: list[int], logprobs: list) -> dict:
        """A choice's (or a chunk's) ``logprobs`` value for these tokens."""
        if self.chat:
            return {"content": self.chat_content(tokens, logprobs), "refusal": None}
        return self.completion(tokens, logprobs)
