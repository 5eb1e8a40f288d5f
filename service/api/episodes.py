"""POST /episodes (submit a batch), GET /episodes/{id} (one episode, whole) and
GET /episodes/{id}/tokens (its tokens as text, for people)."""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, status
from sqlalchemy import Select, select

from service.agents.repository import agent_tokens
from service.api.access import AccessDep
from service.api.contract import link
from service.api.deps import LONG_POLL_CUT, ServicesDep, long_poll
from service.api.episode_detail import episode_detail
from service.api.errors import (
    Conflict,
    DatabaseUnavailable,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    responses,
)
from service.api.schemas import (
    ID_PATTERN,
    AgentEndpoint,
    EpisodeDetail,
    EpisodeTokenView,
    SubmitAccepted,
    SubmitEpisodes,
)
from service.api.token_view import episode_token_view
from service.app_state import Services
from service.config import Access, Settings
from service.engine.vllm import unsupported_by_vllm
from service.envs.plugins import failed_plugin_for
from service.records import EXTERNAL_ENV, FINISHED_STATUSES, EpisodeRequest
from service.storage.batches import BatchConflict, NewBatch, NewEpisode, submit_batch
from service.storage.db import starts_with
from service.storage.models import Episode, EpisodeSegment

router = APIRouter(tags=["episodes"])
EpisodeId = Annotated[str, Path(max_length=128, pattern=ID_PATTERN)]


# Where an accepted submission's ids are taken next, and an episode's.
_FIRST_EPISODE = "$response.body#/episode_ids/0"
SUBMIT_LINKS = {
    "batch": link(
        "get_batch", "The batch, as it runs and once complete.", batch_id="$response.body#/batch_id"
    ),
    "first_episode": link(
        "get_episode", "One of its episodes (any of episode_ids).", episode_id=_FIRST_EPISODE
    ),
    "batch_episodes": link(
        "list_batch_episodes", "Every episode of the batch.", batch_id="$response.body#/batch_id"
    ),
    "batch_groups": link(
        "get_groups", "The batch's complete groups.", **{"query.batch_id": "$response.body#/batch_id"}
    ),
    "cancel": link("cancel_batch", "Cancel what has not finished.", batch_id="$response.body#/batch_id"),
} | {
    name: link(operation, "An external agent's call (env `external`).", episode_id=_FIRST_EPISODE)
    for name, operation in (
        ("agent_chat_completions", "agent_chat_completions"),
        ("agent_messages", "agent_messages"),
        ("agent_responses", "agent_responses"),
        ("agent_finish", "finish_agent_episode"),
    )
}
EPISODE_LINKS = {
    "tokens": link(
        "get_episode_tokens", "Its response tokens as text.", episode_id="$request.path.episode_id"
    ),
    "batch": link("get_batch", "Its batch.", batch_id="$response.body#/batch_id"),
}


def request_hash(body: SubmitEpisodes) -> str:
    canonical = json.dumps(body.model_dump(mode="json", exclude={"batch_id"}), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def validate_submission(body: SubmitEpisodes, services: Services) -> SubmitEpisodes:
    """Refuses what cannot run (a 422 naming the field); the body with its `task_split` filled in
    where the env declares its training split."""
    if services.settings.engine == "vllm":
        params = body.sampling_params.to_sglang()
        if (name := unsupported_by_vllm(params)) is not None:
            raise InvalidRequest.field(
                ["sampling_params", name], f"{name} is not supported by this service's engine (vLLM)"
            )
    if body.env == EXTERNAL_ENV:  # the agent's own tasks: their indices and split are its labels
        _check_size(body, services)
        return body if body.task_split is not None else body.model_copy(update={"task_split": ""})
    spec = services.envs.get(body.env) or failed_plugin_for(services.envs, body.env)
    if spec is None:
        raise InvalidRequest.field(
            ["env"], f"unknown environment {body.env!r}; known: {sorted([*services.envs, EXTERNAL_ENV])}"
        )
    if "*" in spec.unavailable:  # no split can run: it says why
        raise InvalidRequest.field(["env"], f"{body.env} cannot run here: {spec.unavailable['*']}")
    if body.task_split is None:
        if spec.train_split is None:
            raise InvalidRequest.field(
                ["task_split"],
                f"task_split is required: {body.env} declares no training split to default to; "
                f"its splits: {sorted(spec.splits)}",
            )
        body = body.model_copy(update={"task_split": spec.train_split})
    if body.task_split not in spec.splits:
        raise InvalidRequest.field(
            ["task_split"], f"{body.env} has no split {body.task_split!r}; known: {sorted(spec.splits)}"
        )
    if (why := spec.unavailable.get(body.task_split)) is not None:
        raise InvalidRequest.field(["task_split"], f"{body.env} {body.task_split} cannot run here: {why}")
    size = spec.splits[body.task_split]
    judged = (
        spec.judged_tasks.get(body.task_split, frozenset())
        if not services.settings.user_sim.judge_base_url
        else ()
    )
    for position, index in enumerate(body.task_indices):
        if not 0 <= index < size:
            raise InvalidRequest.field(
                ["task_indices", position],
                f"task index {index} out of range: {body.env} {body.task_split} has tasks 0..{size - 1}",
            )
        if index in judged:
            raise InvalidRequest.field(
                ["task_indices", position],
                f"task {index} of {body.env} {body.task_split} is graded by an LLM judge (its reward "
                "basis has NL_ASSERTION) and this service has none: set JUDGE_BASE_URL and JUDGE_MODEL",
            )
    _check_size(body, services)
    return body


def _check_size(body: SubmitEpisodes, services: Services) -> None:
    total = len(body.task_indices) * body.samples_per_task
    if total > services.settings.max_episodes_per_request:
        raise PayloadTooLarge(
            f"{total} episodes in one request; at most {services.settings.max_episodes_per_request}"
        )


def scoped_batch_id(body: SubmitEpisodes, access: Access) -> str:
    """The body's batch id, if the caller's scope holds it (a 422 naming `batch_id` and the prefix
    otherwise); a new one in the scope when it names none."""
    if body.batch_id is None:
        return access.batch_prefix + uuid.uuid4().hex
    if not access.owns(body.batch_id):
        raise InvalidRequest.field(
            ["batch_id"],
            f"the batch ids of project {access.project!r} start with {access.batch_prefix!r} "
            "(GET /access tells a key its prefix)",
        )
    return body.batch_id


def new_batch(body: SubmitEpisodes, settings: Settings, batch_id: str | None = None) -> NewBatch:
    """The batch of a validated body (its task_split filled in by validate_submission), under
    `batch_id` (default: the body's, or a new one)."""
    sampling_params = body.sampling_params.to_sglang()
    task_split = body.task_split or ""
    return NewBatch(
        agent_idle_seconds=settings.external_idle_seconds if body.env == EXTERNAL_ENV else None,
        batch_id=batch_id or body.batch_id or uuid.uuid4().hex,
        request_hash=request_hash(body),
        env=body.env,
        task_split=task_split,
        metadata=body.metadata,
        episodes=[
            NewEpisode(
                group,
                sample,
                EpisodeRequest(
                    env=body.env,
                    task_split=task_split,
                    task_index=task_index,
                    sampling_params=sampling_params,
                    max_turns=body.max_turns,
                    max_response_tokens=body.max_response_tokens,
                    max_staleness=body.max_staleness,
                    episode_timeout_seconds=body.episode_timeout_seconds,
                ),
            )
            for group, task_index in enumerate(body.task_indices)
            for sample in range(body.samples_per_task)
        ],
    )


@router.post(
    "/episodes",
    operation_id="submit_episodes",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=SubmitAccepted,
    responses={
        **responses(InvalidRequest, Conflict, PayloadTooLarge, DatabaseUnavailable),
        202: {"links": SUBMIT_LINKS},
    },
)
async def submit_episodes(
    body: SubmitEpisodes, services: ServicesDep, access: AccessDep, request: Request
) -> SubmitAccepted:
    """Queue `samples_per_task` episodes of each task; the samples of one task form one group.
    Env `external`: the episodes wait for external agents instead, each at its own OpenAI
    endpoint (`agents`); `task_indices` and `task_split` are then the caller's labels. A project
    key's batch id must start with its prefix (GET /access); one it leaves out is made with it."""
    batch_id = scoped_batch_id(body, access)
    batch = new_batch(validate_submission(body, services), services.settings, batch_id)
    try:
        submission = await submit_batch(services.database, batch)
    except BatchConflict as error:
        raise Conflict(str(error)) from None
    if submission.created:
        services.metrics.episodes_submitted(len(submission.episode_ids))
        if services.worker is not None:
            services.worker.wake()
    agents = None
    if body.env == EXTERNAL_ENV:
        tokens = await agent_tokens(services.database, submission.episode_ids)
        base = str(request.base_url).rstrip("/")
        agents = [
            AgentEndpoint(episode_id=episode_id, base_url=f"{base}/v1/episodes/{episode_id}", api_key=token)
            for episode_id in submission.episode_ids
            if (token := tokens.get(episode_id)) is not None
        ]
    return SubmitAccepted(
        batch_id=batch.batch_id, episode_ids=submission.episode_ids, created=submission.created, agents=agents
    )


def in_scope(query: Select[Any], episode_id: str, access: Access) -> Select[Any]:
    """`query` of the episode, if the caller's scope holds its batch: one read, whether it is
    another project's or none at all (a 404 alike, in the same time)."""
    query = query.where(Episode.id == episode_id)
    return query.where(starts_with(Episode.batch_id, access.batch_prefix)) if access.batch_prefix else query


@router.get(
    "/episodes/{episode_id}",
    operation_id="get_episode",
    response_model=EpisodeDetail,
    responses=responses(NotFound, DatabaseUnavailable) | {200: {"links": EPISODE_LINKS}},
)
async def get_episode(
    services: ServicesDep,
    access: AccessDep,
    episode_id: EpisodeId,
    wait: Annotated[
        float,
        Query(
            ge=0,
            allow_inf_nan=False,
            description="Long-poll: seconds to wait for the episode to finish" + LONG_POLL_CUT,
        ),
    ] = 0,
) -> EpisodeDetail:
    """One episode with its token arrays as JSON lists, its transcript, env info and turns."""

    async def finished() -> bool:  # an unknown episode is "finished": no wait, then 404
        async with services.database.reader() as session:
            status = await session.scalar(in_scope(select(Episode.status), episode_id, access))
        return status is None or status in FINISHED_STATUSES

    if wait > 0:
        await long_poll(services, wait, finished)
    async with services.database.reader() as session:
        episode = await session.scalar(in_scope(select(Episode), episode_id, access))
        earlier: list[EpisodeSegment] = []
        if episode is not None and episode.segments > 1:
            earlier = list(
                await session.scalars(
                    select(EpisodeSegment)
                    .where(EpisodeSegment.episode_id == episode_id)
                    .order_by(EpisodeSegment.segment)
                )
            )
    if episode is None:
        raise NotFound(f"no episode {episode_id!r}")
    return episode_detail(episode, earlier)


@router.get(
    "/episodes/{episode_id}/tokens",
    operation_id="get_episode_tokens",
    response_model=EpisodeTokenView,
    responses=responses(NotFound, DatabaseUnavailable),
)
async def get_episode_tokens(
    services: ServicesDep, access: AccessDep, episode_id: EpisodeId
) -> EpisodeTokenView:
    """The response's tokens as text (the service's tokenizer, one token at a time) beside their
    ids, loss mask and logprobs, and where each generate call's tokens lie: what the viewer's token
    view draws. 404 for an unknown episode or one that stored no tokens (yet)."""
    async with services.database.reader() as session:
        episode = await session.scalar(in_scope(select(Episode), episode_id, access))
    view = None if episode is None else await episode_token_view(episode, services.token_texts)
    if view is None:
        raise NotFound(
            f"no episode {episode_id!r}" if episode is None else f"episode {episode_id!r} has no tokens"
        )
    return view
