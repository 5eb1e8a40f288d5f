"""Batches as the API sees them: store a request with its queued episodes, and read them back."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, exists, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from service.records import EpisodeRequest, EpisodeStatus
from service.storage import agents, groups
from service.storage.db import Database, utcnow
from service.storage.models import Batch, Episode


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
    # External agents' episodes (env `external`): they start running, waiting for their agent's
    # first call, each with its own token; idle this long, they fail (see storage/agents.py).
    agent_idle_seconds: float | None = None


@dataclass(frozen=True)
class Submission:
    episode_ids: list[str]  # by group, then sample
    created: bool  # False: the same request was stored before under this batch id


class BatchConflict(Exception):
    """The batch id is taken by a different request."""


@dataclass(frozen=True)
class Cancellation:
    """What cancelling a batch changed: its episodes that were queued or running are cancelled."""

    queued: int  # cancelled before they started
    running: list[tuple[str, int]]  # (episode id, attempt) of those cancelled while running
    counts: dict[str, int]  # the batch's episodes per status, after


CANCELLED_ERROR = "cancelled: its batch was cancelled"


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
                    **(
                        {}
                        if new.agent_idle_seconds is None
                        else agents.waiting_for_agent(now, new.agent_idle_seconds)
                    ),
                }
                for episode in new.episodes
            ],
        )
    tasks: dict[int, tuple[int, int]] = {}  # group index -> (task index, size)
    for episode in new.episodes:
        task, size = tasks.get(episode.group_index, (episode.request.task_index, 0))
        tasks[episode.group_index] = (task, size + 1)
    await groups.insert_groups(
        session,
        groups.group_rows(new.batch_id, new.env, [(group, *tasks[group]) for group in sorted(tasks)], now),
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


async def cancel_batch(
    database: Database, batch_id: str, *, now: datetime | None = None
) -> Cancellation | None:
    """Marks the batch cancelled and ends every queued or running episode of it `cancelled`, in one
    statement (None: no such batch). A running episode's result write is fenced by status, so its
    worker's late result changes nothing; the caller and the workers stop the work (see
    api/batches.py, EpisodeWorker._cancelled_loop). One UPDATE, not one per
    status: under PostgreSQL's READ COMMITTED an episode claimed meanwhile is re-checked and still
    matches, where a second statement for running episodes would have run before the claim."""
    unfinished = (EpisodeStatus.QUEUED.value, EpisodeStatus.RUNNING.value)
    now = now or utcnow()
    async with database.writer.begin() as session:
        batch = await session.get(Batch, batch_id)
        if batch is None:
            return None
        if batch.cancelled_at is None:  # the first cancellation's time
            batch.cancelled_at = now
        rows = await session.execute(
            update(Episode)
            .where(Episode.batch_id == batch_id, Episode.status.in_(unfinished))
            .values(
                status=EpisodeStatus.CANCELLED.value,
                error=CANCELLED_ERROR,
                lease_expires_at=None,
                finished_at=now,
            )
            .returning(Episode.id, Episode.attempt, Episode.started_at)
            .execution_options(synchronize_session=False)
        )
        cancelled = rows.all()
        counts = await batch_status_counts(session, batch_id)
    running = [(row.id, row.attempt) for row in cancelled if row.started_at is not None]
    return Cancellation(queued=len(cancelled) - len(running), running=running, counts=counts)


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


_ANY_UNFINISHED = select(
    exists().where(
        Episode.batch_id == bindparam("batch"),
        or_(Episode.status == EpisodeStatus.QUEUED.value, Episode.status == EpisodeStatus.RUNNING.value),
    )
)


async def batch_finished(database: Database, batch_id: str) -> bool:
    """Whether no episode of the batch is queued or running (True for an unknown batch). A long-poll
    asks this after every result its process stores (at most every RECHECK_SECONDS): a statement
    built once, on a Core connection, that stops at the first unfinished episode, where it counted
    the batch's episodes by status in an ORM session."""
    async with database.single_reads.connect() as connection:
        return not (await connection.execute(_ANY_UNFINISHED, {"batch": batch_id})).scalar()
