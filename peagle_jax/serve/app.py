"""The ASGI application (Starlette): OpenAI completions and chat completions (plain JSON or server-sent
events), models, health, metrics and the SageMaker ``/ping`` and ``/invocations``.

A handler validates the request (:mod:`peagle_jax.serve.protocol`), turns it into token ids and
:class:`SlotRequest` s checked against the engine's limits (:mod:`peagle_jax.serve.requests`), and submits
them to the engine thread; events come back on an ``asyncio.Queue`` and become the response body or its
server-sent events (:mod:`peagle_jax.serve.responses`). A client that disconnects cancels its request; every
error is an OpenAI-style body.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import time
import traceback

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from peagle_jax.chat.format import ChatFormat
from peagle_jax.serve import protocol, responses
from peagle_jax.serve.protocol import APIError, ChatRequest, CompletionRequest
from peagle_jax.serve.requests import Translator
from peagle_jax.serve.responses import Choice, Formatter
from peagle_jax.serve.slot_io import SlotRequest
from peagle_jax.serve.worker import EngineWorker, Failure, QueueFull

log = logging.getLogger("peagle_jax.serve")


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
    chat: ChatFormat = dataclasses.field(default_factory=ChatFormat)  # tool calls and reasoning (peagle_jax.chat)


def build_app(state: ServerState, lifespan=None) -> Starlette:
    api = _Routes(state)
    routes = [
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/ping", api.health, methods=["GET"]),
        Route("/invocations", api.invocations, methods=["POST"]),
        Route("/metrics", api.metrics_text, methods=["GET"]),
    ]
    handlers = {
        APIError: api.on_api_error,
        ClientDisconnect: api.on_client_gone,
        HTTPException: api.on_http_error,
        Exception: api.on_crash,
    }
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _endpoint_of(request: Request) -> str:
    return {"/v1/completions": "completions", "/v1/chat/completions": "chat"}.get(request.url.path, "invocations")


async def _gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Routes:
    """The routes and error handlers of one server: requests in, through the engine worker, responses out."""

    def __init__(self, state: ServerState):
        self.state, self.worker, self.metrics = state, state.worker, state.worker.metrics
        engine = state.worker.engine
        self.translator = Translator(
            state.tokenizer,
            state.model_name,
            state.max_seq_len,
            state.stop_token_ids,
            capacity=engine.B + state.worker.max_queue,
            check=engine.check,
            grammars=engine.grammars,
            chat=state.chat,
        )

    def authorize(self, request: Request) -> None:
        """With an API key, a /v1 request must carry it as a bearer token (compared in constant time)."""
        key = self.state.api_key
        if key is None or not request.url.path.startswith("/v1/"):
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(
                401,
                "missing or invalid API key: send the header 'Authorization: Bearer KEY'",
                type="authentication_error",
                code="invalid_api_key",
            )

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused with 413 as soon as it exceeds ``state.max_body_bytes`` (by its
        Content-Length, or while it streams in)."""
        limit = self.state.max_body_bytes
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

    async def generate(self, request: Request, parse, endpoint: str):
        """Serve one request whose body ``parse`` (bytes -> request object) validates."""
        self.authorize(request)
        body = await self.read_body(request)
        # Parsing and tokenization are CPU work: off the event loop, so that /health and streams keep going.
        req = await asyncio.to_thread(parse, body)
        if req.ignored:
            log.warning("%s: ignoring fields the OpenAI API does not define: %s", endpoint, ", ".join(req.ignored))
        sreqs = await asyncio.to_thread(self.translator.slot_requests, req)
        events: asyncio.Queue = asyncio.Queue()
        self._submit(sreqs, events)
        parsers = self.translator.parsers(req, sreqs[0].prompt)
        choices = responses.choices_of(req, sreqs, self.state.tokenizer, parsers)
        fmt = responses.formatter_for(req, choices, self.state.model_name)
        if req.stream:
            return StreamingResponse(
                self._sse(choices, events, fmt, endpoint),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        if not await self._collect(request, choices, events):
            self.metrics.request(endpoint, "client_gone")
            return Response(status_code=499)
        produced = sum(c.produced for c in choices)
        self.metrics.tokens(fmt.prompt_tokens, produced)
        self.metrics.request(endpoint, "ok")
        return JSONResponse(fmt.full(choices, produced, token_ids=bool(req.return_token_ids)))

    def _submit(self, sreqs: list[SlotRequest], events: asyncio.Queue) -> None:
        """Hand all of a request's slot requests to the worker, or none: a full queue is a 429."""
        loop = asyncio.get_running_loop()
        submitted = []
        try:
            for sreq in sreqs:
                self.worker.submit(sreq, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
                submitted.append(sreq)
        except QueueFull:
            for sreq in submitted:
                self.worker.cancel(sreq.id)
            raise APIError(
                429,
                "the server is at capacity; retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(self.state.retry_after_s)},
            ) from None

    def _feed(self, by_id: dict[int, Choice], ev) -> tuple[Choice, str] | None:
        """Give an event to its choice (None when that choice has finished); a stop string frees the slot now,
        not when the other choices end."""
        c = by_id.get(ev.request.id)
        if c is None or c.finish is not None:
            return None
        delta = c.feed(ev)
        if c.text.stopped:
            self.worker.cancel(c.sreq.id)
        return c, delta

    async def _collect(self, request: Request, choices: list[Choice], events: asyncio.Queue) -> bool:
        """Feed events to the choices until all finish (True), or until the client goes away (False); a failure
        is an :class:`APIError`. Unfinished choices are cancelled."""
        by_id = {c.sreq.id: c for c in choices}
        disconnected = asyncio.ensure_future(_gone(request))  # watched beside the events, not in their gaps
        try:
            while any(c.finish is None for c in choices):
                next_event = asyncio.ensure_future(events.get())
                await asyncio.wait((next_event, disconnected), return_when=asyncio.FIRST_COMPLETED)
                if not next_event.done():
                    next_event.cancel()
                    return False
                ev = next_event.result()
                if isinstance(ev, Failure):
                    kind = "server_error" if ev.status >= 500 else "invalid_request_error"
                    raise APIError(ev.status, ev.message, type=kind)
                self._feed(by_id, ev)
        finally:
            disconnected.cancel()
            for c in choices:
                if c.finish is None:
                    self.worker.cancel(c.sreq.id)
        return True

    async def _sse(self, choices: list[Choice], events: asyncio.Queue, fmt: Formatter, endpoint: str):
        """Server-sent events: a first chunk per choice (chat), one per step and choice with new text, one with
        each choice's finish reason (the last of them also carries usage), then ``data: [DONE]``. If the client
        goes away the task is cancelled and ``finally`` frees the slots."""
        by_id = {c.sreq.id: c for c in choices}
        failed = False
        try:
            for chunk in fmt.opening(choices):
                yield chunk
            while any(c.finish is None for c in choices):
                ev = await events.get()
                if isinstance(ev, Failure):
                    yield responses.error_event(ev.status, ev.message)
                    self.metrics.request(endpoint, "error")
                    failed = True
                    return
                fed = self._feed(by_id, ev)
                chunk = None if fed is None else fmt.step(*fed, choices)
                if chunk is not None:
                    yield chunk
            yield responses.DONE
            self.metrics.tokens(fmt.prompt_tokens, sum(c.produced for c in choices))
            self.metrics.request(endpoint, "ok")
        finally:
            unfinished = [c for c in choices if c.finish is None]
            for c in unfinished:
                self.worker.cancel(c.sreq.id)
            if unfinished and not failed:
                self.metrics.request(endpoint, "client_gone")

    async def completions(self, request: Request):
        return await self.generate(request, functools.partial(protocol.parse, CompletionRequest), "completions")

    async def chat(self, request: Request):
        return await self.generate(request, functools.partial(protocol.parse, ChatRequest), "chat")

    async def invocations(self, request: Request):
        return await self.generate(request, protocol.parse_invocation, "invocations")

    async def models(self, request: Request):
        self.authorize(request)
        model = {
            "id": self.state.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "peagle_jax",
            "max_model_len": self.state.max_seq_len,
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request):
        worker = self.worker
        if worker.ready.is_set() and worker.alive:
            return JSONResponse({"status": "ok", "graphs_pending": worker.graphs_pending})
        status = "failed" if worker.failed else "loading"
        return JSONResponse({"status": status}, status_code=503)

    async def metrics_text(self, request: Request):
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def on_api_error(self, request: Request, err: APIError):
        outcome = "rejected" if err.status == 429 else "bad_request" if err.status < 500 else "error"
        self.metrics.request(_endpoint_of(request), outcome)
        return _error(err)

    async def on_client_gone(self, request: Request, err: ClientDisconnect):
        """The client went away before its body was complete: nothing was submitted, nothing to answer."""
        self.metrics.request(_endpoint_of(request), "client_gone")
        return Response(status_code=499)

    async def on_http_error(self, request: Request, err: HTTPException):
        kind = "not_found" if err.status_code == 404 else "invalid_request_error"
        return _error(APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}", type=kind))

    async def on_crash(self, request: Request, err: Exception):
        log.error("request failed:\n%s", traceback.format_exc())
        self.metrics.request(_endpoint_of(request), "error")
        return _error(APIError(500, "internal server error", type="server_error"))
