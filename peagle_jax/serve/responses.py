"""Response formatting: the OpenAI response objects of one request, from the engine's events.

Each choice (:class:`Choice`) decodes its tokens incrementally (:class:`TextStream`, which also applies the
``stop`` strings) and keeps the log-probabilities not yet sent; a :class:`Formatter` turns the choices into
the full body (``chat.completion`` / ``text_completion``) or into server-sent events (chunks). Nothing here
touches the engine or the network: the routes in :mod:`peagle_jax.serve.app` feed events in and send what
comes out.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time

from peagle_jax.chat.output import Delta, OutputParser
from peagle_jax.serve import protocol
from peagle_jax.serve.logprobs import LogprobsWriter
from peagle_jax.serve.protocol import APIError, ChatRequest
from peagle_jax.serve.requests import echo_of
from peagle_jax.serve.slot_io import SlotRequest

DONE = "data: [DONE]\n\n"  # the last server-sent event of a stream


class TextStream:
    """Incremental detokenization with stop strings: :meth:`feed` returns the text that is safe to send
    (never half a multi-byte character, never a prefix that could still become a stop string)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False
        self.text = ""

    def feed(self, ids: list[int], final: bool = False) -> str:
        self.ids += ids
        if self.tokenizer is None:
            text = "".join(f"{t}," for t in self.ids)  # no tokenizer: the ids, comma-terminated
        else:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            text, self.stopped, final = text[: min(hits)], True, True
        safe = len(text)
        if not final:
            if text.endswith("\ufffd"):
                safe = len(text.rstrip("\ufffd"))
            for s in self.stops:  # hold back a tail that may be the start of a stop string
                for n in range(min(len(s) - 1, safe), 0, -1):
                    if text[safe - n : safe] == s[:n]:
                        safe -= n
                        break
        self.text = text
        delta, self.sent = text[self.sent : max(safe, self.sent)], max(safe, self.sent)
        return delta


def prompt_text(tokenizer, prompt, ids: list[int]) -> str:
    """An echo's prompt text: the prompt string as sent, else the ids decoded as answers are."""
    if isinstance(prompt, str):
        return prompt
    return TextStream(tokenizer, []).feed(ids, final=True)


@dataclasses.dataclass
class Choice:
    """One choice of a request: its slot request, text, tokens and finish reason; with log-probabilities
    (``writer``) the tokens and values not yet sent; completions' ``echo``, the prompt text before the first
    text sent."""

    index: int
    sreq: SlotRequest
    text: TextStream
    produced: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None
    writer: LogprobsWriter | None = None  # None: the request wants no log-probabilities
    echo: str = ""
    parser: OutputParser | None = None  # a chat answer's parser (tool calls, reasoning); None: plain content
    include_reasoning: bool = True
    _lp_tokens: list[int] = dataclasses.field(default_factory=list)
    _lp_values: list = dataclasses.field(default_factory=list)

    def feed(self, ev) -> Delta:
        """Take one event's tokens (and log-probabilities: an echo's prompt tokens first, the first of them
        without values); returns what is safe to send: the new text as content, or what the parser made of
        it. An answer that ends with tool calls finishes with ``tool_calls``."""
        self.produced += len(ev.tokens)
        self.tokens += ev.tokens
        if self.writer is not None:
            if ev.prompt_logprobs is not None:
                self._lp_tokens += list(ev.request.prompt)
                self._lp_values += [(None, None), *ev.prompt_logprobs]
            self._lp_tokens += ev.tokens
            self._lp_values += ev.logprobs
        text = self.text.feed(ev.tokens, final=ev.finish_reason is not None)
        self.finish = "stop" if self.text.stopped else ev.finish_reason
        if self.parser is None:
            return Delta(content=text)
        delta = self.parser.feed(text, ev.tokens, final=self.finish is not None)
        if self.finish == "stop" and self.parser.result().tool_calls:
            self.finish = "tool_calls"
        return delta

    def message(self) -> dict:
        """The whole answer as a chat message (content, and what the parser found: reasoning, tool calls)."""
        if self.parser is None:
            return {"role": "assistant", "content": self.text.text}
        parsed = self.parser.result()
        content = parsed.content if parsed.content is not None or parsed.tool_calls else ""
        out = {"role": "assistant", "content": content}
        if parsed.reasoning is not None and self.include_reasoning:
            out["reasoning"] = out["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.tool_calls
            ]
        return out

    def delta_object(self, delta: Delta) -> dict:
        """A stream chunk's ``delta`` for ``delta``: content, reasoning (also as ``reasoning_content``, for
        older clients; left out without ``include_reasoning``), tool-call pieces as the OpenAI API streams
        them (a call's first piece has its id, type and name; later ones only argument text)."""
        out: dict = {}
        if delta.reasoning and self.include_reasoning:
            out["reasoning"] = out["reasoning_content"] = delta.reasoning
        if delta.content:
            out["content"] = delta.content
        calls = []
        for d in delta.tool_calls:
            call: dict = {"index": d.index}
            if d.id is not None:
                call.update(id=d.id, type="function")
            function = {"name": d.name} if d.name is not None else {}
            if d.arguments or d.name is not None:
                function["arguments"] = d.arguments
            call["function"] = function
            calls.append(call)
        if calls:
            out["tool_calls"] = calls
        return out

    def take_echo(self) -> str:
        echo, self.echo = self.echo, ""
        return echo

    def take_logprobs(self):
        """The ``logprobs`` value of the tokens fed since the last call (None without log-probabilities)."""
        if self.writer is None:
            return None
        out = self.writer.choice(self._lp_tokens, self._lp_values)
        self._lp_tokens, self._lp_values = [], []
        return out


def choices_of(req, sreqs: list[SlotRequest], tokenizer, parsers=lambda: None) -> list[Choice]:
    """The choices of a validated request, one per slot request in choice order (prompt i's choice j is
    choice ``i * n + j``): each with the request's stop strings, a log-probability writer when it wants them,
    with a completions ``echo`` its prompt's text, and a chat answer's parser from ``parsers()``."""
    stops = protocol.stop_strings(req)
    top = protocol.logprobs_wanted(req)
    n = req.n or 1
    out = []
    for i, sreq in enumerate(sreqs):
        c = Choice(i, sreq, TextStream(tokenizer, stops), parser=parsers())
        c.include_reasoning = not isinstance(req, ChatRequest) or req.include_reasoning
        if top is not None:
            c.writer = LogprobsWriter(tokenizer, isinstance(req, ChatRequest), top)
        if echo_of(req):
            c.echo = prompt_text(tokenizer, protocol.prompt_list(req)[i // n], sreq.prompt)
        out.append(c)
    return out


def formatter_for(req, choices: list[Choice], model: str) -> Formatter:
    """The formatter of a request's response: a new id, its prompts' tokens (each prompt counted once)."""
    chat = isinstance(req, ChatRequest)
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    prompt_tokens = sum(len(c.sreq.prompt) for c in choices[:: req.n or 1])
    return Formatter(rid, model, chat, prompt_tokens)


class Formatter:
    """OpenAI response objects for one request."""

    def __init__(self, rid: str, model: str, chat: bool, prompt_tokens: int, created: int | None = None):
        self.rid, self.model, self.chat, self.prompt_tokens = rid, model, chat, prompt_tokens
        self.created = int(time.time()) if created is None else created

    def usage(self, produced: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": produced,
            "total_tokens": self.prompt_tokens + produced,
        }

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def full(self, choices: list[Choice], produced: int, *, token_ids: bool = False) -> dict:
        """The whole (not streamed) response body."""
        out = []
        for c in choices:
            if self.chat:
                choice = {"index": c.index, "message": c.message()}
            else:
                choice = {"index": c.index, "text": c.take_echo() + c.text.text}
            choice.update(logprobs=c.take_logprobs(), finish_reason=c.finish)
            if token_ids:  # vLLM's return_token_ids: the prompt's ids in each choice, once per chat response
                choice["token_ids"] = c.tokens
                if not self.chat:
                    choice["prompt_token_ids"] = list(c.sreq.prompt)
            out.append(choice)
        obj = "chat.completion" if self.chat else "text_completion"
        body = {**self._head(obj), "choices": out, "usage": self.usage(produced)}
        if token_ids and self.chat:
            body["prompt_token_ids"] = list(choices[0].sreq.prompt)
        return body

    def chunk(
        self, delta: Delta, finish: str | None = None, produced: int | None = None, first=False, index=0, choice=None
    ) -> str:
        """One server-sent event of ``choice`` (its index, and the log-probabilities and echo it holds)."""
        if self.chat:
            if first:
                d = {"role": "assistant", "content": ""}
            else:
                d = Choice.delta_object(choice, delta) if choice is not None else {"content": delta.content}
            logprobs = None if first or choice is None else choice.take_logprobs()
            choice_obj = {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}
            obj = {**self._head("chat.completion.chunk"), "choices": [choice_obj]}
        else:
            echo = "" if choice is None else choice.take_echo()
            logprobs = None if choice is None else choice.take_logprobs()
            obj = {
                **self._head("text_completion"),
                "choices": [
                    {"index": index, "text": echo + delta.content, "logprobs": logprobs, "finish_reason": finish}
                ],
            }
        if produced is not None:
            obj["usage"] = self.usage(produced)
        return f"data: {json.dumps(obj)}\n\n"

    def opening(self, choices: list[Choice]) -> list[str]:
        """The events a stream starts with: chat's first chunk per choice (the assistant role); none for
        completions."""
        return [self.chunk(Delta(), first=True, index=c.index) for c in choices] if self.chat else []

    def step(self, choice: Choice, delta: Delta, choices: list[Choice]) -> str | None:
        """The event after ``choice`` took an event and returned ``delta``: its new text (None when there is
        none yet), or its finish reason; the last choice to finish also carries the request's usage."""
        if choice.finish is None:
            wanted = choice.delta_object(delta) if self.chat else delta.content
            return self.chunk(delta, index=choice.index, choice=choice) if wanted else None
        last = all(c.finish is not None for c in choices)
        produced = sum(c.produced for c in choices) if last else None
        return self.chunk(delta, choice.finish, produced, index=choice.index, choice=choice)


def error_event(status: int, message: str) -> str:
    """A failure in the middle of a stream: one event with an OpenAI-style error body (a server error)."""
    return f"data: {json.dumps(APIError(status, message, type='server_error').body())}\n\n"
