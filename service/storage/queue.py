"""The episode queue as seen by workers: claim, renew, finish, release, and the lease sweep.

Each function opens its own short transaction from the session maker, since jobs carry ids, not
ORM objects. Ownership of a running episode is (lease_owner, attempt): a write that does not match
both changes nothing, which is what makes a result stored exactly once although an episode whose
worker lost its lease may run again elsewhere.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, String, cast, literal, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from service.loop.records import EpisodeSpec
from service.storage import blobs
from service.storage.db import utcnow
from service.storage.models import FINISHED_STATUSES, Episode, EpisodeStatus

# Ids per `IN (...)` list: far below the bound-parameter limits of SQLite (32766) and asyncpg (32767).
IN_LIST_CHUNK = 1000

SessionMaker = async_sessionmaker[AsyncSession]
_QUEUED = EpisodeStatus.QUEUED.value
_RUNNING = EpisodeStatus.RUNNING.value
# A re-queued episode runs again as a new attempt: attempt + 1 fences out the old lease holder.
_REQUEUED: dict[str, Any] = {
    "status": _QUEUED,
    "attempt": Episode.attempt + 1,
    "lease_owner": None,
    "lease_expires_at": None,
    "started_at": None,
}


@dataclass(frozen=True)
class ClaimedEpisode:
    """What a worker needs to run an episode; `attempt` must be passed back to finish_episode."""

    id: str
    attempt: int
    failures: int
    env: str
    task_split: str
    task_index: int
    sampling_params: dict[str, Any]
    max_turns: int
    max_response_tokens: int | None
    batch_id: str
    group_index: int
    sample_index: int

    def spec(self) -> EpisodeSpec:
        return EpisodeSpec(
            episode_id=self.id,
            attempt=self.attempt,
            env=self.env,
            task_split=self.task_split,
            task_index=self.task_index,
            sampling_params=self.sampling_params,
            max_turns=self.max_turns,
            max_response_tokens=self.max_response_tokens,
        )


@dataclass(frozen=True)
class EpisodeOutcome:
    """The result of one episode, written by finish_episode in one transaction.

    Token arrays follow the trainer contract: len(response_ids) == len(loss_mask) ==
    len(rollout_logprobs). Logprobs are stored as float64, exactly.
    """

    status: str
    reward: float | None = None
    prompt_ids: Sequence[int] | None = None
    response_ids: Sequence[int] | None = None
    loss_mask: Sequence[int] | None = None
    rollout_logprobs: Sequence[float] | None = None
    messages: list[Any] | None = None
    info: dict[str, Any] | None = None
    turns: list[Any] | None = None
    error: str | None = None
    num_turns: int | None = None

    def __post_init__(self) -> None:
        if self.status not in FINISHED_STATUSES:
            raise ValueError(f"an outcome needs a finished status, not {self.status!r}")
        response = (self.response_ids, self.loss_mask, self.rollout_logprobs)
        if any(array is not None for array in response):
            if any(array is None for array in response):
                raise ValueError("response_ids, loss_mask and rollout_logprobs go together")
            lengths = {len(array) for array in response if array is not None}
            if len(lengths) != 1:
                raise ValueError(
                    f"response_ids, loss_mask and rollout_logprobs differ in length: {sorted(lengths)}"
                )

    def column_values(self) -> dict[str, Any]:
        return {
            "status": EpisodeStatus(self.status).value,
            "reward": self.reward,
            "prompt_ids": None if self.prompt_ids is None else blobs.encode_ids(self.prompt_ids),
            "response_ids": None if self.response_ids is None else blobs.encode_ids(self.response_ids),
            "loss_mask": None if self.loss_mask is None else blobs.encode_mask(self.loss_mask),
            "rollout_logprobs": (
                None if self.rollout_logprobs is None else blobs.encode_logprobs(self.rollout_logprobs)
            ),
            "messages": self.messages,
            "info": self.info,
            "turns": self.turns,
            "error": self.error,
            "num_turns": self.num_turns,
        }


def _chunks(ids: Sequence[str]) -> Iterator[Sequence[str]]:
    for start in range(0, len(ids), IN_LIST_CHUNK):
        yield ids[start : start + IN_LIST_CHUNK]


_CLAIMED_COLUMNS = (
    Episode.id,
    Episode.attempt,
    Episode.failures,
    Episode.env,
    Episode.task_split,
    Episode.task_index,
    Episode.sampling_params,
    Episode.max_turns,
    Episode.max_response_tokens,
    Episode.batch_id,
    Episode.group_index,
    Episode.sample_index,
)


async def claim_episodes(
    sm: SessionMaker, worker_id: str, limit: int, lease_seconds: float, *, now: datetime | None = None
) -> list[ClaimedEpisode]:
    """Lease up to `limit` queued episodes to `worker_id`, oldest first, groups in order.

    PostgreSQL: the row locks of FOR UPDATE SKIP LOCKED make concurrent claimers pick disjoint
    rows. SQLite ignores FOR UPDATE, but its transactions begin IMMEDIATE (see make_engine), so
    claimers are serialized. Select and update are two statements on purpose: PostgreSQL may
    re-run an `IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)` subquery and update more than n rows.
    """
    if limit <= 0:
        return []
    now = now or utcnow()
    async with sm.begin() as session:
        ids = list(
            await session.scalars(
                select(Episode.id)
                .where(Episode.status == _QUEUED)
                .order_by(Episode.created_at, Episode.batch_id, Episode.group_index, Episode.sample_index)
                .limit(limit)
                .with_for_update(skip_locked=True)
            )
        )
        if not ids:
            return []
        rows = await session.execute(
            update(Episode)
            .where(Episode.id.in_(ids), Episode.status == _QUEUED)
            .values(
                status=_RUNNING,
                lease_owner=worker_id,
                lease_expires_at=now + timedelta(seconds=lease_seconds),
                started_at=now,
            )
            .returning(*_CLAIMED_COLUMNS)
            .execution_options(synchronize_session=False)
        )
        claimed = {row.id: ClaimedEpisode(**row._asdict()) for row in rows}
    return [claimed[episode_id] for episode_id in ids if episode_id in claimed]


async def renew_leases(
    sm: SessionMaker,
    worker_id: str,
    episode_ids: Collection[str],
    lease_seconds: float,
    *,
    now: datetime | None = None,
) -> set[str]:
    """Extend the leases of the given episodes still running under `worker_id`; returns those ids.

    The caller should abandon every other id: it was re-queued (or finished) behind its back.
    """
    now = now or utcnow()
    renewed: set[str] = set()
    async with sm.begin() as session:
        for chunk in _chunks(sorted(episode_ids)):
            result = await session.scalars(
                update(Episode)
                .where(Episode.id.in_(chunk), Episode.lease_owner == worker_id, Episode.status == _RUNNING)
                .values(lease_expires_at=now + timedelta(seconds=lease_seconds))
                .returning(Episode.id)
                .execution_options(synchronize_session=False)
            )
            renewed.update(result)
    return renewed


async def requeue_expired(
    sm: SessionMaker, max_attempts: int, *, spare_owner: str | None = None, now: datetime | None = None
) -> int:
    """Re-queue running episodes whose lease expired (their worker crashed or was killed), with
    attempt + 1 and failures + 1; an episode at `max_attempts` failures fails instead. Returns how
    many episodes were re-queued or failed.

    `spare_owner`: a live worker's own episodes are left alone; its heartbeat may merely be late
    under load, and re-queuing them would throw their work away.
    """
    now = now or utcnow()
    expired: tuple[ColumnElement[bool], ...] = (Episode.status == _RUNNING, Episode.lease_expires_at < now)
    if spare_owner is not None:
        expired = (*expired, Episode.lease_owner != spare_owner)
    used_up = Episode.failures + 1 >= max_attempts
    async with sm.begin() as session:
        failed = await session.scalars(
            update(Episode)
            .where(*expired, used_up)
            .values(
                status=EpisodeStatus.FAILED.value,
                error=literal(f"lease expired {max_attempts} times (a worker crashed or was killed); ")
                + literal("last attempt ")
                + cast(Episode.attempt, String),
                failures=Episode.failures + 1,
                lease_expires_at=None,
                finished_at=now,
            )
            .returning(Episode.id)
            .execution_options(synchronize_session=False)
        )
        requeued = await session.scalars(
            update(Episode)
            .where(*expired, ~used_up)
            .values(**_REQUEUED, failures=Episode.failures + 1)
            .returning(Episode.id)
            .execution_options(synchronize_session=False)
        )
        return len(failed.all()) + len(requeued.all())


async def finish_episode(
    sm: SessionMaker,
    worker_id: str,
    episode_id: str,
    attempt: int,
    outcome: EpisodeOutcome,
    *,
    now: datetime | None = None,
) -> bool:
    """Store the outcome if the episode is still running under (`worker_id`, `attempt`).

    Returns False, writing nothing, when the lease was lost (re-queued, failed or released).
    """
    now = now or utcnow()
    async with sm.begin() as session:
        result = await session.scalars(
            update(Episode)
            .where(
                Episode.id == episode_id,
                Episode.status == _RUNNING,
                Episode.lease_owner == worker_id,
                Episode.attempt == attempt,
            )
            .values(**outcome.column_values(), lease_expires_at=None, finished_at=now)
            .returning(Episode.id)
            .execution_options(synchronize_session=False)
        )
        return result.first() is not None


async def release_episodes(
    sm: SessionMaker,
    worker_id: str,
    episode_ids: Collection[str] | None = None,
    *,
    failed: bool = False,
    attempt: int | None = None,
) -> int:
    """Put episodes still running under `worker_id` back in the queue (attempt + 1), e.g. on a
    graceful shutdown; None releases all of them. `failed`: the attempt failed (an unreachable
    engine) and counts towards max_attempts. Returns how many were released."""
    values = {**_REQUEUED, "failures": Episode.failures + 1} if failed else _REQUEUED
    released = 0
    owned: tuple[ColumnElement[bool], ...] = (Episode.lease_owner == worker_id, Episode.status == _RUNNING)
    if attempt is not None:  # only that attempt: a newer one of the same episode is not ours to release
        owned = (*owned, Episode.attempt == attempt)
    chunks: list[Sequence[str] | None] = [None] if episode_ids is None else list(_chunks(sorted(episode_ids)))
    async with sm.begin() as session:
        for chunk in chunks:
            statement = update(Episode).where(*owned)
            if chunk is not None:
                statement = statement.where(Episode.id.in_(chunk))
            result = await session.scalars(
                statement.values(**values).returning(Episode.id).execution_options(synchronize_session=False)
            )
            released += len(result.all())
    return released
