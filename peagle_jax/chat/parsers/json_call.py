"""One tool call written as a JSON object, ``{"name": "f", "arguments": {...}}``, read as it arrives."""

from __future__ import annotations

import json
import re

from peagle_jax.chat.output import ToolCallDelta
from peagle_jax.chat.parsers.base import NewId
from peagle_jax.chat.parsers.json_value import JsonValue

ARGUMENT_KEYS = ("arguments", "parameters")
_NON_SPACE = re.compile(r"\S")
_VALUE_START = frozenset('{["-0123456789tfn')


def _decode(raw: str) -> str | None:
    """A complete JSON string's value (None: a broken escape)."""
    try:
        return json.loads(raw, strict=False)
    except ValueError:
        return None


class JsonCall:
    """The body of one JSON call (a :class:`~peagle_jax.chat.parsers.base.CallBody`): Hermes' text between
    ``<tool_call>`` and ``</tool_call>``, or one of Llama 3's calls.

    Invariants:

    - The call is announced (a piece with ``id`` and ``name``) as soon as the name string is complete, never
      before, so a text that turns out not to be a call (not an object, no name, a key other than ``name``,
      ``arguments`` or ``parameters`` before the name) emitted nothing and is released as content.
    - The arguments sent are raw substrings of the model's text, in order: they concatenate to exactly the
      value of ``"arguments"`` (or ``"parameters"``) as written. A value that came before the name is sent
      whole with the name; a string value (arguments given as JSON text in a string) is sent decoded, whole.
    - A call that ends (its object closes, or unexpected text follows its name) and sent no arguments gets
      ``{}``; a call cut off by the end of the answer keeps the arguments as far as they went.
    """

    def __init__(self, index: int, new_id: NewId):
        self.index, self._new_id = index, new_id
        self.status, self.text, self.rest = "more", "", ""
        self._pos = 0
        self._state = "open"  # open, first_key, key, colon, value_start, value, after_value
        self._role = ""  # of the value being read: key, name, args or skip
        self._value = JsonValue()
        self._value_start = 0
        self._key = ""
        self._announced = False
        self._args_seen = False  # an arguments value started (a second one is not a call's)
        self._args_early: str | None = None  # arguments read before the name, sent with it
        self._args_sent_to = 0  # how far into ``text`` streamed arguments were sent
        self._sent_args = False

    def feed(self, text: str, final: bool = False) -> list[ToolCallDelta]:
        self.text += text
        out: list[ToolCallDelta] = []
        while self.status == "more" and self._step(out, final):
            pass
        if final and self.status == "more":
            self._end(out, closed=False)
        return out

    def _step(self, out: list[ToolCallDelta], final: bool) -> bool:
        """Read one token (or as much of a value as has arrived); False when more text is needed."""
        if self._state == "value":
            return self._read_value(out, final)
        match = _NON_SPACE.search(self.text, self._pos)
        if match is None:
            self._pos = len(self.text)
            return False
        self._pos = match.start()
        char, state = match.group(), self._state
        if state == "open" and char == "{":
            self._state, self._pos = "first_key", self._pos + 1
        elif state in ("first_key", "key") and char == '"':
            self._start_value("key")
        elif state in ("first_key", "after_value") and char == "}":
            self._pos += 1
            self._end(out, closed=True)
        elif state == "colon" and char == ":":
            self._state, self._pos = "value_start", self._pos + 1
        elif state == "after_value" and char == ",":
            self._state, self._pos = "key", self._pos + 1
        elif state == "value_start" and char in _VALUE_START:
            if self._key == "name" and not self._announced and char == '"':
                self._start_value("name")
            elif self._key in ARGUMENT_KEYS and not self._args_seen:
                self._args_seen = True
                self._args_sent_to = self._pos
                self._start_value("args")
            elif self._announced:
                self._start_value("skip")
            else:
                self._end(out, closed=True)
        else:
            self._end(out, closed=True)  # text a call cannot hold here
        return True

    def _start_value(self, role: str) -> None:
        self._state, self._role = "value", role
        self._value, self._value_start = JsonValue(), self._pos

    def _read_value(self, out: list[ToolCallDelta], final: bool) -> bool:
        value, role = self._value, self._role
        self._pos, complete = value.scan(self.text, self._pos, final)
        streaming = role == "args" and self._announced and value.kind == "container"
        if streaming:
            self._send_args(out, self.text[self._args_sent_to : self._pos])
            self._args_sent_to = self._pos
        if not complete:
            return False
        raw = self.text[self._value_start : self._pos]
        self._state = "after_value"
        word = _decode(raw) if role in ("key", "name") else None
        if role in ("key", "name") and (word is None or role == "name" and not word):  # broken, or no name
            self._pos = self._value_start
            self._end(out, closed=True)
        elif role == "key":
            self._key, self._state = word, "colon"
        elif role == "name":
            self._announced = True
            out.append(ToolCallDelta(self.index, id=self._new_id(), name=word))
            self._send_args(out, self._args_early or "")
        elif role == "args" and not streaming:
            text = raw if value.kind == "container" else (_decode(raw) or "") if value.kind == "string" else ""
            if self._announced:
                self._send_args(out, text)
            else:
                self._args_early = text
        return True

    def _send_args(self, out: list[ToolCallDelta], text: str) -> None:
        if text:
            out.append(ToolCallDelta(self.index, arguments=text))
            self._sent_args = True

    def _end(self, out: list[ToolCallDelta], closed: bool) -> None:
        """End the call at ``_pos``: ``closed`` by its object's ``}`` or by text a call cannot hold there (that
        text is the ``rest``), or else cut off by the end of the answer. A call never announced fails."""
        if not self._announced:
            self.status = "fail"
            return
        if not closed:
            if self._state == "value" and self._role == "args" and self._value.kind == "container":
                self._send_args(out, self.text[self._args_sent_to :])  # a backslash held for its escape
            self._pos = len(self.text)
        elif not self._sent_args:
            self._send_args(out, "{}")
        self.status, self.rest = "done", self.text[self._pos :]
