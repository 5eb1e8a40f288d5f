"""GET /batches/{id}: what the trainer pulls, as JSON or as an Arrow IPC stream, with long-poll."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Path, Query, Response
from sqlalchemy import Row, func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import defer

from service.api.arrow import ARROW_STREAM_MEDIA_TYPE, episodes_to_arrow
from service.api.deps import ServicesDep
from service.api.episodes import summarize, token_fields
from service.api.errors import NotFound, responses
from service.api.schemas import BatchOut, EpisodeSummary, EpisodeWithTokens
from service.app_state import Services
from service.loop.records import FINISHED_STATUSES
from service.storage import blobs
from service.storage.batches import TOKEN_COLUMNS, batch_status_counts, get_batch, load_batch_episodes
from service.storage.models import Batch, Episode

router = APIRouter(tags=["batches"])

WAIT_POLL_SECONDS = 1.0  # how often a long-poll re-reads the database (other processes' results)


async def _wait_until_complete(services: Services, batch_id: str, wait: float) -> None:
    deadline = time.monotonic() + min(wait, services.settings.max_long_poll_seconds)
    while True:
        async with services.database.reader() as session:
            counts = await batch_status_counts(session, batch_id)
        if counts["queued"] + counts["running"] == 0:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0 or services.shutting_down.is_set():
            return
        await services.results.wait(min(remaining, WAIT_POLL_SECONDS))


def complete_groups(statuses: list[tuple[int, str]]) -> set[int]:
    """Groups all of whose episodes have a final status."""
    unfinished: dict[int, bool] = defaultdict(bool)
    for group, status in statuses:
        unfinished[group] |= status not in FINISHED_STATUSES
    return {group for group, pending in unfinished.items() if not pending}


async def _summary_rows(session: AsyncSession, batch_id: str, include_tokens: bool) -> Sequence[Row[Any]]:
    statement = (
        select(
            Episode,
            func.length(Episode.prompt_ids).label("prompt_bytes"),
            func.length(Episode.response_ids).label("response_bytes"),
        )
        .where(Episode.batch_id == batch_id)
        .order_by(Episode.group_index, Episode.sample_index)
        .options(defer(Episode.messages, raiseload=True), defer(Episode.info, raiseload=True))
    )
    if not include_tokens:
        statement = statement.options(*(defer(column, raiseload=True) for column in TOKEN_COLUMNS))
    return (await session.execute(statement)).all()


def _summaries(
    rows: Sequence[Row[Any]], include_tokens: bool
) -> tuple[list[EpisodeWithTokens] | list[EpisodeSummary], int, int]:
    groups = complete_groups([(row.Episode.group_index, row.Episode.status) for row in rows])
    total_groups = len({row.Episode.group_index for row in rows})
    kept = [row for row in rows if row.Episode.group_index in groups]
    summaries = [
        summarize(
            row.Episode,
            prompt_length=None if row.prompt_bytes is None else row.prompt_bytes // blobs.ID_BYTES,
            response_length=None if row.response_bytes is None else row.response_bytes // blobs.ID_BYTES,
        )
        for row in kept
    ]
    if not include_tokens:
        return [EpisodeSummary(**summary) for summary in summaries], len(groups), total_groups
    with_tokens = [
        EpisodeWithTokens(**summary, **token_fields(row.Episode))
        for summary, row in zip(summaries, kept, strict=True)
    ]
    return with_tokens, len(groups), total_groups


def _batch_out(
    batch: Batch,
    counts: dict[str, int],
    summaries: list[EpisodeWithTokens] | list[EpisodeSummary],
    groups: tuple[int, int],
) -> BatchOut:
    total = sum(counts.values())
    finished = sum(counts[status] for status in FINISHED_STATUSES)
    return BatchOut(
        batch_id=batch.id,
        env=batch.env,
        task_split=batch.task_split,
        metadata=batch.metadata_,
        created_at=batch.created_at,
        counts=counts,
        total=total,
        finished=finished,
        complete=finished == total,
        groups_complete=groups[0],
        groups_total=groups[1],
        episodes=summaries,
    )


async def valid_batch(services: ServicesDep, batch_id: Annotated[str, Path(max_length=128)]) -> Batch:
    async with services.database.reader() as session:
        batch = await get_batch(session, batch_id)
    if batch is None:
        raise NotFound(f"no batch {batch_id!r}")
    return batch


@router.get(
    "/batches/{batch_id}",
    operation_id="get_batch",
    response_model=BatchOut,
    responses={
        **responses(NotFound),
        200: {
            "description": "The batch as JSON, or with `Accept: application/vnd.apache.arrow.stream` an "
            "Arrow IPC stream with one row per episode of the complete groups, token arrays included.",
            "content": {ARROW_STREAM_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        },
    },
)
async def get_batch_results(
    services: ServicesDep,
    batch: Annotated[Batch, Depends(valid_batch)],
    wait: Annotated[
        float, Query(ge=0, description="Long-poll: seconds to wait for the batch to complete.")
    ] = 0,
    include_tokens: Annotated[bool, Query(description="JSON: add each episode's token arrays.")] = False,
    accept: Annotated[str, Header()] = "application/json",
) -> Any:
    """Counts by status and the episodes of complete groups (a GRPO group arrives whole)."""
    if wait > 0:
        await _wait_until_complete(services, batch.id, wait)
    arrow = ARROW_STREAM_MEDIA_TYPE in accept
    async with services.database.reader() as session:
        counts = await batch_status_counts(session, batch.id)
        if arrow:
            episodes = await load_batch_episodes(session, batch.id, with_tokens=True)
        else:
            rows = await _summary_rows(session, batch.id, include_tokens)
    # Serializing a large batch takes seconds of CPU: on a thread, after the session closed, so
    # the episodes running on the event loop (and their lease heartbeats) go on meanwhile.
    if arrow:
        return Response(await asyncio.to_thread(_arrow_body, episodes), media_type=ARROW_STREAM_MEDIA_TYPE)

    def json_body() -> bytes:
        summaries, groups_complete, groups_total = _summaries(rows, include_tokens)
        return (
            _batch_out(batch, counts, summaries, (groups_complete, groups_total)).model_dump_json().encode()
        )

    return Response(await asyncio.to_thread(json_body), media_type="application/json")


def _arrow_body(episodes: Sequence[Episode]) -> bytes:
    groups = complete_groups([(episode.group_index, episode.status) for episode in episodes])
    return episodes_to_arrow([episode for episode in episodes if episode.group_index in groups])
