"""POST /episodes (submit a batch) and GET /episodes/{id} (one episode, whole)."""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, status
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from service.api.deps import ReadSessionDep, ServicesDep
from service.api.errors import Conflict, InvalidRequest, NotFound, PayloadTooLarge, responses
from service.api.schemas import EpisodeDetail, EpisodeSummary, SubmitAccepted, SubmitEpisodes, TurnOut
from service.app_state import Services
from service.storage.batches import NewEpisode, enqueue_batch, get_batch
from service.storage.models import Episode

router = APIRouter(tags=["episodes"])


def request_hash(body: SubmitEpisodes) -> str:
    canonical = json.dumps(body.model_dump(mode="json", exclude={"batch_id"}), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def validate_submission(body: SubmitEpisodes, services: Services) -> None:
    spec = services.envs.get(body.env)
    if spec is None:
        raise InvalidRequest.field(
            ["env"], f"unknown environment {body.env!r}; known: {sorted(services.envs)}"
        )
    if body.task_split not in spec.splits:
        raise InvalidRequest.field(
            ["task_split"], f"{body.env} has no split {body.task_split!r}; known: {sorted(spec.splits)}"
        )
    size = spec.splits[body.task_split]
    for position, index in enumerate(body.task_indices):
        if not 0 <= index < size:
            raise InvalidRequest.field(
                ["task_indices", position],
                f"task index {index} out of range: {body.env} {body.task_split} has tasks 0..{size - 1}",
            )
    total = len(body.task_indices) * body.samples_per_task
    if total > services.settings.max_episodes_per_request:
        raise PayloadTooLarge(
            f"{total} episodes in one request; at most {services.settings.max_episodes_per_request}"
        )


async def _episode_ids(session: ReadSessionDep, batch_id: str) -> list[str]:
    rows = await session.scalars(
        select(Episode.id)
        .where(Episode.batch_id == batch_id)
        .order_by(Episode.group_index, Episode.sample_index)
    )
    return list(rows)


@router.post(
    "/episodes",
    operation_id="submit_episodes",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=SubmitAccepted,
    responses=responses(InvalidRequest, Conflict, PayloadTooLarge),
)
async def submit_episodes(body: SubmitEpisodes, services: ServicesDep) -> SubmitAccepted:
    """Queue `samples_per_task` episodes of each task; the samples of one task form one group."""
    validate_submission(body, services)
    batch_id = body.batch_id or uuid.uuid4().hex
    digest = request_hash(body)
    sampling_params = body.sampling_params.to_sglang()
    new = [
        NewEpisode(
            group_index=group,
            sample_index=sample,
            env=body.env,
            task_split=body.task_split,
            task_index=task_index,
            sampling_params=sampling_params,
            max_turns=body.max_turns,
            max_response_tokens=body.max_response_tokens,
        )
        for group, task_index in enumerate(body.task_indices)
        for sample in range(body.samples_per_task)
    ]
    insert_error: IntegrityError | None = None
    try:
        async with services.database.sessionmaker.begin() as session:
            existing = await get_batch(session, batch_id)
            if existing is None:
                await enqueue_batch(
                    session,
                    batch_id=batch_id,
                    request_hash=digest,
                    env=body.env,
                    task_split=body.task_split,
                    metadata=body.metadata,
                    episodes=new,
                )
            created = existing is None
    except IntegrityError as error:  # a concurrent submission of the same batch id may have won
        insert_error, created = error, False
    async with services.database.reader() as session:
        if not created:
            stored = await get_batch(session, batch_id)
            if stored is None and insert_error is not None:
                raise insert_error  # not a duplicate batch id: a real integrity failure
            assert stored is not None
            if stored.request_hash != digest:
                raise Conflict(f"batch {batch_id!r} exists with a different request; use another batch_id")
        episode_ids = await _episode_ids(session, batch_id)
    if created and services.worker is not None:
        services.worker.wake()
    if created:
        services.metrics.episodes_submitted(len(episode_ids))
    return SubmitAccepted(batch_id=batch_id, episode_ids=episode_ids, created=created)


async def valid_episode(episode_id: Annotated[str, Path(max_length=128)], session: ReadSessionDep) -> Episode:
    episode = await session.get(Episode, episode_id)
    if episode is None:
        raise NotFound(f"no episode {episode_id!r}")
    return episode


def summarize(episode: Episode, *, prompt_length: int | None, response_length: int | None) -> dict[str, Any]:
    return {
        "id": episode.id,
        "status": episode.status,
        "reward": episode.reward,
        "group_index": episode.group_index,
        "sample_index": episode.sample_index,
        "task_index": episode.task_index,
        "attempt": episode.attempt,
        "num_turns": episode.num_turns,
        "prompt_length": prompt_length,
        "response_length": response_length,
        "error": episode.error,
    }


def token_fields(episode: Episode) -> dict[str, Any]:
    tokens = episode.tokens()
    return {
        "prompt_ids": tokens.prompt_ids if tokens else None,
        "response_ids": tokens.response_ids if tokens else None,
        "loss_mask": tokens.loss_mask if tokens else None,
        "rollout_logprobs": tokens.rollout_logprobs if tokens else None,
        "weight_versions": [turn.get("weight_version") for turn in episode.turns or []],
    }


@router.get(
    "/episodes/{episode_id}",
    operation_id="get_episode",
    response_model=EpisodeDetail,
    responses=responses(NotFound),
)
async def get_episode(episode: Annotated[Episode, Depends(valid_episode)]) -> EpisodeDetail:
    """One episode with its token arrays as JSON lists, its transcript, env info and turns."""
    tokens = token_fields(episode)
    turns = [TurnOut(**turn) for turn in episode.turns or []]
    return EpisodeDetail(
        **summarize(
            episode,
            prompt_length=None if tokens["prompt_ids"] is None else len(tokens["prompt_ids"]),
            response_length=None if tokens["response_ids"] is None else len(tokens["response_ids"]),
        ),
        **tokens,
        batch_id=episode.batch_id,
        env=episode.env,
        task_split=episode.task_split,
        sampling_params=episode.sampling_params,
        max_turns=episode.max_turns,
        messages=episode.messages,
        info=episode.info,
        finish_reasons=[turn.finish_reason for turn in turns],
        turns=turns,
        created_at=episode.created_at,
        started_at=episode.started_at,
        finished_at=episode.finished_at,
    )


__all__ = ["EpisodeSummary", "router", "summarize"]
