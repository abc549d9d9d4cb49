"""``qwen3_coder``: Qwen3-Coder's XML tool calls.

``<tool_call>\\n<function=get_weather>\\n<parameter=city>\\nParis\\n</parameter>\\n<parameter=days>\\n3\\n
</parameter>\\n</function>\\n</tool_call>``. The values are raw text, typed by the request's tool schemas
(:mod:`peagle_jax.chat.parsers.xml_values`), and the arguments are written as JSON one parameter at a time.
"""

from __future__ import annotations

import json
import re

from peagle_jax.chat.output import ToolCallDelta
from peagle_jax.chat.parsers.base import CallBody, NewId
from peagle_jax.chat.parsers.tagged import TaggedToolParser
from peagle_jax.chat.parsers.xml_values import parameter_schemas, typed_value

FUNCTION, PARAMETER = "<function=", "<parameter="
END_FUNCTION, END_PARAMETER = "</function>", "</parameter>"
_NON_SPACE = re.compile(r"\S")


class XmlCall:
    """The body of one Qwen3-Coder call (a :class:`~peagle_jax.chat.parsers.base.CallBody`).

    Invariants:

    - The call is announced (a piece with ``id`` and ``name``, no arguments yet) at the ``>`` that ends
      ``<function=NAME``; anything else after ``<tool_call>`` (or a name holding ``<`` or a newline) is no
      call, and nothing was emitted.
    - Each parameter is sent when its ``</parameter>`` arrives (a missing one is tolerated before
      ``</function>``), as JSON with ``json.dumps``' separators: ``{"city": "Paris"``, then ``, "days": 3``;
      ``</function>`` sends ``}`` (``{}`` for a call without parameters). Unexpected text between
      parameters ends the call the same way and goes back as text. A call cut off by the end of the answer
      keeps the parameters completed so far, with no ``}`` (a parameter cut off is dropped).
    """

    def __init__(self, index: int, new_id: NewId, tools: list[dict]):
        self.index, self._new_id, self._tools = index, new_id, tools
        self.status, self.text, self.rest = "more", "", ""
        self._pos = 0
        self._state = "open"  # open, name, body, parameter, value
        self._schemas: dict[str, dict] | None = None
        self._parameter = ""
        self._tag_at = 0  # where the tag being read starts
        self._searched = 0  # the value's end tags were looked for up to here
        self._sent = 0  # parameters sent

    def feed(self, text: str, final: bool = False) -> list[ToolCallDelta]:
        self.text += text
        out: list[ToolCallDelta] = []
        while self.status == "more" and self._step(out):
            pass
        if final and self.status == "more":
            self._end(out, closed=False)
        return out

    def _step(self, out: list[ToolCallDelta]) -> bool:
        """Read one tag (or value); False when more text is needed."""
        state, text = self._state, self.text
        if state in ("open", "body"):
            match = _NON_SPACE.search(text, self._pos)
            self._pos = match.start() if match else len(text)
            tail = text[self._pos :]
            tags = (FUNCTION,) if state == "open" else (PARAMETER, END_FUNCTION)
            for tag in tags:
                if tail.startswith(tag):
                    self._tag_at, self._pos = self._pos, self._pos + len(tag)
                    if tag == END_FUNCTION:
                        self._end(out, closed=True)
                    else:
                        self._state = "name" if tag == FUNCTION else "parameter"
                    return True
            if any(tag.startswith(tail) for tag in tags):
                return False  # empty, or the start of a tag
            self._end(out, closed=True)
        elif state in ("name", "parameter"):
            close = text.find(">", self._pos)
            name = text[self._pos : close if close >= 0 else len(text)]
            if "<" in name or "\n" in name or (close >= 0 and not name.strip()):
                self._pos = self._tag_at  # a broken tag: the call (if any) ends before it
                self._end(out, closed=True)
            elif close < 0:
                return False
            elif state == "name":
                self._pos, self._state = close + 1, "body"
                self._schemas = parameter_schemas(self._tools, name.strip())
                out.append(ToolCallDelta(self.index, id=self._new_id(), name=name.strip()))
            else:
                self._pos, self._state = close + 1, "value"
                self._parameter, self._searched = name.strip(), close + 1
        else:
            start = max(self._pos, self._searched - len(END_PARAMETER) + 1)
            ends = [(at, tag) for tag in (END_PARAMETER, END_FUNCTION) if (at := text.find(tag, start)) >= 0]
            if not ends:
                self._searched = len(text)
                return False
            at, tag = min(ends)
            self._send(out, text[self._pos : at])
            self._pos, self._state = at + (len(tag) if tag == END_PARAMETER else 0), "body"
        return True

    def _send(self, out: list[ToolCallDelta], raw: str) -> None:
        schema = (self._schemas or {}).get(self._parameter)
        value = typed_value(raw, schema)
        head = "{" if self._sent == 0 else ", "
        piece = f"{head}{json.dumps(self._parameter, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        out.append(ToolCallDelta(self.index, arguments=piece))
        self._sent += 1

    def _end(self, out: list[ToolCallDelta], closed: bool) -> None:
        """End the call at ``_pos``: ``closed`` by ``</function>`` or by text a call cannot hold there (that
        text is the ``rest``), or else cut off by the end of the answer. A call never announced fails."""
        if self._state in ("open", "name"):
            self.status = "fail"
            return
        if closed:
            out.append(ToolCallDelta(self.index, arguments="}" if self._sent else "{}"))
        else:
            self._pos = len(self.text)
        self.status, self.rest = "done", self.text[self._pos :]


class Qwen3CoderToolParser(TaggedToolParser):
    """Calls as ``<function=NAME>`` with ``<parameter=NAME>`` values between ``<tool_call>`` tags."""

    def _body(self, index: int) -> CallBody:
        return XmlCall(index, self._new_id, self._tools)
