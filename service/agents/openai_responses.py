"""OpenAI's Responses API for an episode's agent (the OpenAI Agents SDK's default): `OpenAI(
base_url=<service>/v1/episodes/{id}, api_key=<its token>).responses.create(...)`. Its request as a
`ChatCall`, an `Answer` as its response or its server-sent events, and its route."""

from __future__ import annotations

import json
import time
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
    openai_error,
    protocol_errors,
    streamed,
)
from service.agents.schemas import known_type
from service.agents.streaming import AnswerStream, Kind
from service.api.deps import ServicesDep
from service.api.errors import (
    Conflict,
    DatabaseUnavailable,
    InvalidRequest,
    NotFound,
    ServiceError,
    error_body,
    responses,
)
from service.api.values import Text, storable_json

router = APIRouter(route_class=protocol_errors(openai_error))  # tagged by routes.py
_ITEM = ConfigDict(extra="ignore")  # ids, statuses, annotations, ...: accepted, of no use here
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class TextPart(BaseModel):
    model_config = _ITEM
    type: Literal["input_text", "output_text"]
    text: Text


class RefusalPart(BaseModel):
    model_config = _ITEM
    type: Literal["refusal"]
    refusal: Text


ContentPart = Annotated[
    TextPart | RefusalPart,
    Field(discriminator="type"),
    known_type(("input_text", "output_text", "refusal"), "a content part (images and files are not read)"),
]


class MessageItem(BaseModel):
    model_config = _ITEM
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[ContentPart]


class FunctionCallItem(BaseModel):
    model_config = _ITEM
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text = Field(description="The call's arguments, JSON text.")


class FunctionCallOutputItem(BaseModel):
    model_config = _ITEM
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[ContentPart]


class ReasoningText(BaseModel):
    model_config = _ITEM
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(BaseModel):
    """The model's reasoning, as this service returned it: accepted back, its tokens are the sampled ones."""

    model_config = _ITEM
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
    known_type(
        ITEM_TYPES, "an input item (item references, images and files are not read)", untyped="message"
    ),
]


class FunctionTool(BaseModel):
    """A function tool. OpenAI's built-in tools (web search, file search, code interpreter, ...)
    are not served: the agent runs its tools itself."""

    model_config = _ITEM
    type: Text = Field(description="`function`: function tools only.")
    name: Text | None = None
    description: Text | None = None
    parameters: Annotated[dict[str, Any], AfterValidator(storable_json)] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function_tool(cls, kind: str) -> str:
        if kind != "function":
            raise ValueError(
                f"{kind} is one of OpenAI's built-in tools, which this service does not run: send "
                "function tools (name, description, parameters) and run them in the agent"
            )
        return kind

    @model_validator(mode="after")
    def _named(self) -> FunctionTool:
        if self.name is None:
            raise ValueError("a function tool needs its name")
        return self


class FunctionChoice(BaseModel):
    model_config = _ITEM
    type: Literal["function"]
    name: Text


class ResponsesRequest(BaseModel):
    """OpenAI's Responses request. Fields this service has no use for (`reasoning`, `text`,
    `include`, `metadata`, `truncation`, ...) are accepted and ignored, so that any client works."""

    model_config = ConfigDict(extra="ignore")

    model: Text = "policy"
    input: Text | list[InputItem]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = Field(
        default=None,
        description="Accepted; the policy being trained decides whether and which tool it calls.",
    )
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    previous_response_id: Text | None = Field(
        default=None,
        description="Any earlier response of this episode: `input` continues its conversation (what "
        "that call was sent, then its output). Continuing an earlier response than the latest "
        "branches the conversation: the call starts a new segment of the episode.",
    )
    store: bool | None = Field(default=None, description="Accepted: every call of an episode is recorded.")
    parallel_tool_calls: bool | None = None
    stream: bool = False

    def call(self, episode_id: str) -> ChatCall:
        tools = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    **({"description": tool.description} if tool.description is not None else {}),
                    "parameters": tool.parameters or {"type": "object", "properties": {}},
                },
            }
            for tool in self.tools or ()
        ]
        sampling = {
            name: value for name in ("temperature", "top_p") if (value := getattr(self, name)) is not None
        }
        return ChatCall(
            messages=chat_messages(self.instructions, self.input),
            tools=tools or None,
            sampling=sampling,
            max_tokens=self.max_output_tokens,
            previous_call=None if self.previous_response_id is None else self._previous(episode_id),
        )

    def _previous(self, episode_id: str) -> int:
        assert self.previous_response_id is not None
        prefix = _response_prefix(episode_id)
        number = self.previous_response_id.removeprefix(prefix)
        if number == self.previous_response_id or not (number.isascii() and number.isdigit()):
            raise InvalidRequest.field(
                ["previous_response_id"],
                f"not a response of episode {episode_id!r} (its responses are {prefix}<call>)",
            )
        return int(number)


def _response_prefix(episode_id: str) -> str:
    return f"resp_{episode_id}_"


def response_id(episode_id: str, answer: Answer) -> str:
    """A response's id names its episode and call: previous_response_id is read back from it."""
    return f"{_response_prefix(episode_id)}{answer.call}"


def _text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.text if isinstance(part, TextPart) else part.refusal for part in content)


def chat_messages(instructions: str | None, items: str | list[Any]) -> list[dict[str, Any]]:
    """The instructions and input items as chat messages: an assistant's reasoning, message and
    function calls (as one response gives them) as one message with `tool_calls`; each function
    call's output as a tool message (the session names it by its call); a developer's message as a
    system one."""
    chat: list[dict[str, Any]] = [] if instructions is None else [{"role": "system", "content": instructions}]
    if isinstance(items, str):
        return [*chat, {"role": "user", "content": items}]
    turn: dict[str, Any] | None = None  # the assistant message the items so far make up

    def assistant(opens: bool) -> dict[str, Any]:
        nonlocal turn
        if turn is None or opens:
            turn = {"role": "assistant", "content": None}
            chat.append(turn)
        return turn

    for item in items:
        if isinstance(item, ReasoningItem):
            message = assistant(turn is not None and (turn["content"] is not None or "tool_calls" in turn))
            texts = item.content if item.content is not None else item.summary
            message["reasoning_content"] = message.get("reasoning_content", "") + "".join(
                t.text for t in texts
            )
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            assistant(False).setdefault("tool_calls", []).append(call)
        elif isinstance(item, MessageItem) and item.role == "assistant":
            message = assistant(turn is not None and (turn["content"] is not None or "tool_calls" in turn))
            message["content"] = _text(item.content)
        else:
            turn = None
            if isinstance(item, FunctionCallOutputItem):
                result = {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
                chat.append(result)
            else:
                role = "system" if item.role == "developer" else item.role
                chat.append({"role": role, "content": _text(item.content)})
    return chat


def output_items(answer: Answer, response: str) -> list[dict[str, Any]]:
    """The answer as output items: its reasoning, its message, its function calls."""
    items: list[dict[str, Any]] = []
    if answer.reasoning:
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{response}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": answer.reasoning}],
                "status": "completed",
            }
        )
    if answer.content or not answer.tool_calls:
        text = {"type": "output_text", "text": answer.content or "", "annotations": [], "logprobs": []}
        items.append(
            {
                "type": "message",
                "id": f"msg_{response}",
                "role": "assistant",
                "status": "completed",
                "content": [text],
            }
        )
    items += [
        {
            "type": "function_call",
            "id": f"fc_{call.id}",
            "call_id": call.id,
            "name": call.name,
            "arguments": json.dumps(call.arguments),
            "status": "completed",
        }
        for call in answer.tool_calls
    ]
    return items


def response_body(body: ResponsesRequest, answer: Answer, episode_id: str) -> dict[str, Any]:
    response = response_id(episode_id, answer)
    cut = answer.finish_reason == "length"
    return {
        "id": response,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "model": body.model,
        "instructions": body.instructions,
        "output": output_items(answer, response),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": body.tool_choice.model_dump()
        if isinstance(body.tool_choice, BaseModel)
        else body.tool_choice or "auto",
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id,
        "store": body.store is not False,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": {},
        "usage": {
            "input_tokens": answer.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": answer.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        },
    }


class ResponseEvents:
    """The response as Responses streams one (StreamEvents): created and in progress; a
    reasoning item and a message item as sampled (each added, its deltas, done); each function
    call whole; then completed (or incomplete) with the whole response; each event numbered."""

    def __init__(self, body: ResponsesRequest, episode_id: str, call: int) -> None:
        self.body = body
        self.episode_id = episode_id
        self.response = f"{_response_prefix(episode_id)}{call}"  # the call it answers
        self.number = -1
        self.index = -1  # of the output item open or last done
        self.open: dict[str, Any] | None = None  # the open item, its text so far in "text"
        self.message_opened = False

    def _event(self, event: dict[str, Any]) -> bytes:
        self.number += 1
        event = {**event, "sequence_number": self.number}
        return b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"

    def start(self, stream: AnswerStream) -> list[bytes]:
        started = {
            "id": self.response,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": self.body.model,
            "output": [],
        }
        return [
            self._event({"type": "response.created", "response": started}),
            self._event({"type": "response.in_progress", "response": started}),
        ]

    def _message(self) -> dict[str, Any]:
        self.message_opened = True
        return {
            "type": "message",
            "id": f"msg_{self.response}",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": self.index}

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.index += 1
        self.open = {**item, "text": ""}
        events.append(
            self._event({"type": "response.output_item.added", "output_index": self.index, "item": item})
        )
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                self._event(
                    {"type": "response.content_part.added", **self._where(), "content_index": 0, "part": part}
                )
            )
        return events

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        where, text, item = self._where(), self.open.pop("text"), self.open
        self.open = None
        if item["type"] == "reasoning":
            done = {**item, "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}
            events = [
                self._event(
                    {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text}
                )
            ]
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            done = {**item, "content": [part], "status": "completed"}
            events = [
                self._event(
                    {
                        "type": "response.output_text.done",
                        **where,
                        "content_index": 0,
                        "text": text,
                        "logprobs": [],
                    }
                ),
                self._event(
                    {"type": "response.content_part.done", **where, "content_index": 0, "part": part}
                ),
            ]
        return [
            *events,
            self._event(
                {"type": "response.output_item.done", "output_index": where["output_index"], "item": done}
            ),
        ]

    def delta(self, kind: Kind, text: str) -> list[bytes]:
        if kind == "reasoning":
            if self.open is not None and self.open["type"] == "message":
                return []  # the message has begun: never reopened (see streaming.py)
            opened = (
                []
                if self.open is not None
                else self._open(
                    {
                        "type": "reasoning",
                        "id": f"rs_{self.response}",
                        "summary": [],
                        "content": [],
                        "status": "in_progress",
                    }
                )
            )
            kind_event = "response.reasoning_text.delta"
        else:
            opened = [] if self.message_opened and self.open is not None else self._open(self._message())
            kind_event = "response.output_text.delta"
        assert self.open is not None
        self.open["text"] += text
        extra: dict[str, Any] = {"logprobs": []} if kind == "content" else {}
        return [
            *opened,
            self._event({"type": kind_event, **self._where(), "content_index": 0, "delta": text, **extra}),
        ]

    def end(self, answer: Answer) -> list[bytes]:
        response = response_body(self.body, answer, self.episode_id)
        events: list[bytes] = []
        if any(item["type"] == "message" for item in response["output"]) and not self.message_opened:
            events += self._open(self._message())
        events += self._close()
        for item in response["output"]:
            if item["type"] == "function_call":
                self.index += 1
                where = {"item_id": item["id"], "output_index": self.index}
                events += [
                    self._event(
                        {
                            "type": "response.output_item.added",
                            "output_index": self.index,
                            "item": {**item, "arguments": "", "status": "in_progress"},
                        }
                    ),
                    self._event(
                        {
                            "type": "response.function_call_arguments.delta",
                            **where,
                            "delta": item["arguments"],
                        }
                    ),
                    self._event(
                        {
                            "type": "response.function_call_arguments.done",
                            **where,
                            "name": item["name"],
                            "arguments": item["arguments"],
                        }
                    ),
                    self._event(
                        {"type": "response.output_item.done", "output_index": self.index, "item": item}
                    ),
                ]
        return [*events, self._event({"type": f"response.{response['status']}", "response": response})]

    def error(self, error: ServiceError) -> list[bytes]:
        failed: dict[str, Any] = {"id": self.response, "object": "response", "status": "failed", "output": []}
        failed["error"] = {"code": "server_error", "message": error_body(error).detail}
        return [self._event({"type": "response.failed", "response": failed})]


@router.post(
    "/v1/episodes/{episode_id}/responses",
    operation_id="agent_responses",
    responses={
        **responses(InvalidRequest, NotFound, Conflict, EngineFailed, DatabaseUnavailable),
        200: {
            "description": "OpenAI's response, or with `stream: true` its server-sent events.",
            "content": {SSE_MEDIA_TYPE: {"schema": {"type": "string"}}},
        },
    },
)
async def create_response(
    body: ResponsesRequest, request: Request, services: ServicesDep, episode: WaitingEpisode
) -> Response:
    """OpenAI's Responses API for one episode's agent (the OpenAI Agents SDK's default): its input
    becomes token ids, SGLang samples, and the call is recorded exactly, as chat completions' are.
    `previous_response_id` continues any earlier response of the episode (one that is not the
    latest branches the conversation: a new segment); built-in tools are refused."""
    call = body.call(episode.episode_id)
    if body.stream:
        return await streamed(
            request, services, episode, call, ResponseEvents(body, episode.episode_id, episode.calls)
        )
    with http_errors:
        answer = await services.agents.complete(episode, call)
    return Response(
        orjson.dumps(response_body(body, answer, episode.episode_id)), media_type="application/json"
    )
