"""The text-level :class:`~peagle_jax.chat.output.OutputParser`: a reasoning parser, then a tool parser."""

from __future__ import annotations

from collections.abc import Sequence

from peagle_jax.chat.output import Delta, Parsed, ToolCall, ToolCallDelta
from peagle_jax.chat.parsers.base import ReasoningParser, ToolParser


class Trimmed:
    """One channel of text (content or reasoning) with the whitespace at its ends removed, as it streams.

    Whitespace is held back until text other than whitespace follows it (then it is sent with that text), so
    the channel never sends leading or trailing whitespace, and a channel of only whitespace sends nothing.
    :meth:`cut` drops the whitespace held (the content's whitespace just before a tool call).
    """

    def __init__(self):
        self._held = ""
        self._started = False

    def push(self, text: str) -> str:
        body = text.rstrip()
        if not body:
            if self._started:
                self._held += text
            return ""
        out = self._held + body if self._started else body.lstrip()
        self._held, self._started = text[len(body) :], True
        return out

    def cut(self) -> None:
        self._held = ""


class TextParser:
    """An optional reasoning parser in front of an optional tool parser, fed text (the ids are not read).

    Without a reasoning parser the whole answer goes to the tool parser; without a tool parser there are no
    calls and all markup is content. Invariants (on top of :class:`~peagle_jax.chat.output.OutputParser`'s):
    content and reasoning are trimmed of the whitespace at their ends (``<think>\\nreasoning\\n</think>\\n\\n
    answer`` gives ``reasoning`` and ``answer``) and of the whitespace just before a tool call; either is None
    in the result when nothing else is left. The result is built from the deltas, so it is their sum.
    """

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None):
        self._reasoning_parser, self._tool_parser = reasoning, tools
        self._thought, self._said = Trimmed(), Trimmed()
        self._content, self._reasoning = "", ""
        self._calls: list[ToolCall] = []
        self._ended = False

    def feed(self, text: str, ids: Sequence[int] = (), final: bool = False) -> Delta:
        if self._ended:
            if text:
                raise ValueError("the answer already ended")
            return Delta()
        self._ended = final
        reasoning, answer = self._reasoning_parser.feed(text, final) if self._reasoning_parser else ("", text)
        delta = Delta(reasoning=self._thought.push(reasoning))
        for event in self._tool_parser.feed(answer, final) if self._tool_parser else [answer]:
            if isinstance(event, str):
                delta.content += self._said.push(event)
                continue
            if event.name is not None:
                self._said.cut()
            if delta.tool_calls and delta.tool_calls[-1].index == event.index:
                delta.tool_calls[-1].arguments += event.arguments
            else:
                delta.tool_calls.append(ToolCallDelta(event.index, event.id, event.name, event.arguments))
        self._record(delta)
        return delta

    def _record(self, delta: Delta) -> None:
        self._content += delta.content
        self._reasoning += delta.reasoning
        for piece in delta.tool_calls:
            if piece.name is not None:
                self._calls.append(ToolCall(piece.id, piece.name, ""))
            self._calls[piece.index].arguments += piece.arguments

    def result(self) -> Parsed:
        calls = [ToolCall(call.id, call.name, call.arguments) for call in self._calls]
        return Parsed(self._content or None, self._reasoning or None, calls)
