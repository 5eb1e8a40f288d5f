"""Finished episodes' results, stored together: the results that reach the writer while it is busy
are stored by one block (one fence read, one executemany) rather than a block each.

At 2,000 episodes in flight a block per result cost its own savepoint, statement and ORM
execution, the largest share of the service's CPU per turn. A result's write still returns only
once it is committed; a batch that fails as a whole for a reason a retry may clear (an outage, a
lost group) fails every caller's write, which each retries; any other failure of the batch (one
result the database refuses, a value that cannot be encoded) is not the others' to share: the batch
falls back to one block per result, so each caller gets its own outcome.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import nullcontext

from service.records import EpisodeResult
from service.storage import queue
from service.storage.errors import is_transient
from service.storage.queue import Finished
from service.storage.writer import Writer

logger = logging.getLogger(__name__)

_Waiting = tuple[Finished, "asyncio.Future[bool]"]


class ResultWrites:
    """One worker's result writes (`worker_id` holds their leases) through `writer`."""

    def __init__(self, writer: Writer, worker_id: str) -> None:
        self._writer = writer
        self._worker_id = worker_id
        self._waiting: list[_Waiting] = []
        self._flushing: set[asyncio.Task[None]] = set()
        self._collecting = False  # a flush waits for its turn at the writer: results join it

    async def finish(self, episode_id: str, attempt: int, result: EpisodeResult) -> bool:
        """Stores `result` if the episode still runs under this worker's lease `attempt`; False,
        writing nothing, when that lease was lost. Returns once it is committed."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.append((Finished(episode_id, attempt, result), future))
        if not self._collecting:
            self._collecting = True
            flush = asyncio.create_task(self._flush(), name="result writes")
            self._flushing.add(flush)
            flush.add_done_callback(self._flushing.discard)
        return await future

    def _take(self) -> list[_Waiting]:
        batch, self._waiting = self._waiting, []
        self._collecting = False
        return batch

    async def _flush(self) -> None:
        batch: list[_Waiting] | None = None
        # A result alone is one statement (finish_episodes): on SQLite it fails alone without the
        # block's savepoint, which with its release was two of the block's three statements.
        bare = self._writer.statements_fail_alone
        try:
            try:
                async with self._writer.begin(savepoint=not bare) as session:
                    # Taken once the writer's turn came: what arrived meanwhile is in this batch.
                    batch = self._take()
                    items = [item for item, _ in batch]
                    async with session.begin_nested() if bare and len(items) > 1 else nullcontext():
                        stored = await queue.finish_episodes(session, self._worker_id, items)
            except Exception as error:
                if batch is None:  # the block never opened (the writer is closed, or its group failed)
                    batch = self._take()
                if len(batch) > 1 and not is_transient(error):
                    logger.warning("%d results stored together failed (%r): one by one", len(batch), error)
                    await self._one_by_one(batch)
                else:
                    for _, future in batch:
                        _settle(future, error=error)
            else:
                for (_, future), was_stored in zip(batch, stored, strict=True):
                    _settle(future, was_stored)
        finally:  # cancelled (the loop ends): no caller waits forever
            for _, future in batch if batch is not None else self._take():
                future.cancel()

    async def _one_by_one(self, batch: list[_Waiting]) -> None:
        for item, future in batch:
            try:
                stored = await queue.finish_episode(
                    self._writer, self._worker_id, item.episode_id, item.attempt, item.result
                )
            except Exception as error:
                _settle(future, error=error)
            else:
                _settle(future, stored)


def _settle(future: asyncio.Future[bool], stored: bool = False, *, error: Exception | None = None) -> None:
    if future.done():  # its caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(stored)
