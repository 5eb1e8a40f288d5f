"""Agent-driven envs' episodes (EnvSpec.driver, e.g. verifiers'): a worker that claimed one hands it
over to its driver as an external agent's episode (service/storage/agents.py): a token of its own,
the owner EXTERNAL_OWNER, and its idle deadline as its lease. The driver then plays it through the
episode's own OpenAI endpoint; the service ends it as that endpoint's `/finish` does
(service/loop/driven.py)."""

from __future__ import annotations

import secrets
from datetime import timedelta

from sqlalchemy import update

from service.records import EpisodeStatus
from service.storage.agents import EXTERNAL_OWNER
from service.storage.db import Database, utcnow
from service.storage.models import Episode


async def hand_to_agent(database: Database, episode_id: str, attempt: int, idle_seconds: float) -> str | None:
    """Hands the running attempt `attempt` of the episode over to an agent; its token, or None if
    the attempt no longer runs (cancelled, or its lease was lost meanwhile)."""
    token = secrets.token_urlsafe(32)
    now = utcnow()
    async with database.writer.begin() as session:
        rows = await session.execute(
            update(Episode)
            .where(
                Episode.id == episode_id,
                Episode.attempt == attempt,
                Episode.status == EpisodeStatus.RUNNING.value,
                Episode.agent_token.is_(None),
            )
            .values(
                lease_owner=EXTERNAL_OWNER,
                lease_expires_at=now + timedelta(seconds=idle_seconds),
                agent_token=token,
            )
            .returning(Episode.id)
            .execution_options(synchronize_session=False)
        )
        return token if rows.first() is not None else None
