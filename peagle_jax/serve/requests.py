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
            if tok is None or not getattr(tok, "chat_template", None):
                raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
            msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            except Exception as err:  # noqa: BLE001 - a template may refuse a conversation (e.g. role order)
                raise APIError(400, f"the chat template refused these messages: {err}", param="messages") from None
            return [list(ids["input_ids"] if hasattr(ids, "keys") else ids)]
        return [self.encode(p) for p in protocol.prompt_list(req)]

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
        """The request's compiled grammar (structured outputs), or None; a 400 when it does not compile.
        Compiled grammars are kept by their request (the last :data:`GRAMMAR_CACHE`)."""
        spec = protocol.structured(req)
        if spec is None:
            return None
        param = protocol.structured_param(req)
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
