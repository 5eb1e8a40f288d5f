"""Agent-driven envs' episodes (EnvSpec.driver, e.g. verifiers'): a worker that claimed one hands it
over to its driver, which plays it as an external agent plays its episode (service/agents): with a
token of its own, through the episode's own OpenAI endpoint. The service ends it as that
endpoint's `/finish` does (service/loop/driven.py).

Unlike an external agent's episode, it stays leased to its worker, which heartbeats it while the
driver plays: if that worker dies (a crash, a kill, a restart), the lease sweep re-queues it as a
new attempt (service/storage/queue.py), which clears the dead attempt's token, calls and segments.
The token names its attempt (`<attempt>.<secret>`): an agent's calls and finish are fenced on the
episode's current token, and one that sends its last dead attempt's token (kept as
`dead_agent_token`) is told so (`earlier_attempt`) instead of being refused as a stranger; any
other key shaped as a token learns nothing of the attempts.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from sqlalchemy import Table, Update, bindparam, update

from service.records import EpisodeStatus
from service.storage.db import Database
from service.storage.models import Episode


def attempt_token(attempt: int) -> str:
    """A new token for attempt `attempt` of an episode: the attempt, a dot, a secret (URL-safe
    base64 has no dot)."""
    return f"{attempt}.{secrets.token_urlsafe(32)}"


def attempt_of(token: bytes) -> int | None:
    """The attempt an agent-driven episode's token was given for; None for any other token."""
    tag, dot, secret = token.partition(b".")
    if not dot or not secret or not tag.isdigit() or len(tag) > 9:
        return None
    return int(tag)


def earlier_attempt(key: bytes, token: bytes) -> int | None:
    """The attempt `key` was the token of, when `token` is an agent-driven episode's token of a
    later attempt (the episode was re-queued since); None for any other key, or episode."""
    given, current = attempt_of(key), attempt_of(token)
    if given is None or current is None or given >= current:
        return None
    return given


@dataclass(frozen=True)
class HandedOver:
    """An attempt handed over to its driver: its token, and its place in its batch."""

    token: str
    batch_id: str
    group_index: int


def _hand_over_statement() -> Update:
    """The hand-over's write, built once, on the table: the ORM entity's update ran the ORM's
    bulk-update path per episode."""
    table: Table = Episode.__table__  # type: ignore[assignment]  # a declarative model's Table
    return (
        update(table)
        .where(
            table.c.id == bindparam("episode"),
            table.c.attempt == bindparam("current_attempt"),
            table.c.status == EpisodeStatus.RUNNING.value,
            table.c.agent_token.is_(None),
        )
        .values({table.c.agent_token: bindparam("token", type_=table.c.agent_token.type)})
        .returning(table.c.batch_id, table.c.group_index)
    )


_HAND_OVER = _hand_over_statement()


async def hand_to_agent(database: Database, episode_id: str, attempt: int) -> HandedOver | None:
    """Gives the running attempt `attempt` of the episode a token for its driver (the worker keeps
    its lease); None if the attempt no longer runs (cancelled, or its lease was lost meanwhile)."""
    token = attempt_token(attempt)
    rows = await database.writer.execute(
        _HAND_OVER, {"episode": episode_id, "current_attempt": attempt, "token": token}
    )
    return HandedOver(token, rows[0].batch_id, rows[0].group_index) if rows else None
