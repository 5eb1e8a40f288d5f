"""Finished episodes' results, stored together: the results that reach the writer while it is busy
are stored by one block (one fence read, one executemany) rather than a block each (WriteBatches).

At 2,000 episodes in flight a block per result cost its own savepoint, statement and ORM
execution, the largest share of the service's CPU per turn.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from service.records import EpisodeResult
from service.storage import queue
from service.storage.queue import Finished
from service.storage.writer import WriteBatches, Writer


class ResultWrites:
    """One worker's result writes (`worker_id` holds their leases) through `writer`."""

    def __init__(self, writer: Writer, worker_id: str) -> None:
        async def many(session: AsyncSession, items: list[Finished]) -> list[bool]:
            return await queue.finish_episodes(session, worker_id, items)

        async def one(item: Finished) -> bool:
            return await queue.finish_episode(writer, worker_id, item.episode_id, item.attempt, item.result)

        self._batches = WriteBatches(writer, "results", many, one)

    async def finish(self, episode_id: str, attempt: int, result: EpisodeResult) -> bool:
        """Stores `result` if the episode still runs under this worker's lease `attempt`; False,
        writing nothing, when that lease was lost. Returns once it is committed."""
        return await self._batches.write(Finished(episode_id, attempt, result))
