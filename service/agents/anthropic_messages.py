"""Anthropic's Messages API for an episode's agent: `Anthropic(base_url=<service>/v1/episodes/{id},
api_key=<its token>)` (the SDK calls `<base_url>/v1/messages`; `POST .../messages` is served too).
Its request as a `ChatCall`, an `Answer` as its message or its server-sent events, its errors in
Anthropic's shape, and its route."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from service.agents.conversation import Answer, ChatCall
from service.agents.deps import (
    SSE_MEDIA_TYPE,
    EngineFailed,
    WaitingEpisode,
    http_errors,
    protocol_errors,
    streamed,
)
from service.agents.schemas import known_type
from service.agents.streaming import AnswerStream, Kind
from service.api.deps import ServicesDep
from service.api.errors import (
    Conflict,
    DatabaseUnavailable,
    ErrorBody,
    InvalidRequest,
    NotFound,
    ServiceError,
    error_body,
    responses,
)
from service.api.values import Text, storable_json

# What the agent gets back as a thinking block's signature: Anthropic's is a proof of its own
# reasoning; here the block is accepted back as it is, whatever it carries.
THINKING_SIGNATURE = "rollout-service"
# Anthropic's error types by HTTP status; this service keeps its own statuses (a 422 for a body it
# refuses, a 409 for an episode that takes no more calls).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def messages_error(error: ServiceError, body: ErrorBody) -> dict[str, Any]:
    """Anthropic's error fields: `type: "error"`, and `error` with its type and message."""
    kind = ERROR_TYPES.get(error.status_code, "api_error")
    return {"type": "error", "error": {"type": kind, "message": body.detail}}


router = APIRouter(route_class=protocol_errors(messages_error))  # tagged by routes.py
Json = Annotated[dict[str, Any], AfterValidator(storable_json)]
_BLOCK = ConfigDict(extra="ignore")  # cache_control, citations, ...: accepted, of no use here


class TextBlock(BaseModel):
    model_config = _BLOCK
    type: Literal["text"]
    text: Text


class ThinkingBlock(BaseModel):
    """The model's reasoning, as this service returned it: accepted back (its `signature` too, not
    read), its tokens are the sampled ones."""

    model_config = _BLOCK
    type: Literal["thinking"]
    thinking: Text


class RedactedThinkingBlock(BaseModel):
    """Accepted and left out (its `data` is not read): the model's tokens are the sampled ones."""

    model_config = _BLOCK
    type: Literal["redacted_thinking"]


class ToolUseBlock(BaseModel):
    model_config = _BLOCK
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: Json


class ToolResultBlock(BaseModel):
    model_config = _BLOCK
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = Field(default="", description="The result as text (JSON text too).")
    is_error: bool = False


ContentBlock = Annotated[
    TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock,
    Field(discriminator="type"),
    known_type(
        ("text", "thinking", "redacted_thinking", "tool_use", "tool_result"),
        "a content block (images and documents are not read)",
    ),
]


class InputMessage(BaseModel):
    model_config = _BLOCK
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]


class Tool(BaseModel):
    """A client tool. Anthropic's server tools (web search, code execution, ...) are not served:
    the agent runs its tools itself."""

    model_config = _BLOCK
    type: Text | None = Field(default=None, description="`custom` or none: client tools only.")
    name: Text
    description: Text | None = None
    input_schema: Json | None = None

    @field_validator("type")
    @classmethod
    def _client_tool(cls, kind: str | None) -> str | None:
        if kind not in (None, "custom"):
            raise ValueError(
                f"{kind} is one of Anthropic's server tools, which this service does not run: "
                "send client tools (name, description, input_schema) and run them in the agent"
            )
        return kind

    @model_validator(mode="after")
    def _with_schema(self) -> Tool:
        if self.input_schema is None:
            raise ValueError("a client tool needs its input_schema")
        return self


class ToolChoice(BaseModel):
    """Accepted (a tool's `name` too, not read); the policy being trained decides whether and which
    tool it calls."""

    model_config = _BLOCK
    type: Literal["auto", "any", "tool", "none"]
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(BaseModel):
    """Accepted; whether the model thinks is its chat template's and its training's to say."""

    model_config = _BLOCK
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(BaseModel):
    """Anthropic's Messages request. Fields this service has no use for (`metadata`,
    `service_tier`, ...) are accepted and ignored, so that any Anthropic client works."""

    model_config = ConfigDict(extra="ignore")

    model: Text = "policy"
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    stop_sequences: list[Annotated[Text, Field(min_length=1)]] | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    stream: bool = False

    def call(self) -> ChatCall:
        sampling: dict[str, Any] = {
            name: value
            for name in ("temperature", "top_p", "top_k")
            if (value := getattr(self, name)) is not None
        }
        if self.stop_sequences:
            sampling["stop"] = self.stop_sequences
        tools = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    **({"description": tool.description} if tool.description is not None else {}),
                    "parameters": tool.input_schema,
                },
            }
            for tool in self.tools or ()
        ]
        return ChatCall(
            messages=chat_messages(self.system, self.messages),
            tools=tools or None,
            sampling=sampling,
            max_tokens=self.max_tokens,
        )


def _joined(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def chat_messages(system: str | list[TextBlock] | None, messages: list[InputMessage]) -> list[dict[str, Any]]:
    """Anthropic's conversation as chat messages: the system prompt first; an assistant's text,
    thinking and tool_use blocks as one message (its `tool_calls`); a user's tool_result blocks as
    tool messages (the session names each by its call) and its text as a user message, in the order sent."""
    chat: list[dict[str, Any]] = [] if system is None else [{"role": "system", "content": _joined(system)}]
    for message in messages:
        if isinstance(message.content, str):
            chat.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            chat.append(_assistant(message.content))
        else:
            chat += _user(message.content)
    return chat


def _assistant(blocks: list[Any]) -> dict[str, Any]:
    text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
    reasoning = "".join(block.thinking for block in blocks if isinstance(block, ThinkingBlock))
    calls = [block for block in blocks if isinstance(block, ToolUseBlock)]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.input},
            }
            for call in calls
        ]
    return message


def _user(blocks: list[Any]) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    text: list[str] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            if text:
                chat.append({"role": "user", "content": "".join(text)})
                text = []
            result: dict[str, Any] = {
                "role": "tool",
                "tool_call_id": block.tool_use_id,
                "content": _joined(block.content),
            }
            if block.is_error:
                result["is_error"] = True  # kept in the transcript; chat templates have no place for it
            chat.append(result)
        elif isinstance(block, TextBlock):
            text.append(block.text)
    if text or not chat:
        chat.append({"role": "user", "content": "".join(text)})
    return chat


def stop_reason(answer: Answer) -> str:
    if answer.finish_reason == "tool_calls":
        return "tool_use"
    if answer.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if answer.stop_sequence is not None else "end_turn"


def content_blocks(answer: Answer) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if answer.reasoning:
        blocks.append({"type": "thinking", "thinking": answer.reasoning, "signature": THINKING_SIGNATURE})
    if answer.content:
        blocks.append({"type": "text", "text": answer.content})
    blocks += [
        {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
        for call in answer.tool_calls
    ]
    return blocks


def _usage(answer: Answer, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": answer.prompt_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_body(answer: Answer, model: str, content: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(answer) if content is None else content,
        "stop_reason": stop_reason(answer),
        "stop_sequence": answer.stop_sequence,
        "usage": _usage(answer, answer.completion_tokens),
    }


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class MessageEvents:
    """The answer as Anthropic streams one (StreamEvents): message_start; a thinking block and a
    text block as sampled (each block's start, deltas and stop); each tool_use block whole;
    message_delta (the stop reason and the usage); message_stop."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.index = -1  # of the block open or last closed
        self.open: str | None = None  # the open block's type

    def start(self, stream: AnswerStream) -> list[bytes]:
        message: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": stream.prompt_tokens,
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
        return [_event("message_start", {"type": "message_start", "message": message})]

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.index += 1
        self.open = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*events, _event("content_block_start", start)]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(self._block_delta({"type": "signature_delta", "signature": THINKING_SIGNATURE}))
        self.open = None
        return [*events, _event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _block_delta(self, delta: dict[str, Any]) -> bytes:
        return _event(
            "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
        )

    def delta(self, kind: Kind, text: str) -> list[bytes]:
        if kind == "reasoning":
            if self.open == "text":
                return []  # the text has begun: never reopened (see streaming.py)
            opened = (
                []
                if self.open == "thinking"
                else self._open({"type": "thinking", "thinking": "", "signature": ""})
            )
            return [*opened, self._block_delta({"type": "thinking_delta", "thinking": text})]
        opened = [] if self.open == "text" else self._open({"type": "text", "text": ""})
        return [*opened, self._block_delta({"type": "text_delta", "text": text})]

    def end(self, answer: Answer) -> list[bytes]:
        events = self._close()
        for call in answer.tool_calls:
            events += self._open({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            events.append(
                self._block_delta({"type": "input_json_delta", "partial_json": json.dumps(call.arguments)})
            )
            events += self._close()
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(answer), "stop_sequence": answer.stop_sequence},
            "usage": {"output_tokens": answer.completion_tokens},
        }
        return [*events, _event("message_delta", delta), _event("message_stop", {"type": "message_stop"})]

    def error(self, error: ServiceError) -> list[bytes]:
        return [_event("error", messages_error(error, error_body(error)))]


@router.post(
    "/v1/episodes/{episode_id}/messages",
    operation_id="agent_messages",
    responses={
        **responses(InvalidRequest, NotFound, Conflict, EngineFailed, DatabaseUnavailable),
        200: {
            "description": "Anthropic's message, or with `stream: true` its server-sent events.",
            "content": {SSE_MEDIA_TYPE: {"schema": {"type": "string"}}},
        },
    },
)
@router.post("/v1/episodes/{episode_id}/v1/messages", include_in_schema=False)  # the SDK's base-URL form
async def messages(
    body: MessagesRequest, request: Request, services: ServicesDep, episode: WaitingEpisode
) -> Response:
    """Anthropic's Messages API for one episode's agent (its SDK's `base_url` is the episode's
    `base_url`): its messages become token ids, SGLang samples, and the call is recorded exactly, as
    chat completions' are. Every error answers in Anthropic's shape too: ErrorBody's `detail` and
    `errors`, with `type: "error"` and `error: {type, message}` (e.g. `not_found_error`) beside them."""
    call = body.call()
    if body.stream:
        return await streamed(request, services, episode, call, MessageEvents(body.model))
    with http_errors:
        answer = await services.agents.complete(episode, call)
    return Response(orjson.dumps(message_body(answer, body.model)), media_type="application/json")
