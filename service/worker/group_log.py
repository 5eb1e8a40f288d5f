"""Keeps the stream of complete groups (storage/groups.py) up to date, in every service process.

A group is logged complete in its own short transaction after the write that completed it
committed: soon after this process stored one of its episodes or cancelled its batch (`touch`),
and, for everything else, by a sweep every few seconds: a process that died between an episode's
result and its group's log, episodes failed by the lease sweep, batches stored before the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable

from sqlalchemy.ext.asyncio import AsyncSession

from service.metrics import Metrics
from service.storage import groups
from service.storage.db import Database
from service.storage.groups import CompletedGroup, GroupKey
from service.worker.worker import DATABASE_ERRORS

logger = logging.getLogger(__name__)

GATHER_SECONDS = 0.02  # after a touch, for more of them to join the same transaction
SWEEP_SECONDS = 2.0  # between sweeps of every unlogged group
RETRY_SECONDS = 1.0  # after a failed transaction (the database down)


class GroupLog:
    def __init__(
        self,
        database: Database,
        metrics: Metrics,
        on_logged: Callable[[list[CompletedGroup]], None],
        *,
        sweep_seconds: float = SWEEP_SECONDS,
    ) -> None:
        self._database = database
        self._metrics = metrics
        self._on_logged = on_logged
        self._sweep_seconds = sweep_seconds
        self._keys: set[GroupKey] = set()
        self._batches: set[str] = set()
        self._touched = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    def touch(self, keys: Iterable[GroupKey] = (), batches: Iterable[str] = ()) -> None:
        """These groups, or every group of these batches, may be complete now."""
        self._keys.update(keys)
        self._batches.update(batches)
        self._touched.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="group log")

    async def stop(self) -> None:
        """Logs what was touched (one try) and stops, never cutting a transaction short; a sweep
        in another process catches what fails here."""
        self._stopping = True
        self._touched.set()
        if self._task is not None:
            await asyncio.wait([self._task])

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_sweep = loop.time()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_sweep - loop.time())):
                    await self._touched.wait()
                    if not self._stopping:
                        await asyncio.sleep(GATHER_SECONDS)
            self._touched.clear()
            try:
                if self._keys or self._batches:
                    await self._log_touched()
                if self._stopping:
                    return
                if loop.time() >= next_sweep:
                    await self.sweep()
                    next_sweep = loop.time() + self._sweep_seconds
            except DATABASE_ERRORS as error:
                self._database.status.failed(error)
                if self._stopping:
                    return
                logger.warning("logging complete groups failed (%s); retrying", error)
                await asyncio.sleep(RETRY_SECONDS)

    async def _log_touched(self) -> None:
        keys, batches = self._keys, self._batches
        self._keys, self._batches = set(), set()
        try:
            async with self._transaction() as session:
                for batch_id in batches:
                    keys.update(await groups.batch_group_keys(session, batch_id))
                completed = await groups.log_complete(session, keys)
        except BaseException:
            self._keys |= keys  # tried again next time
            self._batches |= batches
            raise
        self._logged(completed)

    async def sweep(self) -> int:
        """Logs every complete group not logged yet; returns how many."""
        count = 0
        while True:
            async with self._transaction() as session:
                completed = await groups.log_complete(session, None)
            self._logged(completed)
            count += len(completed)
            if len(completed) < groups.SWEEP_LIMIT:
                return count

    def _logged(self, completed: list[CompletedGroup]) -> None:
        if completed:
            self._metrics.groups_completed.inc(len(completed))
            self._on_logged(completed)

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[AsyncSession]:
        # PostgreSQL: a transaction of its own, committed at once, since it holds the seq lock until
        # its commit; in the writer's group it would wait behind row locks another process's log
        # transaction may be waiting on. SQLite has one writer and no row locks: the writer's group.
        if self._database.engine.dialect.name == "postgresql":
            async with self._database.sessionmaker.begin() as session:
                yield session
        else:
            async with self._database.writer.begin() as session:
                yield session
