"""The HTTP edge of external agents' endpoints: the episode a request opens (its agent's token
checked), and the one table of the domain's errors as HTTP errors."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Annotated, Any

from fastapi import Depends, Header, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from service.agents.errors import (
    AgentError,
    EngineRefused,
    EngineUnavailable,
    EpisodeClosed,
    UnknownEpisode,
    UnknownResponse,
)
from service.agents.repository import AgentEpisode
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


class _HttpErrors:
    """`with http_errors:` the domain's errors raised inside, as the service's HTTP errors."""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if isinstance(error, AgentError):
            raise HTTP_ERRORS[type(error)](str(error)) from None


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
    (or an API key) and it waits for its agent. Needs no tokenizer: an API-only process answers a
    401 without loading one."""
    with http_errors:
        episode = await services.agents.episode(episode_id)
    assert episode.agent_token is not None  # UnknownEpisode otherwise
    keys = [episode.agent_token.encode(), *(key.encode() for key in services.settings.api_key_list)]
    # Starlette decodes headers as latin-1: encoding it back gives the bytes as sent.
    key = bearer_key(authorization.encode("latin-1", "replace")) or x_api_key.encode("latin-1", "replace")
    if not key or not is_one_of(key, keys):
        raise Unauthorized("missing or invalid token: send 'Authorization: Bearer <the episode's api_key>'")
    with http_errors:
        services.agents.check_waiting(episode)
    return episode


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
                    failure = as_service_error(request, error)
                    if failure is None:
                        raise
                    body = error_body(failure)
                    return JSONResponse(
                        body.model_dump() | fields(failure, body),
                        status_code=failure.status_code,
                        headers=error_headers(failure),
                    )

            return answer

    return ProtocolRoute


def openai_error(error: ServiceError, body: ErrorBody) -> dict[str, Any]:
    """OpenAI's error fields: `error` with its message, type and the parameter it names."""
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    param = ".".join(str(part) for part in body.errors[0].loc[1:]) if body.errors else None
    return {"error": {"message": body.detail, "type": kind, "param": param or None, "code": None}}
