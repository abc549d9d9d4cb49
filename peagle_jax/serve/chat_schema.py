"""The chat messages and tools of an OpenAI chat request (strict pydantic models): messages of every role
(``tool`` results with their ``tool_call_id``, assistant turns with ``tool_calls`` and ``reasoning``), function
tools and ``tool_choice``. Checks that need more than one field (a ``tool_choice`` naming a given tool, a tool
result answering an earlier call) are :func:`peagle_jax.serve.requests.check_tools`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# OpenAI's rule for function names; it keeps names safe inside every call syntax's markup.
FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str  # JSON text of an object, as the OpenAI API sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning: str | None = None  # assistant; reasoning_content is the older name of the same field
    reasoning_content: str | None = None
    # Fields an SDK echoes back with an assistant message it received: accepted at their neutral values.
    refusal: None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _roles(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("only a tool message has a tool_call_id")
        if self.role != "assistant" and any(
            v is not None for v in (self.tool_calls, self.reasoning, self.reasoning_content)
        ):
            raise ValueError("only an assistant message has tool_calls or reasoning")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is missing (only an assistant message with tool_calls may leave it out)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def thought(self) -> str | None:
        """The assistant's reasoning (either field)."""
        return self.reasoning if self.reasoning is not None else self.reasoning_content

    def as_dict(self) -> dict[str, Any]:
        """The message as chat templates and the harmony renderer read it: content as text, tool call
        arguments as JSON text (:func:`peagle_jax.chat.format.template_messages` turns them into objects
        for the templates that want them)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.thought() is not None:
            out["reasoning"] = self.thought()
        return out


class FunctionDef(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; None: no parameters
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ReasoningEffort = Literal["low", "medium", "high"]
