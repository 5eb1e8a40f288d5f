"""External agents' episodes in the database: what a call reads and writes, and the finish.

An episode's last segment lives in its row, its closed segments in episode_segments. Calls are
fenced by `num_turns`: two calls that read the same state cannot both store theirs; and by the
agent's token: an agent-driven episode re-queued as a new attempt has a new one, so its dead
attempt's driver can neither call nor finish it. How such an episode waits in the queue (its owner,
its idle deadline) is storage's (service/storage/agents.py, service/storage/driven.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from sqlalchemy import Select, Table, Update, bindparam, case, func, select, update

from service.loop.tokens import EncodedIds
from service.records import Ending, EpisodeStatus, EpisodeTokens
from service.storage import blobs
from service.storage.agents import EXTERNAL_OWNER
from service.storage.blobs import TOKEN_BLOBS
from service.storage.db import Database, utcnow
from service.storage.models import Episode, EpisodeSegment

SEGMENT_COLUMNS = (*TOKEN_BLOBS, "turns", "messages")  # what a segment has of its own
_RUNNING = EpisodeStatus.RUNNING.value


@dataclass
class Segment:
    """A segment's token arrays (the trainer contract's P, R, M, L), its calls and its messages:
    the conversation as the agent sent it, with each assistant message as the service answered."""

    tokens: EpisodeTokens
    turns: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    # The token blobs as stored last, of the first ids of `tokens` (the segment grew since): a
    # store encodes only the ids added since. None: encode them all.
    blobs: dict[str, bytes] | None = None
    # The engine's input (P + R) as JSON text, as the last call of the segment encoded it.
    input_json: EncodedIds | None = None


@dataclass
class AgentEpisode:
    episode_id: str
    batch_id: str
    group_index: int
    status: str
    attempt: int  # an external agent's: 0; an agent-driven env's: its worker's (rids name it)
    agent_token: str | None
    sampling_params: dict[str, Any]
    max_turns: int
    max_response_tokens: int | None
    calls: int  # num_turns: the fence of the next store
    segments: int
    last: Segment | None  # None before the first call
    held: bool = False  # restored from what this process stored, not read (StoredCall)

    @property
    def waiting(self) -> bool:
        return self.status == _RUNNING and self.agent_token is not None


@dataclass(frozen=True)
class StoredCall:
    """An episode as a call stored it: its last segment as written (`columns`) and as it was
    (`segment`, its token lists and the engine input's JSON text, so that the next call neither
    decodes nor encodes what it did not add)."""

    episode: AgentEpisode  # after that call; its `last` is left out (None): `segment` holds it
    columns: dict[str, Any]
    segment: Segment

    @property
    def size(self) -> int:
        """Bytes held, about: the token blobs, the token lists (a pointer and an object per item)
        and the input's JSON text."""
        blob_bytes = sum(len(self.columns[name]) for name in TOKEN_BLOBS)
        tokens = self.segment.tokens
        items = len(tokens.prompt_ids) + 3 * len(tokens.response_ids)
        encoded = self.segment.input_json
        return blob_bytes + 40 * items + (0 if encoded is None else len(encoded.text))

    def restored(self) -> AgentEpisode:
        """The episode as stored, assumed still waiting: the next store's fence tells if not. Its
        last segment's lists are its own; the token lists are shared (a call copies what it grows)."""
        held = self.segment
        last = Segment(
            tokens=held.tokens,
            turns=list(held.turns),
            messages=list(held.messages),
            blobs={name: self.columns[name] for name in TOKEN_BLOBS},
            input_json=held.input_json,
        )
        return replace(self.episode, last=last, held=True)


async def agent_tokens(database: Database, episode_ids: list[str]) -> dict[str, str]:
    async with database.reader() as session:
        rows = await session.execute(
            select(Episode.id, Episode.agent_token).where(
                Episode.id.in_(episode_ids), Episode.agent_token.is_not(None)
            )
        )
        return {episode_id: token for episode_id, token in rows if token is not None}


async def dead_agent_token(database: Database, episode_id: str) -> str | None:
    """The token of the episode's last dead attempt (an agent-driven episode re-queued), if any."""
    async with database.read_only.connect() as connection:
        return await connection.scalar(select(Episode.dead_agent_token).where(Episode.id == episode_id))


# An episode's scalars and its last segment: what a call reads, unless this process holds it.
_HEAD = (
    Episode.id,
    Episode.batch_id,
    Episode.group_index,
    Episode.status,
    Episode.attempt,
    Episode.agent_token,
    Episode.sampling_params,
    Episode.max_turns,
    Episode.max_response_tokens,
    Episode.num_turns,
    Episode.segments,
)
_LAST_SEGMENT = tuple(getattr(Episode, name) for name in SEGMENT_COLUMNS)


def _store_call_statement() -> Update:
    """A call's write, built once (as the queue's result write): fenced by the calls stored so far
    and the agent's token. It pushes an external agent's idle deadline on; an agent-driven episode's
    lease is its worker's, which heartbeats it."""
    table: Table = Episode.__table__  # type: ignore[assignment]  # a declarative model's Table
    idle_until = bindparam("idle_until", type_=table.c.lease_expires_at.type)
    return (
        update(table)
        .where(
            table.c.id == bindparam("episode"),
            table.c.status == _RUNNING,
            table.c.agent_token == bindparam("token"),
            func.coalesce(table.c.num_turns, 0) == bindparam("fence"),
        )
        .values(
            {table.c[name]: bindparam(f"new_{name}", type_=table.c[name].type) for name in SEGMENT_COLUMNS}
            | {
                table.c.num_turns: bindparam("calls"),
                table.c.segments: bindparam("segments"),
                table.c.lease_expires_at: case(
                    (table.c.lease_owner == EXTERNAL_OWNER, idle_until), else_=table.c.lease_expires_at
                ),
            }
        )
        .returning(table.c.id)
    )


_STORE_CALL = _store_call_statement()
_LOAD = select(*_HEAD, *_LAST_SEGMENT).where(Episode.id == bindparam("episode"))


async def load_agent_episode(database: Database, episode_id: str) -> AgentEpisode | None:
    async with database.read_only.connect() as connection:
        head = (await connection.execute(_LOAD, {"episode": episode_id})).first()
    if head is None:
        return None
    return AgentEpisode(
        episode_id=head.id,
        batch_id=head.batch_id,
        group_index=head.group_index,
        status=head.status,
        attempt=head.attempt,
        agent_token=head.agent_token,
        sampling_params=dict(head.sampling_params),
        max_turns=head.max_turns,
        max_response_tokens=head.max_response_tokens,
        calls=head.num_turns or 0,
        segments=head.segments,
        last=_segment_of(head._asdict()),
    )


def _segment_of(columns: dict[str, Any]) -> Segment | None:
    if columns["prompt_ids"] is None or columns["response_ids"] is None:
        return None
    stored = {name: columns[name] or b"" for name in TOKEN_BLOBS}
    return Segment(
        tokens=blobs.decode_tokens(*stored.values()),
        turns=list(columns["turns"] or []),
        messages=list(columns["messages"] or []),
        blobs=stored,
    )


def _token_blobs(segment: Segment) -> dict[str, bytes]:
    """The segment's token blobs: those it was read with, and the bytes of the ids added since."""
    tokens, stored = segment.tokens, segment.blobs
    count = -1 if stored is None else len(stored["loss_mask"]) // blobs.MASK_BYTES
    if stored is None or not 0 <= count <= len(tokens.response_ids):
        return blobs.encode_tokens(tokens)
    if len(stored["prompt_ids"]) != len(tokens.prompt_ids) * blobs.ID_BYTES:
        return blobs.encode_tokens(tokens)
    response, mask, logprobs = tokens.response_ids, tokens.loss_mask, tokens.rollout_logprobs
    added = blobs.encode_tokens(EpisodeTokens([], response[count:], mask[count:], logprobs[count:]))
    return {name: stored[name] + added[name] for name in TOKEN_BLOBS}


def _segment_columns(segment: Segment) -> dict[str, Any]:
    return {**_token_blobs(segment), "turns": segment.turns, "messages": segment.messages}


async def store_call(
    database: Database,
    episode: AgentEpisode,
    segment: Segment,
    *,
    closed: Segment | None,
    idle_seconds: float,
) -> StoredCall | None:
    """Stores a call's outcome: `segment` as the episode's last, `closed` (the segment it
    replaced, if the call started a new one) as segment `episode.segments - 2`. Returns what it
    stored of the last segment; None, storing nothing, when the episode finished, another call
    stored first, or its token is no longer `episode.agent_token` (re-queued)."""
    columns = _segment_columns(segment)
    params = {
        "episode": episode.episode_id,
        "token": episode.agent_token,
        "fence": episode.calls,
        "calls": episode.calls + 1,
        "segments": episode.segments,
        "idle_until": utcnow() + timedelta(seconds=idle_seconds),
    }
    params |= {f"new_{name}": value for name, value in columns.items()}
    if closed is None:
        if not await database.writer.execute(_STORE_CALL, params):
            return None
    else:
        async with database.writer.begin() as session:
            if (await session.execute(_STORE_CALL, params)).first() is None:
                return None
            session.add(
                EpisodeSegment(
                    episode_id=episode.episode_id, segment=episode.segments - 2, **_segment_columns(closed)
                )
            )
    after = replace(episode, calls=episode.calls + 1, last=None, held=False)
    return StoredCall(after, columns, segment)


async def closed_segments(database: Database, episode_id: str) -> list[tuple[list[Any], list[Any]]]:
    """The turns and messages of the episode's closed segments, latest first (no token blobs)."""
    async with database.read_only.connect() as connection:
        rows = await connection.execute(
            select(EpisodeSegment.turns, EpisodeSegment.messages)
            .where(EpisodeSegment.episode_id == episode_id)
            .order_by(EpisodeSegment.segment.desc())
        )
        return [(list(row.turns or []), list(row.messages or [])) for row in rows]


UNPLAYED = "finished before its first call: an episode the model never played is no sample"


def _finish_statements() -> tuple[Update, Select[Any], Update]:
    """The finish's statements, built once, on the table rather than the ORM entity: an ORM row
    would load and decode the whole episode (its token blobs, messages and turns) into the writer's
    shared session, whose every later statement of the group would then autoflush over it
    (measured: a fifth of the service's CPU per call of agent-driven episodes,
    bench/verifiers_envs.py). The usual finish is one write (`at_once`), for an episode with no
    info yet (every running one, as only a finish or a result writes it), its status set by its
    calls in the statement; else a read of what it needs (locked: no call stores meanwhile) and a
    write with the info merged."""
    table: Table = Episode.__table__  # type: ignore[assignment]  # a declarative model's Table
    waiting = (
        table.c.id == bindparam("episode"),
        table.c.status == _RUNNING,
        table.c.agent_token == bindparam("token"),
    )
    ending = {
        table.c.reward: bindparam("new_reward", type_=table.c.reward.type),
        table.c.info: bindparam("new_info", type_=table.c.info.type),
        table.c.lease_owner: None,
        table.c.lease_expires_at: None,
        table.c.finished_at: bindparam("finished_at", type_=table.c.finished_at.type),
    }
    unplayed = func.coalesce(table.c.num_turns, 0) == 0
    error_type = table.c.error.type
    at_once = (
        update(table)
        .where(*waiting, table.c.info.is_(None))
        .values(
            ending
            | {
                table.c.status: case((unplayed, bindparam("unplayed_status")), else_=bindparam("new_status")),
                table.c.error: case(
                    (unplayed, bindparam("unplayed_error", type_=error_type)),
                    else_=bindparam("new_error", type_=error_type),
                ),
            }
        )
        .returning(table.c.batch_id, table.c.group_index, table.c.num_turns)
    )
    read = (
        select(table.c.batch_id, table.c.group_index, table.c.num_turns, table.c.info)
        .where(*waiting)
        .with_for_update()
    )
    write = (
        update(table)
        .where(*waiting)
        .values(
            ending
            | {
                table.c.status: bindparam("new_status"),
                table.c.error: bindparam("new_error", type_=error_type),
            }
        )
    )
    return at_once, read, write


_FINISH_AT_ONCE, _FINISH_READ, _FINISH_WRITE = _finish_statements()


def _unplayed(ending: Ending) -> tuple[EpisodeStatus, str | None]:
    """The status and error of `ending` for an episode that made no call."""
    if ending.status in (EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED):
        return EpisodeStatus.FAILED, ending.error or UNPLAYED
    return ending.status, ending.error


async def finish_agent_episode(
    database: Database,
    episode_id: str,
    ending: Ending,
    token: str,
) -> tuple[tuple[str, int], EpisodeStatus] | None:
    """Ends a waiting external episode as its agent (the holder of `token`) says, unless it made no
    call: then it ends `failed` (a `completed` or `truncated` row without tokens would reach
    trainers). Returns its (batch id, group index) and the status it ended with, or None when it is
    not waiting (finished, cancelled, timed out) or `token` is no longer its own (re-queued)."""
    unplayed_status, unplayed_error = _unplayed(ending)
    params = {
        "episode": episode_id,
        "token": token,
        "new_reward": ending.reward,
        "finished_at": utcnow(),
    }
    rows = await database.writer.execute(
        _FINISH_AT_ONCE,
        params
        | {
            "new_info": dict(ending.info),
            "new_status": ending.status.value,
            "new_error": ending.error,
            "unplayed_status": unplayed_status.value,
            "unplayed_error": unplayed_error,
        },
    )
    if rows:
        played = bool(rows[0].num_turns)
        return (rows[0].batch_id, rows[0].group_index), ending.status if played else unplayed_status
    async with database.writer.begin() as session:  # not waiting, or with info already
        row = (await session.execute(_FINISH_READ, {"episode": episode_id, "token": token})).first()
        if row is None:
            return None
        status, error = (ending.status, ending.error) if row.num_turns else (unplayed_status, unplayed_error)
        await session.execute(
            _FINISH_WRITE,
            params
            | {
                "new_status": status.value,
                "new_info": {**(row.info or {}), **ending.info},
                "new_error": error,
            },
        )
        return (row.batch_id, row.group_index), status
