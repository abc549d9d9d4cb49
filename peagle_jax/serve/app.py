"""The ASGI application (Starlette): OpenAI completions and chat completions (plain JSON or server-sent
events), models, health, metrics and the SageMaker ``/ping`` and ``/invocations``.

A handler validates the request (:mod:`peagle_jax.serve.protocol`), turns it into token ids and a
:class:`SlotRequest`, checks it against the engine's limits, and submits it to the engine thread; events
come back on an ``asyncio.Queue``. Text is decoded incrementally (:class:`TextStream`), which also applies
the ``stop`` strings. A client that disconnects cancels its request; every error is an OpenAI-style body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
import secrets
import time
import traceback

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from peagle_jax.engine.generator import RequestError
from peagle_jax.errors import UserError
from peagle_jax.serve import protocol
from peagle_jax.serve.logprobs import LogprobsWriter
from peagle_jax.serve.protocol import APIError, ChatRequest, CompletionRequest
from peagle_jax.serve.slots import SlotRequest, next_request_id
from peagle_jax.serve.worker import EngineWorker, Failure, QueueFull

log = logging.getLogger("peagle_jax.serve")
DEFAULT_COMPLETION_TOKENS = 16  # the OpenAI default for /v1/completions; chat defaults to the remaining context


@dataclasses.dataclass
class ServerState:
    worker: EngineWorker
    tokenizer: object | None
    model_name: str
    max_seq_len: int
    stop_token_ids: tuple[int, ...]
    retry_after_s: int = 1
    max_body_bytes: int = 8 << 20  # a larger request body is refused with 413 before it is read further
    api_key: str | None = None  # when set, every /v1 route needs "Authorization: Bearer <api_key>"


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


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def build_app(state: ServerState, lifespan=None) -> Starlette:
    worker, metrics = state.worker, state.worker.metrics

    def encode(prompt) -> list[int]:
        if isinstance(prompt, str):
            if state.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
            return list(state.tokenizer.encode(prompt))
        return list(prompt)

    def prompt_ids(req) -> list[list[int]]:
        """The token ids of each prompt: one for chat, one per prompt of a completions list."""
        tok = state.tokenizer
        if isinstance(req, ChatRequest):
            if tok is None or not getattr(tok, "chat_template", None):
                raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
            msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            except Exception as err:  # noqa: BLE001 - a template may refuse a conversation (e.g. role order)
                raise APIError(400, f"the chat template refused these messages: {err}", param="messages") from None
            return [list(ids["input_ids"] if hasattr(ids, "keys") else ids)]
        return [encode(p) for p in protocol.prompt_list(req)]

    def slot_requests(req) -> list[SlotRequest]:
        """One SlotRequest per choice, in choice order: prompt i's choice j is choice ``i * n + j``, with seed
        ``seed + j``; the n choices of a prompt share its prefill."""
        if req.model != state.model_name:
            raise APIError(
                404,
                f"model {req.model!r} does not exist; this server serves {state.model_name!r}",
                param="model",
                code="model_not_found",
            )
        n = req.n or 1
        seed = secrets.randbits(32) if req.seed is None else req.seed
        out = []
        for ids in prompt_ids(req):
            first = slot_request(req, ids, seed, n)
            out += [first]
            out += [dataclasses.replace(first, seed=(seed + j) & 0xFFFFFFFF, id=next_request_id()) for j in range(1, n)]
        room = worker.engine.B + worker.max_queue
        if len(out) > room:
            raise APIError(
                400,
                f"{len(out)} choices (n times the prompts) is more than this server holds at once ({room}: "
                "its slots and its queue)",
                param="n",
            )
        return out

    def slot_request(req, ids: list[int], seed: int, n: int) -> SlotRequest:
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        room = state.max_seq_len - len(ids)
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; the context holds {state.max_seq_len}",
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
                f"context of {state.max_seq_len} tokens",
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
            tuple(sorted(set(state.stop_token_ids) | set(req.stop_token_ids or ()))),
            group=next_request_id() if n > 1 else None,
            group_size=n,
            echo=echo_of(req) and protocol.logprobs_wanted(req) is not None,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            logit_bias=protocol.logit_bias(req) or None,
            grammar=grammar_of(req),
        )
        try:
            worker.engine.check(sreq)
        except RequestError as err:
            raise APIError(400, str(err)) from None
        return sreq

    grammars: dict[str, str] = {}  # compiled grammars by their request (the last 256)

    def grammar_of(req) -> str | None:
        """The request's compiled grammar (structured outputs), or None; a 400 when it does not compile."""
        spec = protocol.structured(req)
        if spec is None:
            return None
        param = protocol.structured_param(req)
        if worker.engine.grammars is None:
            raise APIError(400, f"{param}: this server has no tokenizer for structured outputs", param=param)
        key = json.dumps(spec, sort_keys=True)
        if key not in grammars:
            try:
                grammars[key] = worker.engine.grammars.compile(*spec)
            except UserError as err:
                raise APIError(400, f"{param}: {err}", param=param) from None
            while len(grammars) > 256:
                grammars.pop(next(iter(grammars)))
        return grammars[key]

    def echo_of(req) -> bool:
        return isinstance(req, CompletionRequest) and bool(req.echo)

    def prompt_text(prompt, ids: list[int]) -> str:
        """An echo's prompt text: the prompt string as sent, else the ids decoded as answers are."""
        if isinstance(prompt, str):
            return prompt
        return TextStream(state.tokenizer, []).feed(ids, final=True)

    def authorize(request: Request) -> None:
        """With an API key, a /v1 request must carry it as a bearer token (compared in constant time)."""
        if state.api_key is None or not request.url.path.startswith("/v1/"):
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
            raise APIError(
                401,
                "missing or invalid API key: send the header 'Authorization: Bearer KEY'",
                type="authentication_error",
                code="invalid_api_key",
            )

    async def read_body(request: Request) -> bytes:
        """The request body, refused with 413 as soon as it exceeds ``state.max_body_bytes`` (by its
        Content-Length, or while it streams in)."""
        limit = state.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body ({int(declared)} bytes) exceeds the limit of {limit} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def gone(request: Request) -> None:
        """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def generate(request: Request, parse, endpoint: str):
        """Serve one request whose body ``parse`` (bytes -> request object) validates."""
        authorize(request)
        body = await read_body(request)
        # Parsing and tokenization are CPU work: off the event loop, so that /health and streams keep going.
        req = await asyncio.to_thread(parse, body)
        if req.ignored:
            log.warning("%s: ignoring fields the OpenAI API does not define: %s", endpoint, ", ".join(req.ignored))
        sreqs = await asyncio.to_thread(slot_requests, req)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        submitted = []
        try:
            for sreq in sreqs:
                worker.submit(sreq, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
                submitted.append(sreq)
        except QueueFull:
            for sreq in submitted:
                worker.cancel(sreq.id)
            raise APIError(
                429,
                "the server is at capacity; retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(state.retry_after_s)},
            ) from None
        stops = protocol.stop_strings(req)
        choices = [_Choice(i, sreq, TextStream(state.tokenizer, stops)) for i, sreq in enumerate(sreqs)]
        rid = ("chatcmpl-" if isinstance(req, ChatRequest) else "cmpl-") + secrets.token_hex(12)
        prompt_tokens = sum(len(c.sreq.prompt) for c in choices[:: req.n or 1])  # each prompt counted once
        fmt = _Formatter(rid, state.model_name, isinstance(req, ChatRequest), prompt_tokens)
        top = protocol.logprobs_wanted(req)
        for c in choices:
            if top is not None:
                c.writer = LogprobsWriter(state.tokenizer, isinstance(req, ChatRequest), top)
            if echo_of(req):
                c.echo = prompt_text(protocol.prompt_list(req)[c.index // (req.n or 1)], c.sreq.prompt)
        if req.stream:
            return StreamingResponse(
                _sse(worker, choices, events, fmt, metrics, endpoint),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        by_id = {c.sreq.id: c for c in choices}
        disconnected = asyncio.ensure_future(gone(request))  # watched beside the events, not in their gaps
        try:
            while any(c.finish is None for c in choices):
                next_event = asyncio.ensure_future(events.get())
                await asyncio.wait((next_event, disconnected), return_when=asyncio.FIRST_COMPLETED)
                if not next_event.done():
                    next_event.cancel()
                    metrics.request(endpoint, "client_gone")
                    return Response(status_code=499)
                ev = next_event.result()
                if isinstance(ev, Failure):
                    raise APIError(
                        ev.status, ev.message, type="server_error" if ev.status >= 500 else "invalid_request_error"
                    )
                choice = by_id.get(ev.request.id)
                if choice is not None and choice.finish is None:
                    choice.feed(ev)
                    if choice.text.stopped:  # a stop string: the slot is freed now, not when the others end
                        worker.cancel(choice.sreq.id)
        finally:
            disconnected.cancel()
            for c in choices:
                if c.finish is None:
                    worker.cancel(c.sreq.id)
        produced = sum(c.produced for c in choices)
        metrics.tokens(prompt_tokens, produced)
        metrics.request(endpoint, "ok")
        return JSONResponse(fmt.full(choices, produced, token_ids=bool(req.return_token_ids)))

    async def completions(request: Request):
        return await generate(request, functools.partial(protocol.parse, CompletionRequest), "completions")

    async def chat(request: Request):
        return await generate(request, functools.partial(protocol.parse, ChatRequest), "chat")

    async def invocations(request: Request):
        return await generate(request, protocol.parse_invocation, "invocations")

    async def models(request: Request):
        authorize(request)
        created = int(time.time())
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": state.model_name,
                        "object": "model",
                        "created": created,
                        "owned_by": "peagle_jax",
                        "max_model_len": state.max_seq_len,
                    }
                ],
            }
        )

    async def health(request: Request):
        if worker.ready.is_set() and worker.alive:
            return JSONResponse({"status": "ok", "graphs_pending": worker.graphs_pending})
        status = "failed" if worker.failed else "loading"
        return JSONResponse({"status": status}, status_code=503)

    async def metrics_text(request: Request):
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def endpoint_of(request: Request) -> str:
        return {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(request.url.path, "invocations")

    async def on_api_error(request: Request, err: APIError):
        outcome = "rejected" if err.status == 429 else "bad_request" if err.status < 500 else "error"
        metrics.request(endpoint_of(request), outcome)
        return _error(err)

    async def on_client_gone(request: Request, err: ClientDisconnect):
        """The client went away before its body was complete: nothing was submitted, nothing to answer."""
        metrics.request(endpoint_of(request), "client_gone")
        return Response(status_code=499)

    async def on_http_error(request: Request, err: HTTPException):
        kind = "not_found" if err.status_code == 404 else "invalid_request_error"
        return _error(APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}", type=kind))

    async def on_crash(request: Request, err: Exception):
        log.error("request failed:\n%s", traceback.format_exc())
        metrics.request(endpoint_of(request), "error")
        return _error(APIError(500, "internal server error", type="server_error"))

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET"]),
        Route("/invocations", invocations, methods=["POST"]),
        Route("/metrics", metrics_text, methods=["GET"]),
    ]
    handlers = {
        APIError: on_api_error,
        ClientDisconnect: on_client_gone,
        HTTPException: on_http_error,
        Exception: on_crash,
    }
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)


class _Formatter:
    """OpenAI response objects for one request."""

    def __init__(self, rid: str, model: str, chat: bool, prompt_tokens: int):
        self.rid, self.model, self.chat, self.prompt_tokens = rid, model, chat, prompt_tokens
        self.created = int(time.time())

    def usage(self, produced: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": produced,
            "total_tokens": self.prompt_tokens + produced,
        }

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def full(self, choices: list[_Choice], produced: int, *, token_ids: bool = False) -> dict:
        out = []
        for c in choices:
            if self.chat:
                choice = {"index": c.index, "message": {"role": "assistant", "content": c.text.text}}
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
        self, delta: str, finish: str | None = None, produced: int | None = None, first=False, index=0, choice=None
    ) -> str:
        """One server-sent event of ``choice`` (its index, and the log-probabilities and echo it holds)."""
        if self.chat:
            d = {"role": "assistant", "content": delta} if first else ({"content": delta} if delta else {})
            logprobs = None if first or choice is None else choice.take_logprobs()
            choice_obj = {"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish}
            obj = {**self._head("chat.completion.chunk"), "choices": [choice_obj]}
        else:
            echo = "" if choice is None else choice.take_echo()
            logprobs = None if choice is None else choice.take_logprobs()
            obj = {
                **self._head("text_completion"),
                "choices": [{"index": index, "text": echo + delta, "logprobs": logprobs, "finish_reason": finish}],
            }
        if produced is not None:
            obj["usage"] = self.usage(produced)
        return f"data: {json.dumps(obj)}\n\n"


@dataclasses.dataclass
class _Choice:
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
    _lp_tokens: list[int] = dataclasses.field(default_factory=list)
    _lp_values: list = dataclasses.field(default_factory=list)

    def feed(self, ev) -> str:
        """Take one event's tokens (and log-probabilities: an echo's prompt tokens first, the first of them
        without values); returns the text that is safe to send."""
        self.produced += len(ev.tokens)
        self.tokens += ev.tokens
        if self.writer is not None:
            if ev.prompt_logprobs is not None:
                self._lp_tokens += list(ev.request.prompt)
                self._lp_values += [(None, None), *ev.prompt_logprobs]
            self._lp_tokens += ev.tokens
            self._lp_values += ev.logprobs
        delta = self.text.feed(ev.tokens, final=ev.finish_reason is not None)
        self.finish = "stop" if self.text.stopped else ev.finish_reason
        return delta

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


async def _sse(worker, choices: list[_Choice], events, fmt: _Formatter, metrics, endpoint):
    """Server-sent events: a first chunk per choice (chat), one per step and choice with new text, one with
    each choice's finish reason (the last of them also carries usage), then ``data: [DONE]``. If the client
    goes away the task is cancelled and ``finally`` frees the slots."""
    by_id = {c.sreq.id: c for c in choices}
    failed = False
    try:
        if fmt.chat:
            for c in choices:
                yield fmt.chunk("", first=True, index=c.index)
        while any(c.finish is None for c in choices):
            ev = await events.get()
            if isinstance(ev, Failure):
                body = APIError(ev.status, ev.message, type="server_error").body()
                yield f"data: {json.dumps(body)}\n\n"
                metrics.request(endpoint, "error")
                failed = True
                return
            c = by_id.get(ev.request.id)
            if c is None or c.finish is not None:
                continue
            delta = c.feed(ev)
            if c.finish is None:
                if delta:
                    yield fmt.chunk(delta, index=c.index, choice=c)
                continue
            if c.text.stopped:
                worker.cancel(c.sreq.id)
            last = all(x.finish is not None for x in choices)
            produced = sum(x.produced for x in choices) if last else None
            yield fmt.chunk(delta, c.finish, produced, index=c.index, choice=c)
        yield "data: [DONE]\n\n"
        metrics.tokens(fmt.prompt_tokens, sum(c.produced for c in choices))
        metrics.request(endpoint, "ok")
    finally:
        unfinished = [c for c in choices if c.finish is None]
        for c in unfinished:
            worker.cancel(c.sreq.id)
        if unfinished and not failed:
            metrics.request(endpoint, "client_gone")
