"""What the stages of a text-level parser pass each other, and the one helper every stage holds text back with.

A :class:`~peagle_jax.chat.parsers.compose.TextParser` runs up to two stages: a reasoning parser splits the
answer into reasoning and the rest, and a tool parser splits the rest into content and tool calls. Both read
text in chunks of any size and keep what they cannot classify yet; :func:`partial_suffix` says how much of a
chunk's tail must wait because it may still grow into a marker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol

from peagle_jax.chat.output import ToolCallDelta

# What a tool parser emits, in the order of the answer: content text, or a piece of a tool call (the first
# piece of a call carries its id and name; it marks where the call starts).
Event = str | ToolCallDelta
NewId = Callable[[], str]


def partial_suffix(text: str, *markers: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of one of ``markers``: the part that
    may still grow into a marker and so cannot be released yet (0 when none can)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class ReasoningParser(Protocol):
    """Splits the answer into reasoning and the rest, chunk by chunk."""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and the answer text this chunk releases (the reasoning always comes first in the
        answer, so a chunk releases reasoning, then text). ``final``: release everything held back."""
        ...


class ToolParser(Protocol):
    """Splits answer text into content and tool calls, chunk by chunk.

    ``start`` is the text that starts a call in this syntax; ``start_anywhere`` says whether a call may start
    after other text (``<tool_call>``) or only at the start of the answer (Llama 3's bare ``{``). A reasoning
    parser ends the reasoning at ``start`` only when ``start_anywhere``.
    """

    start: ClassVar[str]
    start_anywhere: ClassVar[bool]

    def feed(self, text: str, final: bool = False) -> list[Event]:
        """The content and call pieces this chunk releases, in order. ``final``: release everything held back
        (an unfinished call is ended as far as it went or, if it was never announced, released as content)."""
        ...


class CallBody(Protocol):
    """One call's text after its start marker, read as it arrives (the syntax-specific part of a tool parser).

    ``status``: ``"more"`` (needs more text), ``"done"`` (the call ended; ``rest`` is the text after it, not
    part of it) or ``"fail"`` (the text is not a call; nothing was emitted and ``text`` holds everything fed,
    to be read again as content). A body fails only before it announces the call (its first piece, with the
    name); an announced call never fails: an error ends it and the rest goes back as text.
    """

    status: str
    text: str
    rest: str

    def feed(self, text: str, final: bool = False) -> list[ToolCallDelta]: ...
