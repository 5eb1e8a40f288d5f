"""External agents' episodes in one process: load, answer, store, and what this process holds.

Each call stores the episode so far; this process keeps what it stored (`HeldEpisodes`), so that
the agent's next call (usually to the same process) need not read its episode back. What it holds
may be stale (a call through another process, a cancel, the idle timeout): the store's fence then
refuses the call, and it is answered again from the database.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from cachetools import LRUCache

from service.agents.conversation import Answer, ChatCall, after_previous, answered_through
from service.agents.errors import EpisodeClosed, UnknownEpisode, UnknownResponse
from service.agents.repository import (
    AgentEpisode,
    StoredCall,
    closed_segments,
    dead_agent_token,
    finish_agent_episode,
    load_agent_episode,
    store_call,
)
from service.agents.session import AgentTurns
from service.agents.streaming import AnswerStream
from service.records import Ending, EpisodeSpec, EpisodeStatus
from service.storage.db import Database
from service.storage.driven import HandedOver

HELD_BYTES = 256 * 1024 * 1024  # token blobs of the episodes a process holds


class Held(Protocol):
    """An episode as this process left it: a call's store (StoredCall), or a hand-over."""

    @property
    def size(self) -> int: ...

    def restored(self) -> AgentEpisode: ...


@dataclass(frozen=True)
class HandedEpisode:
    """An agent-driven episode as this process handed it over to its driver, before any call."""

    episode: AgentEpisode
    size: int = 1024  # bytes, about: its scalars and sampling parameters

    def restored(self) -> AgentEpisode:
        return replace(self.episode, held=True)


class HeldEpisodes:
    """The episodes this process stored last, least recently used out first, up to `max_bytes` of
    token blobs."""

    def __init__(self, max_bytes: int = HELD_BYTES) -> None:
        self._held: LRUCache[str, Held] = LRUCache(max_bytes, getsizeof=_size)

    def get(self, episode_id: str) -> Held | None:
        return self._held.get(episode_id)

    def put(self, episode_id: str, stored: Held) -> None:
        self._held.pop(episode_id, None)
        try:
            self._held[episode_id] = stored
        except ValueError:  # larger than the whole cache: not held
            pass

    def pop(self, episode_id: str) -> None:
        self._held.pop(episode_id, None)

    @property
    def bytes(self) -> int:
        return int(self._held.currsize)


def _size(stored: Held) -> int:
    return stored.size


class AgentSessions:
    """External agents' episodes as this process serves them. Reading an episode (and so checking
    its agent's token) needs only the database; answering a call needs the engine and the
    tokenizer, which `turns` builds on first use (an API-only process loads its tokenizer then)."""

    def __init__(
        self,
        database: Database,
        turns: Callable[[], Awaitable[AgentTurns]],
        *,
        idle_seconds: float,
        held_bytes: int = HELD_BYTES,
    ) -> None:
        self.database = database
        self._turns = turns
        self.idle_seconds = idle_seconds
        self.held = HeldEpisodes(held_bytes)

    def handed_over(self, spec: EpisodeSpec, handed: HandedOver) -> None:
        """Holds an agent-driven episode as its worker handed it over to its driver (no call yet,
        its token new): its first call need not read it (measured: a twentieth of the service's
        CPU per call of agent-driven episodes, most of which make one or two calls)."""
        request = spec.request
        episode = AgentEpisode(
            episode_id=spec.episode_id,
            batch_id=handed.batch_id,
            group_index=handed.group_index,
            status=EpisodeStatus.RUNNING.value,
            attempt=spec.attempt,
            agent_token=handed.token,
            sampling_params=dict(request.sampling_params),
            max_turns=request.max_turns,
            max_response_tokens=request.max_response_tokens,
            calls=0,
            segments=1,
            last=None,
        )
        self.held.put(spec.episode_id, HandedEpisode(episode))

    async def episode(self, episode_id: str, *, fresh: bool = False) -> AgentEpisode:
        """The episode as this process stored it last (unless `fresh`), else as the database has
        it; raises UnknownEpisode when there is none. Its `agent_token` is None when no agent plays
        it (not an external agent's, or an agent-driven env's between two attempts)."""
        if fresh:
            self.held.pop(episode_id)
        held = self.held.get(episode_id)
        episode = held.restored() if held is not None else await load_agent_episode(self.database, episode_id)
        if episode is None:
            raise UnknownEpisode(f"no external episode {episode_id!r}")
        return episode

    async def dead_token(self, episode_id: str) -> str | None:
        """The token of the episode's last dead attempt (an agent-driven episode re-queued), if any."""
        return await dead_agent_token(self.database, episode_id)

    @staticmethod
    def check_waiting(episode: AgentEpisode) -> None:
        if not episode.waiting:
            raise EpisodeClosed(f"episode {episode.episode_id!r} is {episode.status}: it takes no more calls")

    async def complete(
        self, episode: AgentEpisode, call: ChatCall, stream: AnswerStream | None = None
    ) -> Answer:
        """Answers the call and stores it before returning the answer; raises EpisodeClosed when
        the episode ended or took another call meanwhile (nothing stored), or an error of
        `AgentTurns.answer`. With `stream`, the answer streams there as it is sampled."""
        stored, answer = await self._answer_and_store(episode, call, stream)
        if stored is None and episode.held:
            # What this process held was stale: read the episode and answer again.
            fresh = await load_agent_episode(self.database, episode.episode_id)
            if fresh is None or not fresh.waiting:
                raise EpisodeClosed(f"episode {episode.episode_id!r} takes no more calls")
            if fresh.agent_token != episode.agent_token:  # re-queued: another attempt's agent plays it
                raise EpisodeClosed(
                    f"episode {episode.episode_id!r} was re-queued: attempt {fresh.attempt} runs it now, "
                    f"and the calls of attempt {episode.attempt} are not recorded"
                )
            stored, answer = await self._answer_and_store(fresh, call, stream)
        if stored is None:
            raise EpisodeClosed(
                f"episode {episode.episode_id!r} ended or took another call meanwhile: "
                "this one is not recorded"
            )
        return answer

    async def _answer_and_store(
        self, episode: AgentEpisode, call: ChatCall, stream: AnswerStream | None
    ) -> tuple[StoredCall | None, Answer]:
        """The stored state is None when the store's fence refused the call."""
        if call.previous_call is not None:
            earlier = await self._answered_through(episode, call.previous_call)
            call = replace(call, messages=after_previous(earlier, call.messages), previous_call=None)
        answered = await (await self._turns()).answer(episode, call, stream)
        stored = await store_call(
            self.database, episode, answered.segment, closed=answered.closed, idle_seconds=self.idle_seconds
        )
        if stored is None:
            self.held.pop(episode.episode_id)
        else:
            self.held.put(episode.episode_id, stored)
        return stored, answered.answer

    async def _answered_through(self, episode: AgentEpisode, call: int) -> list[dict[str, Any]]:
        """The conversation through the answer to the episode's call `call` (any earlier call: the
        latest, an earlier one of the last segment, or one of a closed segment, read from the
        database); raises UnknownResponse when the episode made no such call."""
        last = episode.last
        earlier = None if last is None else answered_through(last.turns, last.messages, call)
        if earlier is None and 0 <= call < episode.calls:
            for turns, messages in await closed_segments(self.database, episode.episode_id):
                if (earlier := answered_through(turns, messages, call)) is not None:
                    break
        if earlier is None:
            raise UnknownResponse(
                f"episode {episode.episode_id!r} has no response {call}: it made {episode.calls} calls"
            )
        return earlier

    async def finish(
        self,
        episode_id: str,
        ending: Ending,
        token: str,
    ) -> tuple[tuple[str, int], EpisodeStatus]:
        """Ends the episode as its agent, the holder of `token`, says (`failed` if it made no
        call); returns its (batch id, group index) and the status it ended with. Raises
        EpisodeClosed when it already ended, or was re-queued since (a new attempt, a new token)."""
        ended = await finish_agent_episode(self.database, episode_id, ending, token)
        self.held.pop(episode_id)
        if ended is None:
            raise EpisodeClosed(f"episode {episode_id!r} already ended, or was re-queued: not finished")
        return ended
