"""GPT-OSS's answer parsed token by token from its harmony messages (:class:`HarmonyParser`).

The answer starts right after the prompt's ``<|start|>assistant``, so its first message's header begins at once
(``<|channel|>analysis<|message|>``); later ones start ``<|start|>assistant``. A header (role, ``<|channel|>NAME``,
an optional recipient ``to=R`` before or after the channel, an optional content type ``<|constrain|>json`` or
`` json``) ends at ``<|message|>``; the content ends at ``<|end|>``, ``<|return|>`` or ``<|call|>``, or where the
answer ends (the last two are stop tokens, which the server may strip).

What each message becomes: ``analysis`` -> reasoning; ``final`` and a ``commentary`` without a recipient (a
preamble) -> content; a message to ``functions.X`` -> a call of ``X``, to any other recipient (``browser.search``,
``python``) -> a call under that full name. A call's name is sent as soon as its header is complete, then its
arguments as the content streams. Text outside any message (the model ignoring the format) is content; a header
cut off by the end of the answer is dropped.

Every decision depends on the token ids alone, read one at a time, so the result does not depend on how the
answer is chunked. Content is decoded as it comes and held back while the decoded tail is U+FFFD (a character
split across tokens), so no half character is ever sent.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from peagle_jax.chat.harmony_render import (
    CALL_ID,
    CHANNEL,
    CHANNEL_ID,
    CONSTRAIN,
    END_ID,
    FIRST_SPECIAL_ID,
    MESSAGE_ID,
    RETURN_ID,
    SPECIAL_TEXT,
    START_ID,
)
from peagle_jax.chat.output import Delta, Parsed, ToolCall, ToolCallDelta, call_id

ENDS = (END_ID, RETURN_ID, CALL_ID)
# a header longer than this without <|message|> is not a header: its text (and what follows) is content
MAX_HEADER_TOKENS = 128
_CHANNEL_VALUE = re.compile(r"[^\s<]*")


def parse_header(header: str, has_role: bool) -> tuple[str | None, str | None, str | None]:
    """(channel, recipient, content type) of a header's text (its special tokens written out); ``has_role``:
    it begins with the author's role (a message after ``<|start|>``), which is skipped."""
    channel = None
    at = header.find(CHANNEL)
    if at >= 0:
        rest = header[at + len(CHANNEL) :]
        value = _CHANNEL_VALUE.match(rest).group()
        channel = value or None
        header = header[:at] + " " + rest[len(value) :]
    words = header.replace(CONSTRAIN, " " + CONSTRAIN).split()
    if has_role and words and not words[0].startswith(("to=", CONSTRAIN)):
        words = words[1:]
    recipient = content_type = None
    for word in words:
        if word.startswith("to="):
            recipient = word[3:] or None
        else:
            content_type = word
    return channel, recipient, content_type


class HarmonyParser:
    """An :class:`~peagle_jax.chat.output.OutputParser` of GPT-OSS's harmony answer, reading token ids.

    ``decode``: the model tokenizer's ``ids -> text`` (invalid UTF-8 replaced by U+FFFD); ``new_call_id``: the
    ids given to tool calls (OpenAI's ``call_...`` by default)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], new_call_id: Callable[[], str] = call_id):
        self._decode, self._new_call_id = decode, new_call_id
        self._content, self._reasoning = "", ""
        self._calls: list[ToolCall] = []
        self._header: list[int] | None = []  # the ids of the header being read; None: not in a header
        self._has_role = False  # the header began with <|start|>, so with the role
        self._kind: str | None = None  # the current message's: "content", "reasoning", "call"; None: between them
        self._pending: list[int] = []  # content ids not yet sent (their text ends in a split character)
        self._last_kind: str | None = None
        self._delta = Delta()

    @property
    def ended_with_call(self) -> bool:
        """The answer's last message is a tool call (the choice's finish_reason is ``tool_calls``)."""
        return self._last_kind == "call"

    def feed(self, text: str, ids: Sequence[int], final: bool = False) -> Delta:
        """Read the next chunk's token ids (``text`` is not read); ``final``: the answer ends here."""
        self._delta = Delta()
        for tid in ids:
            self._step(int(tid))
        if final:
            if self._header is not None:
                self._end_header(complete=False)
            self._end_message()
        return self._delta

    def result(self) -> Parsed:
        calls = [ToolCall(c.id, c.name, c.arguments) for c in self._calls]
        return Parsed(self._content or None, self._reasoning or None, calls)

    def _step(self, tid: int) -> None:
        if self._header is not None:
            if tid == MESSAGE_ID:
                self._end_header(complete=True)
            elif tid in ENDS or tid == START_ID:
                self._end_header(complete=False)
                if tid == START_ID:
                    self._header, self._has_role = [], True
            else:
                self._header.append(tid)
                if len(self._header) > MAX_HEADER_TOKENS:
                    self._header_to_content(self._header)
                    self._send_text(final=False)
        elif tid == START_ID or (tid == CHANNEL_ID and self._kind is None):
            # a new message; <|channel|> outside a message begins a header whose <|start|>assistant is missing
            self._end_message()
            self._header, self._has_role = ([] if tid == START_ID else [tid]), tid == START_ID
        elif tid in ENDS:
            self._end_message()
        elif self._kind is not None:
            self._pending.append(tid)
            self._send_text(final=False)
        elif tid < FIRST_SPECIAL_ID:
            # text outside any message: content
            self._begin("content")
            self._pending.append(tid)
            self._send_text(final=False)

    def _end_header(self, complete: bool) -> None:
        """At ``<|message|>`` (``complete``) begin the message; at any other end, drop the header, unless it is
        the answer's unstructured first text (no ``<|start|>``, no ``<|channel|>``, no beginning of ``to=``):
        that is content."""
        header, self._header = self._header, None
        if complete:
            channel, recipient, _ = parse_header(self._header_text(header), self._has_role)
            if recipient is not None and recipient != "assistant":
                self._begin("call", recipient.removeprefix("functions."))
            else:
                self._begin("reasoning" if channel == "analysis" else "content")
        elif header and not self._has_role and CHANNEL_ID not in header and not self._recipient_start(header):
            self._header_to_content(header)
            self._end_message()

    def _recipient_start(self, header: list[int]) -> bool:
        """The header's text is (the beginning of) a recipient ``to=...``."""
        text = self._header_text(header).lstrip()
        return text.startswith("to=") or "to=".startswith(text)

    def _header_text(self, header: list[int]) -> str:
        """A header's text, its special tokens written out."""
        out, run = [], []
        for tid in [*header, None]:
            if tid is None or tid in SPECIAL_TEXT:
                out += [self._decode(run)] if run else []
                out.append(SPECIAL_TEXT.get(tid, ""))
                run = []
            else:
                run.append(tid)
        return "".join(out)

    def _header_to_content(self, header: list[int]) -> None:
        """The header is no header: its text (special tokens left out) is content, as is what follows it up to
        the next message end."""
        self._header = None
        self._begin("content")
        self._pending = [tid for tid in header if tid not in SPECIAL_TEXT]

    def _begin(self, kind: str, name: str | None = None) -> None:
        self._kind = self._last_kind = kind
        if kind == "call":
            call = ToolCall(self._new_call_id(), name, "")
            self._delta.tool_calls.append(ToolCallDelta(len(self._calls), call.id, call.name))
            self._calls.append(call)

    def _end_message(self) -> None:
        self._send_text(final=True)
        self._kind = None

    def _send_text(self, final: bool) -> None:
        """Send the pending content ids' text unless it ends in a split character (``final``: send it anyway)."""
        if not self._pending:
            return
        text = self._decode(self._pending)
        if text.endswith("\ufffd") and not final:
            return
        self._pending = []
        self._emit(text)

    def _emit(self, text: str) -> None:
        if not text:
            return
        d = self._delta
        if self._kind == "reasoning":
            self._reasoning += text
            d.reasoning += text
        elif self._kind == "content":
            self._content += text
            d.content += text
        else:
            index = len(self._calls) - 1
            self._calls[index].arguments += text
            if d.tool_calls and d.tool_calls[-1].index == index:
                d.tool_calls[-1].arguments += text
            else:
                d.tool_calls.append(ToolCallDelta(index, arguments=text))
