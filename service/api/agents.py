"""The OpenAI endpoint of external agents' episodes (env `external`): `OpenAI(base_url=
<service>/v1/episodes/{id}, api_key=<its token>)` plays the episode; POST .../finish ends it."""

from __future__ import annotations

import hmac
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Depends, Header
from fastapi.responses import Response, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from service.agents.chat import (
    OPENAI_TO_SGLANG,
    AgentCallError,
    AgentChat,
    ChatAnswer,
    ChatCall,
    completion_body,
    completion_chunks,
)
from service.api.deps import ServicesDep
from service.api.episodes import EpisodeId
from service.api.errors import (
    Conflict,
    DatabaseUnavailable,
    InvalidRequest,
    NotFound,
    ServiceError,
    Unauthorized,
    responses,
)
from service.api.schemas import REQUEST_CONFIG
from service.api.values import Text, storable_json
from service.app_state import Services
from service.records import EpisodeStatus
from service.storage.agents import (
    AgentEpisode,
    HeldEpisode,
    finish_agent_episode,
    load_agent_episode,
    store_call,
)

router = APIRouter(tags=["agents"])
SSE_MEDIA_TYPE = "text/event-stream"


class EngineFailed(ServiceError):
    status_code = 502
    description = "The engine did not answer the call"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion request. Fields this service has no use for (`tool_choice`,
    `logprobs`, `user`, ...) are accepted and ignored, so that any OpenAI client works."""

    model_config = ConfigDict(extra="ignore")

    model: str = "policy"
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
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
            messages=self.messages,
            tools=self.tools or None,
            sampling=sampling,
            max_tokens=self.max_completion_tokens or self.max_tokens,
        )


class FinishEpisode(BaseModel):
    model_config = REQUEST_CONFIG

    status: Literal["completed", "truncated", "aborted", "failed"] = "completed"
    reward: float | None = None
    info: Annotated[dict[str, Any], AfterValidator(storable_json)] = Field(
        default_factory=dict, description="Merged into the episode's info."
    )
    error: Text | None = Field(default=None, max_length=10_000)


class FinishedOut(BaseModel):
    episode_id: str
    status: str


async def waiting_episode(
    services: ServicesDep, episode_id: EpisodeId, authorization: Annotated[str, Header()] = ""
) -> AgentEpisode:
    """The episode, if the bearer token is its own (or an API key) and it waits for its agent."""
    held = (await services.agent_chat.get()).held.get(episode_id)
    episode = held.restored() if held is not None else await load_agent_episode(services.database, episode_id)
    if episode is None or episode.agent_token is None:
        raise NotFound(f"no external episode {episode_id!r}")
    scheme, _, key = authorization.partition(" ")
    allowed = [episode.agent_token, *services.settings.api_key_list]
    # Every token compared, without an early exit, in constant time per token.
    matches = [hmac.compare_digest(key.strip(), token) for token in allowed]
    if scheme.lower() != "bearer" or not any(matches):
        raise Unauthorized("missing or invalid token: send 'Authorization: Bearer <the episode's api_key>'")
    if not episode.waiting:
        raise Conflict(f"episode {episode_id!r} is {episode.status}: it takes no more calls")
    return episode


WaitingEpisode = Annotated[AgentEpisode, Depends(waiting_episode)]


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
    body: ChatCompletionRequest, services: ServicesDep, episode: WaitingEpisode
) -> Response:
    """The OpenAI chat completions API for one episode's agent: its messages become token ids,
    SGLang samples, and the call is recorded exactly (sampled ids mask 1 with their logprobs,
    everything else mask 0) before the answer goes out."""
    chat = await services.agent_chat.get()
    call = body.call()
    answer, held = await _answer(services, chat, episode, call)
    if held is None and episode.held:
        # What this process held was stale (a call through another process, a cancel, a timeout):
        # read the episode and answer again.
        fresh = await load_agent_episode(services.database, episode.episode_id)
        if fresh is None or not fresh.waiting:
            raise Conflict(f"episode {episode.episode_id!r} takes no more calls")
        answer, held = await _answer(services, chat, fresh, call)
    if held is None:
        raise Conflict(
            f"episode {episode.episode_id!r} ended or took another call meanwhile: this one is not recorded"
        )
    if not body.stream:
        return Response(orjson.dumps(completion_body(answer, body.model)), media_type="application/json")
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    events = [
        b"data: " + orjson.dumps(chunk) + b"\n\n"
        for chunk in completion_chunks(answer, body.model, include_usage)
    ]
    events.append(b"data: [DONE]\n\n")

    async def stream() -> Any:
        for event in events:
            yield event

    return StreamingResponse(stream(), media_type=SSE_MEDIA_TYPE, headers={"Cache-Control": "no-cache"})


async def _answer(
    services: Services, chat: AgentChat, episode: AgentEpisode, call: ChatCall
) -> tuple[ChatAnswer, HeldEpisode | None]:
    """Answers the call and stores it; the stored state is None when the store's fence refused it."""
    try:
        answer = await chat.answer(episode, call)
    except AgentCallError as error:
        kind = {409: Conflict, 400: InvalidRequest}.get(error.status, EngineFailed)
        raise kind(str(error)) from None
    held = await store_call(
        services.database,
        episode,
        answer.segment,
        closed=answer.closed,
        idle_seconds=services.settings.external_idle_seconds,
    )
    if held is None:
        chat.held.pop(episode.episode_id)
    else:
        chat.held.put(episode.episode_id, held)
    return answer, held


@router.post(
    "/v1/episodes/{episode_id}/finish",
    operation_id="finish_agent_episode",
    response_model=FinishedOut,
    responses=responses(NotFound, Conflict, DatabaseUnavailable),
)
async def finish(body: FinishEpisode, services: ServicesDep, episode: WaitingEpisode) -> FinishedOut:
    """Ends the episode with the agent's reward, info and status; its group may be complete now."""
    ended = await finish_agent_episode(
        services.database, episode.episode_id, EpisodeStatus(body.status), body.reward, body.info, body.error
    )
    (await services.agent_chat.get()).held.pop(episode.episode_id)
    if ended is None:
        raise Conflict(f"episode {episode.episode_id!r} already ended")
    services.endings.agent_finished(ended, EpisodeStatus(body.status))
    return FinishedOut(episode_id=episode.episode_id, status=body.status)
