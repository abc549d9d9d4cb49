"""Tool calls between ``<tool_call>`` and ``</tool_call>`` tags, anywhere in the answer (Qwen's syntaxes)."""

from __future__ import annotations

from typing import ClassVar

from peagle_jax.chat.output import call_id
from peagle_jax.chat.parsers.base import CallBody, Event, NewId, partial_suffix


class TaggedToolParser:
    """The framing shared by Hermes' JSON calls and Qwen3-Coder's XML calls; a subclass reads a call's body.

    Text outside the tags is content. Invariants: content is released up to the last character that cannot
    start a ``<tool_call>`` (a tail ``<tool`` waits for the next chunk, or the end); a tag whose body turns out
    not to be a call is released as content, verbatim, and the text after it is read again (it may hold a
    real call); after a call, whitespace and ``</tool_call>`` are dropped (an end tag cut off by the end of
    the answer too), and any other text is content again.
    """

    start: ClassVar[str] = "<tool_call>"
    end: ClassVar[str] = "</tool_call>"
    start_anywhere: ClassVar[bool] = True

    def __init__(self, tools: list[dict] | None = None, *, new_id: NewId = call_id):
        self._tools = tools or []
        self._new_id = new_id
        self._buf = ""  # text fed and not yet read
        self._state = "text"  # text, call, close
        self._call: CallBody | None = None
        self._calls = 0  # calls announced so far: the next call's index

    def _body(self, index: int) -> CallBody:
        raise NotImplementedError

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._advance(out, final):
            pass
        return out

    def _advance(self, out: list[Event], final: bool) -> bool:
        """Read as far as the current state allows; True when the state changed and reading goes on."""
        buf = self._buf
        if self._state == "text":
            at = buf.find(self.start)
            if at < 0:
                cut = len(buf) - (0 if final else partial_suffix(buf, self.start))
                _content(out, buf[:cut])
                self._buf = buf[cut:]
                return False
            _content(out, buf[:at])
            self._buf, self._state = buf[at + len(self.start) :], "call"
            self._call = self._body(self._calls)
            return True
        if self._state == "call":
            call = self._call
            out.extend(call.feed(buf, final))
            self._buf = ""
            if call.status == "more":
                return False
            if call.status == "fail":
                _content(out, self.start)
                self._buf, self._state = call.text, "text"
            else:
                self._calls += 1
                self._buf, self._state = call.rest, "close"
            return True
        tail = buf.lstrip()
        if tail.startswith(self.end):
            self._buf = tail[len(self.end) :]
        elif self.end.startswith(tail):  # only whitespace and the start of the end tag so far
            if not final:
                return False
            self._buf = ""
        self._state = "text"
        return True


def _content(out: list[Event], text: str) -> None:
    if text:
        out.append(text)
