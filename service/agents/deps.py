"""The HTTP edge of external agents' endpoints: the episode a request opens (its agent's token
checked), the one table of the domain's errors as HTTP errors, and an answer streamed as it is
sampled (each protocol gives its events)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from types import TracebackType
from typing import Annotated, Any, Protocol, cast

from fastapi import Depends, Header, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from service.agents.conversation import Answer, ChatCall
from service.agents.errors import (
    AgentError,
    EngineRefused,
    EngineUnavailable,
    EpisodeClosed,
    UnknownEpisode,
    UnknownResponse,
)
from service.agents.repository import AgentEpisode
from service.agents.streaming import AnswerStream, Delta, Kind
from service.api.auth import bearer_key, is_one_of
from service.api.deps import ServicesDep
from service.api.episodes import EpisodeId
from service.api.errors import (
    Conflict,
    ErrorBody,
    InvalidRequest,
    NotFound,
    ServiceError,
    Unauthorized,
    as_service_error,
    error_body,
    error_headers,
)
from service.storage.driven import attempt_of, earlier_attempt

logger = logging.getLogger(__name__)
SSE_MEDIA_TYPE = "text/event-stream"


class EngineFailed(ServiceError):
    status_code = 502
    description = "The engine did not answer the call"


HTTP_ERRORS: dict[type[AgentError], type[ServiceError]] = {
    UnknownEpisode: NotFound,
    EpisodeClosed: Conflict,
    EngineRefused: InvalidRequest,
    EngineUnavailable: EngineFailed,
    UnknownResponse: InvalidRequest,
}
# The request field an error is about, named in the error's `errors` (OpenAI's `param`).
HTTP_ERROR_FIELDS: dict[type[AgentError], list[str | int]] = {UnknownResponse: ["previous_response_id"]}


class _HttpErrors:
    """`with http_errors:` the domain's errors raised inside, as the service's HTTP errors."""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if isinstance(error, AgentError):
            failure = HTTP_ERRORS[type(error)]
            if (location := HTTP_ERROR_FIELDS.get(type(error))) is not None and issubclass(
                failure, InvalidRequest
            ):
                raise failure.field(location, str(error)) from None
            raise failure(str(error)) from None


http_errors = _HttpErrors()


async def waiting_episode(
    services: ServicesDep,
    episode_id: EpisodeId,
    authorization: Annotated[str, Header()] = "",
    x_api_key: Annotated[
        str, Header(description="The episode's token, as Anthropic's clients may send it instead.")
    ] = "",
) -> AgentEpisode:
    """The episode, if the token (`Authorization: Bearer`, or Anthropic's `x-api-key`) is its own
    (or an API key whose scope holds its batch) and it waits for its agent. Needs no tokenizer: an
    API-only process answers a 401 without loading one."""
    # Starlette decodes headers as latin-1: encoding it back gives the bytes as sent.
    key = bearer_key(authorization.encode("latin-1", "replace")) or x_api_key.encode("latin-1", "replace")
    with http_errors:
        episode = await services.agents.episode(episode_id)
        if episode.held and not _owns(key, episode) and _driven(episode):
            # Held by this process, maybe since an earlier attempt of an agent-driven episode.
            episode = await services.agents.episode(episode_id, fresh=True)
        if episode.agent_token is None:  # no agent plays it
            raise UnknownEpisode(f"no external episode {episode_id!r}")
    token = episode.agent_token.encode()
    own = _owns(key, episode)
    access = None if own or not key else services.settings.key_table.lookup(key)
    if not own and access is None:
        earlier = earlier_attempt(key, token)  # the attempt a key shaped as a driven episode's names
        if earlier is not None and await _is_dead_token(services, episode_id, key):
            raise Conflict(
                f"episode {episode_id!r} was re-queued (the worker that ran its driver stopped or was "
                f"lost): this token is attempt {earlier}'s, and attempt {episode.attempt} plays it now; "
                "nothing is recorded, nothing is finished"
            )
        raise Unauthorized("missing or invalid token: send 'Authorization: Bearer <the episode's api_key>'")
    if access is not None and not access.owns(episode.batch_id):  # another project's: as if none
        with http_errors:
            raise UnknownEpisode(f"no external episode {episode_id!r}")
    with http_errors:
        services.agents.check_waiting(episode)
    return episode


async def _is_dead_token(services: ServicesDep, episode_id: str, key: bytes) -> bool:
    """Whether `key` is the token of the episode's last dead attempt: only its holder is told the
    episode was re-queued; any other key shaped like a driven episode's learns nothing of it."""
    dead = await services.agents.dead_token(episode_id)
    return dead is not None and is_one_of(key, [dead.encode()])


def _driven(episode: AgentEpisode) -> bool:
    return episode.agent_token is not None and attempt_of(episode.agent_token.encode()) is not None


def _owns(key: bytes, episode: AgentEpisode) -> bool:
    return bool(key) and episode.agent_token is not None and is_one_of(key, [episode.agent_token.encode()])


WaitingEpisode = Annotated[AgentEpisode, Depends(waiting_episode)]


ProtocolError = Callable[[ServiceError, ErrorBody], dict[str, Any]]


def protocol_errors(fields: ProtocolError) -> type[APIRoute]:
    """A route class whose every error (its body's validation, its episode's token, the engine's)
    answers ErrorBody with a protocol's own error fields beside it (`fields`), which that
    protocol's clients read."""

    class ProtocolRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def answer(request: Request) -> Response:
                try:
                    return await handler(request)
                except Exception as error:
                    failure = protocol_error(request, error, fields)
                    if failure is None:
                        raise
                    return failure

            return answer

    return ProtocolRoute


def protocol_error(request: Request, error: Exception, fields: ProtocolError) -> JSONResponse | None:
    """`error` answered as the service's error with a protocol's own error fields (`fields`);
    None for what the app's handlers answer otherwise (Starlette's own HTTP errors)."""
    failure = as_service_error(request, error)
    if failure is None:
        return None
    body = error_body(failure)
    content = body.model_dump() | fields(failure, body)
    return JSONResponse(content, status_code=failure.status_code, headers=error_headers(failure))


def openai_error(error: ServiceError, body: ErrorBody) -> dict[str, Any]:
    """OpenAI's error fields: `error` with its message, type and the parameter it names."""
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    param = ".".join(str(part) for part in body.errors[0].loc[1:]) if body.errors else None
    return {"error": {"message": body.detail, "type": kind, "param": param or None, "code": None}}


class StreamEvents(Protocol):
    """A protocol's server-sent events for an answer streamed as it is sampled."""

    def start(self, stream: AnswerStream) -> list[bytes]:
        """What opens the stream (sent with the first text, or the whole answer)."""

    def delta(self, kind: Kind, text: str) -> list[bytes]:
        """The next piece of reasoning or visible text."""

    def end(self, answer: Answer) -> list[bytes]:
        """What closes the stream: the tool calls, the finish reason, the usage."""

    def error(self, error: ServiceError) -> list[bytes]:
        """A failure after the stream began (before, it is an HTTP error)."""


_answering: set[asyncio.Task[Answer]] = set()  # streamed calls still answering (their agent may be gone)


async def streamed(
    request: Request, services: ServicesDep, episode: AgentEpisode, call: ChatCall, events: StreamEvents
) -> StreamedAnswer:
    """The call answered as a stream of `events` as the engine samples it. The answer is recorded
    as a non-streamed one would be; a failure before the first text is an HTTP error; an agent
    that goes away mid-stream aborts the generation, and what was sampled is the call's answer."""
    stream = AnswerStream()
    answering = asyncio.get_running_loop().create_task(services.agents.complete(episode, call, stream))
    _answering.add(answering)
    answering.add_done_callback(_answered)
    answering.add_done_callback(stream.wake)
    while not stream.pending and not answering.done():
        await stream.changed()
    if not stream.pending:
        with http_errors:
            answering.result()  # raises the call's failure as an HTTP error

    async def body() -> AsyncIterator[tuple[bytes, bool]]:
        """The events as (bytes, more to come). What is ready when the response can write goes in
        one write: the opening with the text so far, every delta that came meanwhile, the last text
        with the end (each event as it would be alone: only the writes are fewer)."""
        finished = False
        gone = asyncio.ensure_future(_disconnected(request))
        gone.add_done_callback(stream.wake)
        try:
            ready = [*events.start(stream), *_deltas(events, stream.take())]
            while not answering.done():
                if ready:
                    yield b"".join(ready), True
                    ready = []
                if not stream.pending and not answering.done() and not gone.done():
                    await stream.changed()
                if gone.done():
                    return
                ready += _deltas(events, stream.take())
            shown = stream.take()
            try:
                with http_errors:
                    answer = answering.result()
            except ServiceError as error:
                ready += [*_deltas(events, shown), *events.error(error)]
            else:
                assert stream.deltas is not None
                shown += stream.deltas.rest(answer)
                ready += [*_deltas(events, shown), *events.end(answer)]
            finished = True
            yield b"".join(ready), False
        finally:
            gone.remove_done_callback(stream.wake)
            gone.cancel()
            if not finished:
                stream.leave()

    return StreamedAnswer(body())


class StreamedAnswer(Response):
    """A stream of server-sent events, written as its body gives them, the last with the end of
    the response (one write less than Starlette's StreamingResponse, which ends with an empty
    one). Without StreamingResponse's own disconnect listener, which the body has
    (`_disconnected`: the agent gone aborts the generation): under ASGI spec 2.3 (uvicorn's)
    Starlette runs the body in a task group beside a task that waits for the disconnect, and at the
    body's end cancels it through an anyio cancel scope, which formats the task's repr for its
    message: measured a sixth of the service's CPU per streamed call (bench/verifiers_envs.py,
    --profile). A send once the agent is gone does nothing (uvicorn), as under spec 2.4."""

    media_type = SSE_MEDIA_TYPE

    def __init__(self, body: AsyncIterator[tuple[bytes, bool]]) -> None:  # no super(): no body, no length
        self.body_iterator = body
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ended = False
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send(start)
            async for chunk, more in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": more})
                ended = not more
            if not ended:  # the agent went away: the response ends as Starlette's would
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            raise ClientDisconnect() from None
        finally:
            await cast(AsyncGenerator[tuple[bytes, bool]], self.body_iterator).aclose()  # its cleanup now


def _deltas(events: StreamEvents, shown: list[Delta]) -> list[bytes]:
    return [event for kind, text in shown for event in events.delta(kind, text)]


def _answered(task: asyncio.Task[Answer]) -> None:
    _answering.discard(task)
    if not task.cancelled() and (error := task.exception()) is not None and not isinstance(error, AgentError):
        logger.error("a streamed call failed", exc_info=error)


async def _disconnected(request: Request) -> None:
    """Returns when the agent's connection closes (its body was read: nothing else comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
