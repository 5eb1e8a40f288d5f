"""Batches as the API sees them: store a request with its queued episodes, and read them back."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import defer

from service.records import FINISHED_STATUSES, EpisodeRequest, EpisodeStatus
from service.storage.db import Database, utcnow
from service.storage.models import TOKEN_COLUMNS, Batch, Episode


@dataclass(frozen=True)
class NewEpisode:
    """One episode to enqueue: sample `sample_index` of task `group_index` of a request."""

    group_index: int
    sample_index: int
    request: EpisodeRequest


@dataclass(frozen=True)
class NewBatch:
    """A submitted request: its episodes and what is stored of the request itself."""

    batch_id: str
    # Hash of the normalized request: a resubmission with the same id and hash gets the same
    # answer, with the same id and another hash a BatchConflict.
    request_hash: str
    env: str
    task_split: str
    metadata: dict[str, Any]
    episodes: Sequence[NewEpisode]


@dataclass(frozen=True)
class Submission:
    episode_ids: list[str]  # by group, then sample
    created: bool  # False: the same request was stored before under this batch id


class BatchConflict(Exception):
    """The batch id is taken by a different request."""


def new_episode_id() -> str:
    return uuid.uuid4().hex


async def enqueue_batch(session: AsyncSession, new: NewBatch, *, now: datetime | None = None) -> Batch:
    """Insert a batch and its episodes, queued, in the caller's transaction (flushed, not committed).

    A concurrent insert of the same batch id makes the flush (or the commit) raise
    sqlalchemy.exc.IntegrityError.
    """
    now = now or utcnow()
    batch = Batch(
        id=new.batch_id,
        request_hash=new.request_hash,
        env=new.env,
        task_split=new.task_split,
        metadata_=new.metadata,
        created_at=now,
    )
    session.add(batch)
    await session.flush()
    if new.episodes:
        await session.execute(
            insert(Episode),
            [
                {
                    **asdict(episode.request),
                    "id": new_episode_id(),
                    "batch_id": new.batch_id,
                    "group_index": episode.group_index,
                    "sample_index": episode.sample_index,
                    "status": EpisodeStatus.QUEUED.value,
                    "attempt": 0,
                    "failures": 0,
                    "created_at": now,
                }
                for episode in new.episodes
            ],
        )
    return batch


async def submit_batch(database: Database, new: NewBatch) -> Submission:
    """Store the batch and queue its episodes, in one transaction, unless the batch id exists.

    Idempotent: a resubmission of the same request (even a concurrent one) answers the stored
    episodes with created=False; a different request under a taken id raises BatchConflict.
    """
    insert_error: IntegrityError | None = None
    try:
        async with database.writer.begin() as session:
            created = await session.get(Batch, new.batch_id) is None
            if created:
                await enqueue_batch(session, new)
    except IntegrityError as error:  # a concurrent submission of the same batch id may have won
        insert_error, created = error, False
    async with database.reader() as session:
        if not created:
            stored = await session.get(Batch, new.batch_id)
            if stored is None:
                assert insert_error is not None
                raise insert_error  # not a duplicate batch id: a real integrity failure
            if stored.request_hash != new.request_hash:
                raise BatchConflict(
                    f"batch {new.batch_id!r} exists with a different request; use another batch_id"
                )
        episode_ids = await session.scalars(
            select(Episode.id)
            .where(Episode.batch_id == new.batch_id)
            .order_by(Episode.group_index, Episode.sample_index)
        )
        return Submission(list(episode_ids), created)


async def get_batch(session: AsyncSession, batch_id: str) -> Batch | None:
    return await session.get(Batch, batch_id)


def _zero_counts() -> dict[str, int]:
    return {status.value: 0 for status in EpisodeStatus}


async def batch_status_counts(session: AsyncSession, batch_id: str) -> dict[str, int]:
    """Episodes of the batch per status; every status is a key, absent ones count 0."""
    rows = await session.execute(
        select(Episode.status, func.count()).where(Episode.batch_id == batch_id).group_by(Episode.status)
    )
    return _zero_counts() | {status: count for status, count in rows}


async def status_counts(session: AsyncSession) -> dict[str, int]:
    """Episodes of all batches per status (for metrics); every status is a key."""
    rows = await session.execute(select(Episode.status, func.count()).group_by(Episode.status))
    return _zero_counts() | {status: count for status, count in rows}


async def queue_depth(session: AsyncSession) -> int:
    """How many episodes wait to be claimed."""
    count = await session.scalar(
        select(func.count()).select_from(Episode).where(Episode.status == EpisodeStatus.QUEUED.value)
    )
    return int(count or 0)


async def batch_unfinished(database: Database, batch_id: str) -> int:
    """How many episodes of the batch are queued or running (0 for an unknown batch)."""
    async with database.reader() as session:
        counts = await batch_status_counts(session, batch_id)
    return sum(count for status, count in counts.items() if status not in FINISHED_STATUSES)


async def load_batch_episodes(
    session: AsyncSession, batch_id: str, *, with_tokens: bool = True
) -> list[Episode]:
    """The batch's episodes ordered by (group_index, sample_index).

    with_tokens=False leaves out the token blobs; touching one of them then raises instead of
    loading it.
    """
    statement = (
        select(Episode)
        .where(Episode.batch_id == batch_id)
        .order_by(Episode.group_index, Episode.sample_index)
    )
    if not with_tokens:
        statement = statement.options(*(defer(column, raiseload=True) for column in TOKEN_COLUMNS))
    return list(await session.scalars(statement))
