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
from collections.abc import Callable, Iterable

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception

from service.metrics import Metrics
from service.retries import backoff, failed_attempt
from service.storage import groups
from service.storage.db import Database
from service.storage.errors import is_transient
from service.storage.groups import CompletedGroup, GroupKey

logger = logging.getLogger(__name__)

# After a touch, for more of them to join the same transaction: at 2,000 episodes in flight a
# round per 20 ms (a write transaction and its reads) was 4-5% of the service's CPU.
GATHER_SECONDS = 0.1
SWEEP_SECONDS = 2.0  # between sweeps of every unlogged group
RETRY_SECONDS = 1.0  # after a failed transaction (the database down); doubles, jittered
RETRY_MAX_SECONDS = 8.0  # up to this
# How long a stop waits for the round in flight (milliseconds as a rule): one still waiting past it
# is on a database that does not answer, and waited as long as its connect timeout (30 s and more).
STOP_WAIT_SECONDS = 5.0


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
        self._next_sweep = 0.0  # the loop's time of the next sweep

    def touch(self, keys: Iterable[GroupKey] = (), batches: Iterable[str] = ()) -> None:
        """These groups, or every group of these batches, may be complete now."""
        self._keys.update(keys)
        self._batches.update(batches)
        self._touched.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="group log")

    async def stop(self) -> None:
        """Logs what was touched (one try) and stops, cutting the round short only if it has not
        ended STOP_WAIT_SECONDS later; a sweep in any process logs what is left."""
        self._stopping = True
        self._touched.set()
        if self._task is None:
            return
        done, _ = await asyncio.wait([self._task], timeout=STOP_WAIT_SECONDS)
        if not done:
            logger.warning(
                "logging complete groups did not end %g s after the stop: cancelled", STOP_WAIT_SECONDS
            )
            self._task.cancel()
            await asyncio.wait([self._task])

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        self._next_sweep = loop.time()
        retrying = AsyncRetrying(  # one round at a time: reused
            wait=backoff(RETRY_SECONDS, RETRY_MAX_SECONDS),
            retry=retry_if_exception(is_transient),
            stop=lambda state: self._stopping,
            before_sleep=self._round_failed,
            reraise=True,
        )
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, self._next_sweep - loop.time())):
                    await self._touched.wait()
                    if not self._stopping:
                        await asyncio.sleep(GATHER_SECONDS)
            self._touched.clear()
            try:
                await retrying(self._round)
            except Exception as error:
                if is_transient(error):  # retried until the log stopped
                    self._database.status.failed(error)
                else:
                    logger.error("logging complete groups failed: a bug, not an outage", exc_info=error)
            if self._stopping:
                return

    async def _round(self) -> None:
        if self._keys or self._batches:
            await self._log_touched()
        loop = asyncio.get_running_loop()
        if not self._stopping and loop.time() >= self._next_sweep:
            await self.sweep()
            self._next_sweep = loop.time() + self._sweep_seconds

    def _round_failed(self, state: RetryCallState) -> None:
        error, delay = failed_attempt(state)
        self._database.status.failed(error)
        logger.warning("logging complete groups failed (%s); retry in %.1f s", error, delay)

    async def _log_touched(self) -> None:
        keys, batches = self._keys, self._batches
        self._keys, self._batches = set(), set()
        try:
            async with groups.log_transaction(self._database) as session:
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
            async with groups.log_transaction(self._database) as session:
                completed = await groups.log_complete(session, None)
            self._logged(completed)
            count += len(completed)
            if len(completed) < groups.SWEEP_LIMIT:
                return count

    def _logged(self, completed: list[CompletedGroup]) -> None:
        if completed:
            self._metrics.groups_completed.inc(len(completed))
            self._on_logged(completed)
