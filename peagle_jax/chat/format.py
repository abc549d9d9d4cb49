"""A served model's chat format: how a conversation with tools becomes its prompt, how its answer is parsed
into content, reasoning and tool calls, and how a forced tool call is written as a grammar.

The format follows from the model (:func:`detect`), as vLLM's parsers would be chosen by hand for it, and
flags override it (``--tool-call-parser``, ``--reasoning-parser``, with vLLM's names):

| model | prompt | tool parser | reasoning parser |
|---|---|---|---|
| GPT-OSS (``gpt_oss``) | harmony (:mod:`peagle_jax.chat.harmony`) | ``openai`` | ``openai_gptoss`` |
| a template with ``<function=`` / ``<parameter=`` (Qwen3-Coder) | its chat template | ``qwen3_coder`` | none |
| a template with ``<tool_call>`` (Qwen3, Qwen2.5) | its chat template | ``hermes`` | ``qwen3`` with ``<think>`` |
| a template with ``<|python_tag|>`` (Llama 3.1, 3.2) | its chat template | ``llama3_json`` | none |
| anything else (SmolLM2) | its chat template | none: ``tools`` is a 400 naming the flag | none |
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from peagle_jax.chat import harmony
from peagle_jax.chat.output import OutputParser
from peagle_jax.chat.parsers import text_parser
from peagle_jax.chat.tool_grammar import forced_call_grammar
from peagle_jax.errors import UserError

TOOL_PARSERS = ("hermes", "qwen3_coder", "llama3_json", "openai")
REASONING_PARSERS = ("qwen3", "openai_gptoss")


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """How one served model chats: its tool-call syntax (a tool parser's name, None: it has none) and its
    reasoning syntax (a reasoning parser's name, None: none). Harmony (GPT-OSS) renders and parses both."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None

    @property
    def harmony(self) -> bool:
        return self.tool_parser == "openai" or self.reasoning_parser == "openai_gptoss"

    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end an answer besides the model's own (harmony's ``<|return|>`` and ``<|call|>``)."""
        return harmony.STOP_IDS if self.harmony else ()

    def render(self, tokenizer, messages: list[dict], tools: list[dict] | None, *, effort=None, kwargs=None):
        """The prompt's token ids: the conversation (message dicts, :meth:`Message.as_dict`) with ``tools``
        (OpenAI function tools; None: none), ending with the assistant's turn. Raises UserError for a
        conversation the format cannot render."""
        if self.harmony:
            return harmony_ids(tokenizer, messages, tools, effort)
        extra = dict(kwargs or {})
        if effort is not None:
            extra.setdefault("reasoning_effort", effort)
        if tools:
            extra["tools"] = tools
        try:
            ids = tokenizer.apply_chat_template(
                template_messages(messages), add_generation_prompt=True, tokenize=True, **extra
            )
        except Exception as err:  # noqa: BLE001 - a template may refuse a conversation (e.g. role order)
            raise UserError(f"the chat template refused these messages: {err}") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def parser(self, tokenizer, tools: list[dict] | None, prompt_ids: Sequence[int]) -> OutputParser | None:
        """A new parser for one answer (None: the answer is plain content). Tool calls are parsed only when
        the request has ``tools`` (and a ``tool_choice`` other than ``none``)."""
        if self.harmony:
            return harmony.HarmonyParser(lambda ids: tokenizer.decode(ids, skip_special_tokens=False))

        tool = self.tool_parser if tools else None
        if tool is None and self.reasoning_parser is None:
            return None
        return text_parser(
            self.reasoning_parser, tool, tools or [], in_reasoning=self._opens_thinking(tokenizer, prompt_ids)
        )

    def _opens_thinking(self, tokenizer, prompt_ids: Sequence[int]) -> bool:
        """Whether the prompt ends inside an open ``<think>`` (a template that starts the reasoning itself)."""
        if self.reasoning_parser != "qwen3":
            return False
        tail = tokenizer.decode(list(prompt_ids[-16:]), skip_special_tokens=False)
        return tail.rfind("<think>") > tail.rfind("</think>")

    def forced(self, tools: list[dict], name: str | None, parallel: bool) -> str:
        """The grammar (lark) of a forced call: ``name`` (a named tool choice) or any tool (``required``)."""
        if self.tool_parser is None:
            raise UserError("this model has no tool-call syntax")
        return forced_call_grammar(self.tool_parser, tools, name, parallel=parallel)


def harmony_ids(tokenizer, messages: list[dict], tools: list[dict] | None, effort: str | None) -> list[int]:
    """A harmony prompt's token ids, as openai-harmony encodes them: each message's header and end as markup
    (special tokens), its text as plain text, so that a message quoting ``<|end|>`` cannot end itself."""
    msgs = harmony.drop_analysis(harmony.harmony_messages(messages, tools or [], effort))
    ids: list[int] = []
    for m in msgs:
        rendered = m.render()  # header, <|message|>, the text, then <|end|> or <|call|>
        head = rendered[: rendered.index(harmony.MESSAGE) + len(harmony.MESSAGE)]
        end = harmony.CALL if rendered.endswith(harmony.CALL) else harmony.END
        ids += tokenizer.encode(head, add_special_tokens=False)
        ids += tokenizer.encode(m.text, add_special_tokens=False, split_special_tokens=True)
        ids += tokenizer.encode(end, add_special_tokens=False)
    return ids + tokenizer.encode(harmony.START + "assistant", add_special_tokens=False)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as the chat templates of Qwen3, Qwen3-Coder and Llama 3.1 read them: tool call arguments as
    objects (templates iterate over them or write them with ``tojson``), reasoning as ``reasoning_content``."""
    out = []
    for m in messages:
        m = dict(m)
        if "reasoning" in m:
            m["reasoning_content"] = m.pop("reasoning")
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def detect(family: str, template: str | None, tool_flag: str | None = None, reasoning_flag: str | None = None):
    """The chat format of a model (its family and chat template text), with the flags' choices over it
    (``"none"`` turns a detected parser off)."""
    template = template or ""
    if family == "gpt_oss":
        tool, reasoning = "openai", "openai_gptoss"
    else:
        reasoning = "qwen3" if "<think>" in template else None
        if "<function=" in template and "<parameter=" in template:
            tool, reasoning = "qwen3_coder", None
        elif "<tool_call>" in template:
            tool = "hermes"
        elif "<|python_tag|>" in template:
            tool = "llama3_json"
        else:
            tool = None
    if tool_flag is not None:
        tool = None if tool_flag == "none" else tool_flag
    if reasoning_flag is not None:
        reasoning = None if reasoning_flag == "none" else reasoning_flag
    return ChatFormat(tool, reasoning)
