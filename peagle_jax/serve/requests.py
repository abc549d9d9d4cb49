"""Request translation: an OpenAI request that :mod:`peagle_jax.serve.protocol` validated becomes token ids and
one :class:`SlotRequest` per choice, or an :class:`APIError` when the model, the context or the engine cannot
serve it.

No server state: a :class:`Translator` is given what it needs (the tokenizer, the model's name, the context
length, the stop ids, how many choices the server holds, the engine's request check and grammar compiler).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Callable

from peagle_jax.chat.format import TOOL_PARSERS, ChatFormat
from peagle_jax.chat.output import OutputParser
from peagle_jax.engine.generator import RequestError
from peagle_jax.errors import UserError
from peagle_jax.serve import protocol
from peagle_jax.serve.protocol import APIError, ChatRequest, CompletionRequest
from peagle_jax.serve.slot_io import SlotRequest, next_request_id

DEFAULT_COMPLETION_TOKENS = 16  # the OpenAI default for /v1/completions; chat defaults to the remaining context
GRAMMAR_CACHE = 256  # compiled grammars kept, by their request


def echo_of(req) -> bool:
    """Whether a completions request asks for its prompt back before the answer."""
    return isinstance(req, CompletionRequest) and bool(req.echo)


@dataclasses.dataclass
class Translator:
    """Validated requests to slot requests, for one server.

    ``capacity`` is how many choices the server holds at once (its slots and its queue); ``check`` is the
    engine's check of a slot request (raises :class:`RequestError`; None: no check); ``grammars`` compiles
    structured-output grammars (:class:`peagle_jax.grammar.Grammars`; None: the server serves none).
    """

    tokenizer: object | None
    model_name: str
    max_seq_len: int
    stop_token_ids: tuple[int, ...]
    capacity: int
    check: Callable[[SlotRequest], None] | None = None
    grammars: object | None = None
    chat: ChatFormat = dataclasses.field(default_factory=ChatFormat)
    _compiled: dict[str, str] = dataclasses.field(default_factory=dict, init=False, repr=False)

    def encode(self, prompt) -> list[int]:
        """A completions prompt's token ids: a string encoded, a token-id list as it is."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def prompt_ids(self, req) -> list[list[int]]:
        """The token ids of each prompt: one for chat, one per prompt of a completions list."""
        tok = self.tokenizer
        if isinstance(req, ChatRequest):
            if tok is None or not (getattr(tok, "chat_template", None) or self.chat.harmony):
                raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
            check_tools(req, self.chat)
            for i, tool in enumerate(req.tools or ()):
                self.compiled(("json_schema", tool.function.parameters or {}), f"tools.{i}.function.parameters")
            msgs = [m.as_dict() for m in req.messages]
            try:
                ids = self.chat.render(
                    tok, msgs, tools_in_prompt(req), effort=req.reasoning_effort, kwargs=req.chat_template_kwargs
                )
            except UserError as err:
                raise APIError(400, str(err), param="messages") from None
            return [ids]
        return [self.encode(p) for p in protocol.prompt_list(req)]

    def parsers(self, req, prompt: list[int]) -> Callable[[], OutputParser | None]:
        """Makes one answer parser per choice of a chat request (None: its answers are plain content)."""
        if not isinstance(req, ChatRequest):
            return lambda: None
        tools = tools_in_prompt(req)
        return lambda: self.chat.parser(self.tokenizer, tools, prompt)

    def slot_requests(self, req) -> list[SlotRequest]:
        """One SlotRequest per choice, in choice order: prompt i's choice j is choice ``i * n + j``, with seed
        ``seed + j``; the n choices of a prompt share its prefill (one group)."""
        if req.model != self.model_name:
            raise APIError(
                404,
                f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        n = req.n or 1
        seed = secrets.randbits(32) if req.seed is None else req.seed
        out = []
        for ids in self.prompt_ids(req):
            first = self.slot_request(req, ids, seed, n)
            out += [first]
            out += [dataclasses.replace(first, seed=(seed + j) & 0xFFFFFFFF, id=next_request_id()) for j in range(1, n)]
        if len(out) > self.capacity:
            raise APIError(
                400,
                f"{len(out)} choices (n times the prompts) is more than this server holds at once ({self.capacity}: "
                "its slots and its queue)",
                param="n",
            )
        return out

    def slot_request(self, req, ids: list[int], seed: int, n: int) -> SlotRequest:
        """The first choice of one prompt: its answer's length checked against the context, ``max_tokens``
        defaulted (completions: 16, chat: the rest of the context), the engine's check passed."""
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        room = self.max_seq_len - len(ids)
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; the context holds {self.max_seq_len}",
                param="messages" if isinstance(req, ChatRequest) else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = req.max_tokens
        if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
            max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = room if isinstance(req, ChatRequest) else min(DEFAULT_COMPLETION_TOKENS, room)
        if max_tokens > room:
            raise APIError(
                400,
                f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"context of {self.max_seq_len} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        sreq = SlotRequest(
            ids,
            max_tokens,
            temperature,
            req.top_k or 0,
            1.0 if req.top_p is None else req.top_p,
            seed & 0xFFFFFFFF,
            tuple(sorted(set(self.stop_token_ids) | set(req.stop_token_ids or ()))),
            group=next_request_id() if n > 1 else None,
            group_size=n,
            echo=echo_of(req) and protocol.logprobs_wanted(req) is not None,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=protocol.logit_bias(req) or None,
            grammar=self.grammar_of(req),
        )
        if self.check is not None:
            try:
                self.check(sreq)
            except RequestError as err:
                raise APIError(400, str(err)) from None
        return sreq

    def grammar_of(self, req) -> str | None:
        """The request's compiled grammar (structured outputs, or a forced tool call), or None; a 400 when it
        does not compile."""
        spec = protocol.structured(req)
        param = protocol.structured_param(req)
        forced = forced_choice(req)
        if forced is not None:
            if spec is not None:
                raise APIError(400, f"a forced tool_choice and {param} cannot be combined", param="tool_choice")
            parallel = req.parallel_tool_calls is not False
            tools = [t.model_dump() for t in req.tools]
            spec, param = ("lark", self.chat.forced(tools, forced or None, parallel)), "tool_choice"
        if spec is None:
            return None
        return self.compiled(spec, param)

    def compiled(self, spec: tuple, param: str) -> str:
        """A grammar (kind, value) compiled, or a 400 naming ``param``. Compiled grammars are kept by their
        spec (the last :data:`GRAMMAR_CACHE`)."""
        if self.grammars is None:
            raise APIError(400, f"{param}: this server has no tokenizer for structured outputs", param=param)
        key = json.dumps(spec, sort_keys=True)
        if key not in self._compiled:
            try:
                self._compiled[key] = self.grammars.compile(*spec)
            except UserError as err:
                raise APIError(400, f"{param}: {err}", param=param) from None
            while len(self._compiled) > GRAMMAR_CACHE:
                self._compiled.pop(next(iter(self._compiled)))
        return self._compiled[key]


def tools_in_prompt(req) -> list[dict] | None:
    """The request's tools as the prompt shows them (OpenAI function tools), None when it has none or its
    ``tool_choice`` is ``none`` (then the model is not told about them, so it cannot call them)."""
    if not isinstance(req, ChatRequest) or not req.tools or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def forced_choice(req) -> str | None:
    """The tool a chat request forces: a named choice's name, ``""`` for ``required`` (any tool), None when it
    forces none."""
    if not isinstance(req, ChatRequest):
        return None
    choice = req.tool_choice
    if choice == "required":
        return ""
    return None if choice is None or isinstance(choice, str) else choice.function.name


def check_tools(req: ChatRequest, chat: ChatFormat) -> None:
    """A 400 for tools a request cannot have: a ``tool_choice`` that forces a call without tools or names no
    given tool; tools for a model with no known call syntax; a tool result answering no earlier call."""
    names = [t.function.name for t in req.tools or ()]
    forced = forced_choice(req)
    if forced is not None and not names:
        raise APIError(400, "tool_choice forces a tool call but the request has no tools", param="tool_choice")
    if forced and forced not in names:
        message = f"tool_choice names the function {forced!r}, which is not among the tools ({', '.join(names)})"
        raise APIError(400, message, param="tool_choice")
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two tools have the same name", param="tools")
    if names and req.tool_choice != "none" and chat.tool_parser is None:
        raise APIError(
            400,
            "this model has no known tool-call syntax: start the server with --tool-call-parser "
            f"({', '.join(TOOL_PARSERS)}) to serve tools",
            param="tools",
        )
    calls: set[str] = set()
    for i, m in enumerate(req.messages):
        calls.update(c.id for c in m.tool_calls or ())
        if m.role == "tool" and m.tool_call_id not in calls:
            message = f"messages.{i}: tool_call_id {m.tool_call_id!r} answers no earlier assistant tool call"
            raise APIError(400, message, param=f"messages.{i}.tool_call_id")
