"""What an output parser returns: the answer split into ``content``, ``reasoning`` and ``tool_calls``.

A parser is fed the answer as it is generated, in chunks of any size (one token, the several tokens of a
speculative step, the whole answer), and returns a :class:`Delta` per chunk: the new content, the new
reasoning and the new pieces of tool calls. The invariant every parser keeps, whatever the chunking: the
deltas concatenated equal :meth:`OutputParser.result` (content with content, reasoning with reasoning, each
call's ``arguments`` chunks with its final ``arguments``), and the result does not depend on the chunking.
A parser holds back text that may still turn into markup (a tail ``<tool`` may become ``<tool_call>``), so
nothing sent as content is ever taken back.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from typing import Protocol


def call_id() -> str:
    """A new tool call's id, in the OpenAI form (``call_`` and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


@dataclasses.dataclass
class ToolCallDelta:
    """A piece of tool call ``index`` (0, 1, ... in the order the calls start): its first delta carries the
    ``id`` and the ``name``, later ones only ``arguments`` chunks (pieces of the arguments' JSON text)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclasses.dataclass
class Delta:
    """What one chunk of the answer added."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


@dataclasses.dataclass
class ToolCall:
    """One finished tool call; ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclasses.dataclass
class Parsed:
    """The whole answer, parsed. ``content`` and ``reasoning`` are None when the answer had none."""

    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]


class OutputParser(Protocol):
    """One choice's parser: fed the answer chunk by chunk, then asked for the result."""

    def feed(self, text: str, ids: Sequence[int], final: bool = False) -> Delta:
        """Take the next chunk: its text (decoded without special tokens) and its token ids (a token-level
        parser reads the ids, a text-level one the text). ``final``: the answer ends with this chunk (possibly
        empty), so everything held back is released (an unfinished call is parsed as far as it goes or, when
        it cannot be, released as content)."""
        ...

    def result(self) -> Parsed:
        """The answer parsed so far (the whole answer after a ``final`` chunk)."""
        ...
