"""``llama3_json``: Llama 3.1's and 3.2's JSON tool calls.

The whole answer is the calls: ``{"name": "get_weather", "parameters": {"city": "Paris"}}``, several joined by
``;`` (with optional whitespace). An answer that does not start with ``{`` (after whitespace) is content.
"""

from __future__ import annotations

from typing import ClassVar

from peagle_jax.chat.output import call_id
from peagle_jax.chat.parsers.base import Event, NewId
from peagle_jax.chat.parsers.json_call import JsonCall


class Llama3JsonToolParser:
    """Calls as JSON objects at the start of the answer (:class:`JsonCall`, so the arguments stream).

    Invariants: the answer is held only while it may still be a call (leading whitespace; an object until its
    name is read); an object that is not a call is released as content, verbatim, with all that follows it.
    After a call, text other than ``;`` and another object is content (a lone ``;`` included), and so is
    everything after it: calls come only first.
    """

    start: ClassVar[str] = "{"
    start_anywhere: ClassVar[bool] = False

    def __init__(self, tools: list[dict] | None = None, *, new_id: NewId = call_id):
        self._new_id = new_id
        self._buf = ""  # text fed and not yet read
        self._state = "start"  # start (of the answer), call, between (calls), content
        self._call: JsonCall | None = None
        self._lead = ""  # the whitespace and ";" before the current call, content if it is no call
        self._calls = 0

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._advance(out, final):
            pass
        return out

    def _advance(self, out: list[Event], final: bool) -> bool:
        """Read as far as the current state allows; True when the state changed and reading goes on."""
        buf = self._buf
        if self._state == "content":
            if buf:
                out.append(buf)
            self._buf = ""
            return False
        if self._state == "call":
            call = self._call
            out.extend(call.feed(buf, final))
            self._buf = ""
            if call.status == "more":
                return False
            if call.status == "fail":
                self._buf, self._state = self._lead + call.text, "content"
            else:
                self._calls += 1
                self._buf, self._state = call.rest, "between"
            return True
        tail = buf.lstrip()
        if self._state == "between":
            if tail.startswith(";"):
                tail = tail[1:].lstrip()
            elif tail:
                self._state = "content"  # not a separator
                return True
        if not tail and not final:
            return False  # whitespace (and a ";") so far
        if tail.startswith("{"):
            self._lead = buf[: len(buf) - len(tail)]
            self._call, self._state = JsonCall(self._calls, self._new_id), "call"
            self._buf = tail
        else:
            self._state = "content"
        return True
