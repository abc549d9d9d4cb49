"""Text-level output parsers: reasoning and tool calls read from the answer's text as it streams.

Each choice's answer (decoded without special tokens) is fed in chunks of any size; a :class:`TextParser`
returns a :class:`~peagle_jax.chat.output.Delta` per chunk and a :class:`~peagle_jax.chat.output.Parsed` at
the end, the same for every chunking. It chains two optional stages, under vLLM's names:

- reasoning (:data:`REASONING_PARSERS`): ``qwen3`` (:mod:`.qwen3`, ``<think>...</think>``);
- tool calls (:data:`TOOL_PARSERS`): ``hermes`` (:mod:`.hermes`, JSON in ``<tool_call>`` tags),
  ``qwen3_coder`` (:mod:`.qwen3_coder`, XML in ``<tool_call>`` tags) and ``llama3_json`` (:mod:`.llama3_json`,
  bare JSON objects joined by ``;``). Each tool parser class names the text that starts a call in its
  syntax (``start``) and whether a call may start after other text (``start_anywhere``).

Markup is held back while it may still be a call and released as content, verbatim, once it cannot be.
"""

from __future__ import annotations

from peagle_jax.chat.output import OutputParser, call_id
from peagle_jax.chat.parsers.base import Event, NewId, ReasoningParser, ToolParser, partial_suffix
from peagle_jax.chat.parsers.compose import TextParser, Trimmed
from peagle_jax.chat.parsers.hermes import HermesToolParser
from peagle_jax.chat.parsers.llama3_json import Llama3JsonToolParser
from peagle_jax.chat.parsers.qwen3 import Qwen3ReasoningParser
from peagle_jax.chat.parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "llama3_json": Llama3JsonToolParser,
}
REASONING_PARSERS: dict[str, type] = {"qwen3": Qwen3ReasoningParser}


def text_parser(
    reasoning: str | None,
    tool: str | None,
    tools: list[dict] | None,
    *,
    in_reasoning: bool = False,
    new_id: NewId = call_id,
) -> OutputParser:
    """A new parser for one answer: reasoning parser ``reasoning`` (None: no reasoning) in front of tool
    parser ``tool`` (None: no calls) for the request's ``tools`` (OpenAI form; Qwen3-Coder types its values
    by their schemas). ``in_reasoning``: the prompt ends inside an open ``<think>`` (ignored without a
    reasoning parser). ``new_id`` makes the calls' ids."""
    for name, known in ((reasoning, REASONING_PARSERS), (tool, TOOL_PARSERS)):
        if name is not None and name not in known:
            raise ValueError(f"unknown parser {name!r}; known: {', '.join(sorted(known))}")
    tool_parser = TOOL_PARSERS[tool](tools, new_id=new_id) if tool else None
    tool_start = tool_parser.start if tool_parser and tool_parser.start_anywhere else None
    reasoning_parser = (
        REASONING_PARSERS[reasoning](in_reasoning=in_reasoning, tool_start=tool_start) if reasoning else None
    )
    return TextParser(reasoning_parser, tool_parser)


__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "Event",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "NewId",
    "Qwen3CoderToolParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "TextParser",
    "ToolParser",
    "Trimmed",
    "partial_suffix",
    "text_parser",
]
