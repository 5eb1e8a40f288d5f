"""External agents' episodes (env `external`) as the queue sees them.

Such an episode starts `running` under the owner EXTERNAL_OWNER, waiting for its agent: no worker
claims it, and the lease sweep never re-queues it. Its lease is its idle deadline: every call of
its agent pushes it on (service/agents/repository.py stores the calls); an episode past it fails
(`expire_idle_agents`).
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import update

from service.records import EpisodeStatus
from service.storage.db import Database, utcnow
from service.storage.models import Episode

EXTERNAL_OWNER = "external-agent"
IDLE_ERROR = "timed out: its agent made no call for EXTERNAL_IDLE_SECONDS"
_RUNNING = EpisodeStatus.RUNNING.value


def waiting_for_agent(now: datetime, idle_seconds: float) -> dict[str, Any]:
    """The columns of a new external episode: running, waiting for its agent, with its token."""
    return {
        "status": _RUNNING,
        "lease_owner": EXTERNAL_OWNER,
        "lease_expires_at": now + timedelta(seconds=idle_seconds),
        "started_at": now,
        "agent_token": secrets.token_urlsafe(32),
    }


async def expire_idle_agents(database: Database, *, now: datetime | None = None) -> list[tuple[str, int]]:
    """Fails the external episodes whose agent has been idle past their deadline; returns their
    (batch id, group index)."""
    now = now or utcnow()
    async with database.writer.begin() as session:
        rows = await session.execute(
            update(Episode)
            .where(
                Episode.status == _RUNNING,
                Episode.lease_owner == EXTERNAL_OWNER,
                Episode.lease_expires_at < now,
            )
            .values(
                status=EpisodeStatus.FAILED.value,
                error=IDLE_ERROR,
                lease_owner=None,
                lease_expires_at=None,
                finished_at=now,
            )
            .returning(Episode.batch_id, Episode.group_index)
            .execution_options(synchronize_session=False)
        )
        return [(batch_id, group_index) for batch_id, group_index in rows]
