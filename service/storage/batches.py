"""Batches as seen by the API: store a request with its queued episodes, and read them back.

These functions take the caller's AsyncSession and only flush: the API owns the transaction, so
a request and its episodes are enqueued atomically.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import defer

from service.storage.db import utcnow
from service.storage.models import Batch, Episode, EpisodeStatus

TOKEN_COLUMNS = (Episode.prompt_ids, Episode.response_ids, Episode.loss_mask, Episode.rollout_logprobs)


@dataclass(frozen=True)
class NewEpisode:
    """One episode to enqueue: sample `sample_index` of task `group_index` of a request."""

    group_index: int
    sample_index: int
    env: str
    task_split: str
    task_index: int
    sampling_params: dict[str, Any]
    max_turns: int
    max_response_tokens: int | None = None


def new_episode_id() -> str:
    return uuid.uuid4().hex


async def enqueue_batch(
    session: AsyncSession,
    *,
    batch_id: str,
    request_hash: str,
    env: str,
    task_split: str,
    metadata: dict[str, Any],
    episodes: Sequence[NewEpisode],
    now: datetime | None = None,
) -> Batch:
    """Insert a batch and its episodes, queued, in the caller's transaction (flushed, not committed).

    A concurrent insert of the same batch id makes the flush (or the commit) raise
    sqlalchemy.exc.IntegrityError: roll back, then get_batch and compare request hashes.
    """
    now = now or utcnow()
    batch = Batch(
        id=batch_id,
        request_hash=request_hash,
        env=env,
        task_split=task_split,
        metadata_=metadata,
        created_at=now,
    )
    session.add(batch)
    await session.flush()
    if episodes:
        await session.execute(
            insert(Episode),
            [
                {
                    "id": new_episode_id(),
                    "batch_id": batch_id,
                    "group_index": episode.group_index,
                    "sample_index": episode.sample_index,
                    "env": episode.env,
                    "task_split": episode.task_split,
                    "task_index": episode.task_index,
                    "sampling_params": episode.sampling_params,
                    "max_turns": episode.max_turns,
                    "max_response_tokens": episode.max_response_tokens,
                    "status": EpisodeStatus.QUEUED.value,
                    "attempt": 0,
                    "failures": 0,
                    "created_at": now,
                }
                for episode in episodes
            ],
        )
    return batch


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
