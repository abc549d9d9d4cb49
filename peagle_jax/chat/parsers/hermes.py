"""``hermes``: Qwen3's and Qwen2.5's JSON tool calls.

``<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>``, possibly several in
a row and after some content. The arguments stream as the model writes them (:class:`JsonCall`).
"""

from __future__ import annotations

from peagle_jax.chat.parsers.base import CallBody
from peagle_jax.chat.parsers.json_call import JsonCall
from peagle_jax.chat.parsers.tagged import TaggedToolParser


class HermesToolParser(TaggedToolParser):
    """Calls as JSON objects between ``<tool_call>`` tags (the name before or after ``"arguments"``, which
    may also be spelled ``"parameters"``)."""

    def _body(self, index: int) -> CallBody:
        return JsonCall(index, self._new_id)
