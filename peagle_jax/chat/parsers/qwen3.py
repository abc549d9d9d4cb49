"""``qwen3``: Qwen3's reasoning, ``<think>...</think>`` at the start of the answer."""

from __future__ import annotations

from peagle_jax.chat.parsers.base import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


class Qwen3ReasoningParser:
    """Splits the answer into reasoning (between ``<think>`` and ``</think>``) and the rest.

    ``in_reasoning``: the prompt already ends inside an open ``<think>`` (a thinking model's template opens
    it), so the answer starts as reasoning, with no tag. ``tool_start``: the marker that starts a tool call
    (``<tool_call>``); a call that starts inside the reasoning ends it, and the marker and all after it are
    answer text for the tool parser.

    Invariants: ``<think>`` counts only at the start of the answer (after whitespace), so a ``<think>`` in
    the content is content; reasoning is released up to the last character that cannot start ``</think>``
    or the tool marker; reasoning cut off by the end of the answer (no ``</think>``) is all reasoning. The
    whitespace the tags bring (``<think>\\n``, ``\\n</think>\\n\\n``) is trimmed later, by the composition.
    """

    def __init__(self, *, in_reasoning: bool = False, tool_start: str | None = None):
        self._state = "think" if in_reasoning else "start"  # start (of the answer), think, answer
        self._ends = (CLOSE, tool_start) if tool_start else (CLOSE,)
        self._buf = ""  # text held back

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        buf, self._buf = self._buf + text, ""
        if self._state == "start":
            tail = buf.lstrip()
            if tail.startswith(OPEN):
                buf, self._state = tail[len(OPEN) :], "think"
            elif OPEN.startswith(tail) and not final:
                self._buf = buf  # whitespace, or the start of <think>, so far
                return "", ""
            else:
                self._state = "answer"
        if self._state == "answer":
            return "", buf
        ends = [(at, end) for end in self._ends if (at := buf.find(end)) >= 0]
        if ends:
            at, end = min(ends)
            self._state = "answer"
            return buf[:at], buf[at + len(CLOSE) :] if end == CLOSE else buf[at:]
        cut = len(buf) - (0 if final else partial_suffix(buf, *self._ends))
        self._buf = buf[cut:]
        return buf[:cut], ""
