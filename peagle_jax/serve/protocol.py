"""OpenAI request schemas and their validation: every bad request becomes an :class:`APIError` (a 4xx with
an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``), never an exception that escapes.

The schemas are strict about types: wrong JSON types are refused (no ``"1"`` for a number). The OpenAI
parameters this server does not implement are refused by name (a 400, ``unsupported_parameter``) unless
they have their neutral values (no ``functions``, no ``audio``, ...). Tools and reasoning are served
(:mod:`peagle_jax.serve.chat_schema`, :mod:`peagle_jax.chat`). ``presence_penalty``,
``frequency_penalty`` (over the generated tokens, [-2, 2]) and ``logit_bias`` (token id -> [-100, 100]) are
served (:mod:`peagle_jax.logit_rules`).
Log-probabilities are served (chat ``logprobs`` + ``top_logprobs``, completions ``logprobs``, 0..20
alternatives, and ``echo``). Top-level fields the OpenAI API does not define at all are ignored, and the request records
their names (:attr:`_Common.ignored`) for one warning line in the log, as vLLM does: an SDK that adds a
field does not break its clients. Inside messages and ``stream_options`` unknown fields are refused.
"""

from __future__ import annotations

from typing import Any

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from peagle_jax.logit_rules import MAX_BIAS, MAX_PENALTY
from peagle_jax.serve.chat_schema import Message, ReasoningEffort, Tool, ToolChoice

# Stop strings per request. The OpenAI API allows 4, vLLM any number; lm-evaluation-harness sends a task's
# `until` strings and the EOS string (6 for humaneval).
MAX_STOP = 32
MAX_CHOICES = 128  # choices per request: n, times the prompts of a completions request
MAX_LOGPROBS = 20  # top_logprobs (chat) and logprobs (completions), as the OpenAI API


class APIError(Exception):
    """An error answered to the client with ``status`` and an OpenAI-style body."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param=None, code=None, headers=None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers  # extra response headers (Retry-After on a 429)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None  # usage is always sent in the last chunk


class _Common(BaseModel):
    """Parameters shared by completions and chat completions. Fields the schema does not declare land in
    ``model_extra``; :func:`parse` refuses the ones the OpenAI API defines for the endpoint and lists the
    others in ``ignored``."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # an extension (vLLM and others accept it too); 0 = off
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions (vLLM's names): token ids that end the answer besides the model's EOS, and the token ids of
    # the prompt and the answer in each choice (``prompt_token_ids``, ``token_ids``), not streamed.
    stop_token_ids: list[int] | None = None
    return_token_ids: bool | None = None
    # Structured outputs: OpenAI's response_format (also on completions, as vLLM), and vLLM's extensions
    # structured_outputs ({"json" | "regex" | "choice": ...}) and guided_json / guided_regex / guided_choice.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    _ignored: list[str] = PrivateAttr(default_factory=list)  # set by parse()

    @property
    def ignored(self) -> list[str]:
        """The top-level fields of the body that the OpenAI API does not define (ignored)."""
        return self._ignored


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # Tool calls and reasoning (peagle_jax.chat): the OpenAI fields, and vLLM's include_reasoning (false: the
    # answer's reasoning is left out) and chat_template_kwargs (extra variables for the chat template, such
    # as Qwen3's enable_thinking).
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


# Chat parameters of the OpenAI API that this server does not implement, with the values at which they
# change nothing (accepted); any other value is a 400 naming the parameter. The completions API defines no
# parameter beyond those the schema declares.
CHAT_NOT_IMPLEMENTED = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
}


def _where(loc) -> str:
    return ".".join(str(x) for x in loc if not (isinstance(x, str) and ("[" in x or x in {"str", "int", "list"})))


def parse_invocation(body: bytes) -> _Common:
    """A SageMaker ``/invocations`` body: a chat request when it has ``messages``, else a completion. The
    first look goes through pydantic's JSON parser too (nesting-limited: a deeply nested body is a 400, never a
    RecursionError)."""
    try:
        obj = pydantic_core.from_json(body)
    except ValueError as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    is_chat = isinstance(obj, dict) and "messages" in obj
    return parse(ChatRequest if is_chat else CompletionRequest, body)


def parse(schema: type[_Common], body: bytes) -> _Common:
    """Validate a JSON body against ``schema``; raise a 400 :class:`APIError` naming the first problem."""
    try:
        req = schema.model_validate_json(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = _where(first["loc"])
        if first["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {first['msg']}") from None
        if first["type"] == "extra_forbidden":
            raise APIError(400, f"unsupported parameter: {where}", param=where, code="unsupported_parameter") from None
        message = f"{where}: {first['msg']}" if where else first["msg"]
        raise APIError(400, message, param=where or None) from None
    _check_extra(req)
    _check_common(req)
    if isinstance(req, CompletionRequest):
        _check_logprobs(req.logprobs, "logprobs")
        _refuse(req.best_of not in (None, 1), "best_of")
        _refuse(req.suffix not in (None, ""), "suffix")
        if isinstance(req.prompt, list) and not req.prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        if isinstance(req.prompt, list) and isinstance(req.prompt[0], list) and not all(req.prompt):
            raise APIError(400, "prompt: a token-id prompt of the list is empty", param="prompt")
        choices = (req.n or 1) * len(prompt_list(req))
        if choices > MAX_CHOICES:
            raise APIError(400, f"n times the prompts is {choices} choices; at most {MAX_CHOICES}", param="n")
    else:
        _check_logprobs(req.top_logprobs, "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
    return req


def _check_logprobs(n: int | None, param: str) -> None:
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise APIError(400, f"{param} must be in 0..{MAX_LOGPROBS}, got {n}", param=param)


def logprobs_wanted(req: _Common) -> int | None:
    """How many alternatives per token the request wants with its log-probabilities (None: none wanted)."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def _check_extra(req: _Common) -> None:
    """Refuse an OpenAI parameter this server does not implement, unless neutral; keep the names of the
    fields the OpenAI API does not define in ``req.ignored``."""
    extra = req.model_extra or {}
    defined = CHAT_NOT_IMPLEMENTED if isinstance(req, ChatRequest) else {}
    for name, value in extra.items():
        if name in defined:
            _refuse(not any(value == neutral for neutral in defined[name]), name)
    req._ignored = sorted(name for name in extra if name not in defined)


def _refuse(cond: bool, param: str, what: str = "is not supported by this server") -> None:
    if cond:
        raise APIError(400, f"{param} {what}", param=param, code="unsupported_parameter")


def _check_common(req: _Common) -> None:
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise APIError(400, f"n must be in [1, {MAX_CHOICES}], got {req.n}", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise APIError(400, f"{name} must be in [-2, 2], got {value}", param=name)
    logit_bias(req)
    structured(req)
    if req.max_tokens is not None and req.max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {req.max_tokens}", param="max_tokens")
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise APIError(400, f"temperature must be in [0, 2], got {req.temperature}", param="temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    if req.top_k is not None and not 0 <= req.top_k < 2**31:
        raise APIError(400, f"top_k must be >= 0 (0 disables it), got {req.top_k}", param="top_k")
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise APIError(400, "seed must be a 64-bit integer", param="seed")
    if req.stop_token_ids is not None and any(t < 0 for t in req.stop_token_ids):
        raise APIError(400, "stop_token_ids must be token ids (>= 0)", param="stop_token_ids")
    if req.return_token_ids and req.stream:
        raise APIError(400, "return_token_ids is answered without stream only", param="return_token_ids")
    stops = stop_strings(req)
    if len(stops) > MAX_STOP:
        raise APIError(400, f"at most {MAX_STOP} stop strings, got {len(stops)}", param="stop")
    if any(s == "" for s in stops):
        raise APIError(400, "stop strings must not be empty", param="stop")


def logit_bias(req: _Common) -> dict[int, float]:
    """The request's logit bias as token id -> bias (keys are token ids written as JSON strings); a 400 names
    a key that is not an id or a value outside [-100, 100]. The server checks the ids against the vocabulary."""
    out = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.strip().isdigit():
            raise APIError(400, f"logit_bias: {key!r} is not a token id", param="logit_bias")
        if not -MAX_BIAS <= value <= MAX_BIAS:
            message = f"logit_bias: the bias of token {key} must be in [-100, 100], got {value}"
            raise APIError(400, message, param="logit_bias")
        out[int(key)] = float(value)
    return out


def structured(req: _Common) -> tuple[str, Any] | None:
    """The request's grammar as (kind, value) for :meth:`peagle_jax.grammar.Grammars.compile`: ``json_schema``
    (a schema), ``json_object``, ``regex`` or ``choice`` (strings); None when it asks for none. A 400 names a
    malformed one, or two given at once."""
    found = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("json_object", None, "response_format"))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                message = "response_format.json_schema must be an object with a schema"
                raise APIError(400, message, param="response_format")
            found.append(("json_schema", spec.get("schema", {}), "response_format"))
        elif kind != "text":
            raise APIError(
                400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                param="response_format",
            )  # fmt: skip
    so = req.structured_outputs or {}
    for key in so:
        kinds = {"json": "json_schema", "regex": "regex", "choice": "choice", "json_object": "json_object"}
        if key not in kinds:
            raise APIError(400, f"structured_outputs.{key} is not supported (json, regex, choice, json_object)",
                           param="structured_outputs")  # fmt: skip
        value = so[key]
        if key == "json" and isinstance(value, str):
            try:
                value = pydantic_core.from_json(value)
            except ValueError as err:
                raise APIError(400, f"structured_outputs.json is not JSON: {err}", param="structured_outputs") from None
        ok = {"json": dict, "regex": str, "choice": list, "json_object": bool}[key]
        if not isinstance(value, ok) or (key == "choice" and not all(isinstance(c, str) for c in value)):
            raise APIError(400, f"structured_outputs.{key} has the wrong type", param="structured_outputs")
        if key != "json_object" or value:
            found.append((kinds[key], None if key == "json_object" else value, "structured_outputs"))
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice")):
        if getattr(req, name) is not None:
            found.append((kind, getattr(req, name), name))
    if len(found) > 1:
        raise APIError(400, f"give one structured output, not {len(found)} ({', '.join(f[2] for f in found)})",
                       param=found[1][2])  # fmt: skip
    return (found[0][0], found[0][1]) if found else None


def structured_param(req: _Common) -> str:
    """The request field that holds its grammar (for a 400 about it)."""
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice"):
        if getattr(req, name) is not None and (name != "response_format" or req.response_format.get("type") != "text"):
            return name
    return "response_format"


def prompt_list(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request: one string or token-id list each."""
    p = req.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        return [p]
    return list(p)


def stop_strings(req: _Common) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)
