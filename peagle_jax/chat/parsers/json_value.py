"""Where one JSON value ends, found in text that arrives piece by piece."""

from __future__ import annotations

import re

_IN_STRING = re.compile(r'["\\]')
_IN_CONTAINER = re.compile(r'["{}\[\]]')
_AFTER_SCALAR = re.compile(r"[\s,}\]]")


class JsonValue:
    """Scans one JSON value, from its first character to its end, keeping its state between pieces of text.

    Only the value's extent is found, not its validity: brackets are counted (``{`` and ``[`` alike) outside
    strings, strings end at an unescaped ``"``, a scalar (number, ``true``, ``null``...) ends before
    whitespace, ``,``, ``}`` or ``]``. Invariant: :meth:`scan` never stops between a backslash and the
    character it escapes, so a position it returns is always a safe place to resume (or to cut the text).
    """

    def __init__(self):
        self.kind: str | None = None  # "container", "string" or "scalar", known from the first character
        self._depth = 0
        self._in_string = False

    def scan(self, text: str, pos: int, final: bool = False) -> tuple[int, bool]:
        """Read ``text`` from ``pos`` (the value's first character on the first call, then the position the
        last call returned). Returns the position reached and whether the value ended there (a scalar cut by
        the end of the text ends there only when ``final``)."""
        if self.kind is None:
            first = text[pos]
            if first in "{[":
                self.kind, self._depth, pos = "container", 1, pos + 1
            elif first == '"':
                self.kind, self._in_string, pos = "string", True, pos + 1
            else:
                self.kind = "scalar"
        if self.kind == "scalar":
            match = _AFTER_SCALAR.search(text, pos)
            return (match.start(), True) if match else (len(text), final)
        while True:
            if self._in_string:
                match = _IN_STRING.search(text, pos)
                if match is None:
                    return len(text), False
                if match.group() == "\\":
                    if match.end() == len(text):
                        return match.start(), False  # the escaped character is not here yet
                    pos = match.end() + 1
                    continue
                pos, self._in_string = match.end(), False
                if self.kind == "string":
                    return pos, True
            else:
                match = _IN_CONTAINER.search(text, pos)
                if match is None:
                    return len(text), False
                pos, char = match.end(), match.group()
                if char == '"':
                    self._in_string = True
                elif char in "{[":
                    self._depth += 1
                else:
                    self._depth -= 1
                    if self._depth == 0:
                        return pos, True
