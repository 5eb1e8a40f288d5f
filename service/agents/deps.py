"""The HTTP edge of external agents' endpoints: the episode a request opens (its agent's token
checked), and the one table of the domain's errors as HTTP errors."""

from __future__ import annotations

from types import TracebackType
from typing import Annotated

from fastapi import Depends, Header

from service.agents.errors import AgentError, EngineRefused, EngineUnavailable, EpisodeClosed, UnknownEpisode
from service.agents.repository import AgentEpisode
from service.api.auth import authorized
from service.api.deps import ServicesDep
from service.api.episodes import EpisodeId
from service.api.errors import Conflict, InvalidRequest, NotFound, ServiceError, Unauthorized


class EngineFailed(ServiceError):
    status_code = 502
    description = "The engine did not answer the call"


HTTP_ERRORS: dict[type[AgentError], type[ServiceError]] = {
    UnknownEpisode: NotFound,
    EpisodeClosed: Conflict,
    EngineRefused: InvalidRequest,
    EngineUnavailable: EngineFailed,
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
    services: ServicesDep, episode_id: EpisodeId, authorization: Annotated[str, Header()] = ""
) -> AgentEpisode:
    """The episode, if the bearer token is its own (or an API key) and it waits for its agent.
    Needs no tokenizer: an API-only process answers a 401 without loading one."""
    with http_errors:
        episode = await services.agents.episode(episode_id)
    assert episode.agent_token is not None  # UnknownEpisode otherwise
    keys = [episode.agent_token.encode(), *(key.encode() for key in services.settings.api_key_list)]
    # Starlette decodes headers as latin-1: encoding it back gives the bytes as sent.
    if not authorized(authorization.encode("latin-1", "replace"), keys):
        raise Unauthorized("missing or invalid token: send 'Authorization: Bearer <the episode's api_key>'")
    with http_errors:
        services.agents.check_waiting(episode)
    return episode


WaitingEpisode = Annotated[AgentEpisode, Depends(waiting_episode)]
