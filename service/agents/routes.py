"""External agents' endpoints: each protocol's router, and the finish every agent shares."""

from __future__ import annotations

from fastapi import APIRouter

from service.agents import chat_completions
from service.agents.deps import WaitingEpisode, http_errors
from service.agents.schemas import FinishedOut, FinishEpisode
from service.api.deps import ServicesDep
from service.api.errors import Conflict, DatabaseUnavailable, NotFound, responses
from service.records import EpisodeStatus

router = APIRouter(tags=["agents"])
router.include_router(chat_completions.router)  # a protocol: one module, one line here


@router.post(
    "/v1/episodes/{episode_id}/finish",
    operation_id="finish_agent_episode",
    response_model=FinishedOut,
    responses=responses(NotFound, Conflict, DatabaseUnavailable),
)
async def finish(body: FinishEpisode, services: ServicesDep, episode: WaitingEpisode) -> FinishedOut:
    """Ends the episode with the agent's reward, info and status; its group may be complete now."""
    status = EpisodeStatus(body.status)
    with http_errors:
        ended = await services.agents.finish(episode.episode_id, status, body.reward, body.info, body.error)
    services.endings.agent_finished(ended, status)
    return FinishedOut(episode_id=episode.episode_id, status=body.status)
