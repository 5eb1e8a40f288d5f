"""External agents' endpoints: each protocol's router, and the finish every agent shares."""

from __future__ import annotations

from fastapi import APIRouter

from service.agents import anthropic_messages, chat_completions, openai_responses
from service.agents.deps import WaitingEpisode, http_errors
from service.agents.schemas import FinishedOut, FinishEpisode
from service.api.deps import ServicesDep
from service.api.errors import Conflict, DatabaseUnavailable, NotFound, responses
from service.records import Ending, EpisodeStatus

router = APIRouter(tags=["agents"])
router.include_router(chat_completions.router)  # a protocol: one module, one line here
router.include_router(anthropic_messages.router)
router.include_router(openai_responses.router)


@router.post(
    "/v1/episodes/{episode_id}/finish",
    operation_id="finish_agent_episode",
    response_model=FinishedOut,
    responses=responses(NotFound, Conflict, DatabaseUnavailable),
)
async def finish(body: FinishEpisode, services: ServicesDep, episode: WaitingEpisode) -> FinishedOut:
    """Ends the episode with the agent's reward, info and status; its group may be complete now.
    An episode that made no call ends `failed` instead of `completed` or `truncated` (the answer's
    `status` says so): the model never played it, so it is no sample."""
    with http_errors:
        ending = Ending(EpisodeStatus(body.status), body.reward, body.info, body.error)
        assert episode.agent_token is not None  # WaitingEpisode: an agent plays it
        group, status = await services.agents.finish(episode.episode_id, ending, episode.agent_token)
    services.endings.agent_finished(group, status)
    return FinishedOut(episode_id=episode.episode_id, status=status.value)
