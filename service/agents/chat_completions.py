"""OpenAI's Chat Completions API for an episode's agent: `OpenAI(base_url=<service>/v1/episodes/{id},
api_key=<its token>)`. Its request as a `ChatCall`, an `Answer` as its response or its server-sent
events, and its route."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.agents.conversation import Answer, ChatCall
from service.agents.deps import (
    SSE_MEDIA_TYPE,
    EngineFailed,
    WaitingEpisode,
    http_errors,
    openai_error,
    protocol_error,
    protocol_errors,
    streamed,
    waiting_episode,
)
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
from service.api.schemas import ID_PATTERN
from service.api.values import Text, storable_json

router = APIRouter(route_class=protocol_errors(openai_error))  # tagged by routes.py

# The agent's sampling parameters that map onto SGLang's; the trainer's (POST /episodes) win.
OPENAI_TO_SGLANG = {
    "temperature": "temperature",
    "top_p": "top_p",
    "stop": "stop",
    "seed": "sampling_seed",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion request. Fields this service has no use for (`tool_choice`,
    `logprobs`, `user`, ...) are accepted and ignored, so that any OpenAI client works."""

    model_config = ConfigDict(extra="ignore")

    model: Text = "policy"
    messages: Annotated[list[dict[str, Any]], AfterValidator(storable_json)] = Field(min_length=1)
    tools: Annotated[list[dict[str, Any]], AfterValidator(storable_json)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: Text | list[Text] | None = None
    seed: int | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)

    def call(self) -> ChatCall:
        for position, message in enumerate(self.messages):
            if not isinstance(message.get("role"), str):
                raise InvalidRequest.field(["messages", position, "role"], "every message needs a role")
        sampling = {
            sglang: value
            for name, sglang in OPENAI_TO_SGLANG.items()
            if (value := getattr(self, name)) is not None
        }
        if isinstance(sampling.get("stop"), str):
            sampling["stop"] = [sampling["stop"]]
        return ChatCall(
            messages=self.messages,  # OpenAI's messages are the conversation's own shape
            tools=self.tools or None,
            sampling=sampling,
            max_tokens=self.max_completion_tokens or self.max_tokens,
        )


def completion_body(answer: Answer, model: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": answer.message, "finish_reason": answer.finish_reason, "logprobs": None}
        ],
        "usage": _usage(answer),
    }


def _usage(answer: Answer) -> dict[str, int]:
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
    }


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


class CompletionChunks:
    """The answer as OpenAI streams one (StreamEvents): the role, the reasoning and content as
    sampled, each tool call, the finish reason, and (with stream_options.include_usage) a last
    chunk with the usage and no choices."""

    def __init__(self, model: str, include_usage: bool) -> None:
        self.include_usage = include_usage
        self.head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        # Every chunk is `data: {**head, "choices": ...}`: the head's JSON is written once and
        # each chunk's bytes are those orjson would write for the whole dict (its keys in order).
        self._opening = b"data: " + orjson.dumps(self.head)[:-1] + b',"choices":'

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._opening + orjson.dumps([choice]) + b"}\n\n"

    def start(self, stream: AnswerStream) -> list[bytes]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def delta(self, kind: Kind, text: str) -> list[bytes]:
        return [self._chunk({"reasoning_content" if kind == "reasoning" else "content": text})]

    def end(self, answer: Answer) -> list[bytes]:
        chunks = [
            self._chunk({"tool_calls": [{"index": index, **call}]})
            for index, call in enumerate(answer.message.get("tool_calls") or ())
        ]
        chunks.append(self._chunk({}, answer.finish_reason))
        if self.include_usage:
            chunks.append(self._opening + b'[],"usage":' + orjson.dumps(_usage(answer)) + b"}\n\n")
        return [*chunks, b"data: [DONE]\n\n"]

    def error(self, error: ServiceError) -> list[bytes]:
        return [_sse(openai_error(error, error_body(error))), b"data: [DONE]\n\n"]


@router.post(
    "/v1/episodes/{episode_id}/chat/completions",
    operation_id="agent_chat_completions",
    responses={
        **responses(InvalidRequest, NotFound, Conflict, EngineFailed, DatabaseUnavailable),
        200: {
            "description": "OpenAI's chat completion, or with `stream: true` its server-sent events.",
            "content": {SSE_MEDIA_TYPE: {"schema": {"type": "string"}}},
        },
    },
)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, services: ServicesDep, episode: WaitingEpisode
) -> Response:
    """The OpenAI chat completions API for one episode's agent: its messages become token ids,
    SGLang samples, and the call is recorded exactly (sampled ids mask 1 with their logprobs,
    everything else mask 0) before the answer goes out."""
    call = body.call()
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return await streamed(request, services, episode, call, CompletionChunks(body.model, include_usage))
    with http_errors:
        answer = await services.agents.complete(episode, call)
    return Response(orjson.dumps(completion_body(answer, body.model)), media_type="application/json")


# POST /v1/episodes/{episode_id}/chat/completions, its id as EpisodeId takes it.
_CHAT_PATH = re.compile("/v1/episodes/(" + ID_PATTERN.strip("^$") + ")/chat/completions")
_JSON = re.compile(r"application/json\s*(;\s*charset=\"?utf-8\"?\s*)?", re.IGNORECASE)


class ChatCompletionsFastPath:
    """The chat completions route of agents' episodes without FastAPI's routing, dependency
    solving and exception middleware, for a request the route would take as it is: a JSON body of
    a declared length that parses and validates as ChatCompletionRequest, and no query. Anything
    else (a bad body, a query, a chunked body, another content type) goes to the route as it came,
    which answers it (its 4xx naming the field), so both answer alike; the route stays the API's
    contract (OpenAPI). Auth is the route's (`waiting_episode`), its errors the route's
    (`protocol_error`). Hand-written on a measured hot path: an agent-driven env's harness calls
    the model only over HTTP, and FastAPI's machinery (the route matched among all the API's, the
    dependencies solved, the exception middleware's send wrapper) was about a third of its HTTP
    handling (bench/verifiers_envs.py --profile). Sits inside GuardMiddleware (API keys, body size)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = _CHAT_PATH.fullmatch(scope["path"]) if scope["type"] == "http" else None
        if path is None or scope["method"] != "POST" or scope["query_string"]:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length", "")
        if not length.isdigit() or not _JSON.fullmatch(headers.get("content-type", "")):
            await self.app(scope, receive, send)
            return
        body, messages = await _read_body(receive)
        if body is None:  # the agent went away before its body came whole
            return
        try:
            request = ChatCompletionRequest.model_validate(orjson.loads(body))
        except (orjson.JSONDecodeError, ValidationError):  # the route tells what is wrong
            await self.app(scope, _replay(messages, receive), send)
            return
        await self._answer(scope, receive, send, path.group(1), headers, request)

    @staticmethod
    async def _answer(
        scope: Scope,
        receive: Receive,
        send: Send,
        episode_id: str,
        headers: Headers,
        body: ChatCompletionRequest,
    ) -> None:
        http = Request(scope, receive)
        services = scope["state"]["services"]
        try:
            authorization, api_key = headers.get("authorization", ""), headers.get("x-api-key", "")
            episode = await waiting_episode(services, episode_id, authorization, api_key)
            response = await chat_completions(body, http, services, episode)
        except Exception as error:
            failure = protocol_error(http, error, openai_error)
            if failure is None:
                raise
            response = failure
        await response(scope, receive, send)


async def _read_body(receive: Receive) -> tuple[bytes | None, list[Message]]:
    """The request's body and the messages it came in; None if the client went away first."""
    messages: list[Message] = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return None, messages
        if not message.get("more_body", False):
            return b"".join(part.get("body", b"") for part in messages), messages


def _replay(messages: list[Message], receive: Receive) -> Callable[[], Awaitable[Message]]:
    """`receive` with the messages already read given first."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
