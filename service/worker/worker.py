"""Runs queued episodes in this process: claims them, keeps their leases, stores their results.

Several processes may share one database: claims are disjoint (SKIP LOCKED), a result is written
only under the lease it was run with, and a lease that is not renewed (the process died) expires
and the episode is re-queued with attempt + 1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception

from service.config import Settings
from service.engine.placement import Route, current_route
from service.engine.status import EngineStatus
from service.logs import EPISODE_LOG_FIELDS
from service.loop.driven import Runner
from service.records import EpisodeResult
from service.retries import backoff, failed_attempt, first_then_retrying
from service.storage import agents, engine_state, queue
from service.storage.db import Database
from service.storage.errors import is_refused, is_transient
from service.storage.queue import ClaimedEpisode
from service.storage.results import ResultWrites

logger = logging.getLogger(__name__)
T = TypeVar("T")

CLAIM_BATCH = 256  # episodes claimed in one transaction, at most
STORE_BACKOFF_SECONDS = 0.2  # first delay between tries of a result write; doubles, jittered
STORE_BACKOFF_MAX_SECONDS = 2.0  # up to this: a result is held until the database takes it
WRITES_DRAIN_SECONDS = 15.0  # on shutdown, how long result writes already under way may take
CANCEL_WAIT_SECONDS = 5.0  # on shutdown, how long cancelled episodes may take to unwind
LOOPS_STOP_SECONDS = 5.0  # on shutdown, how long the background loops may take to finish a round
# Attempts an episode gets, re-runs of stale ones included: past them a stale episode is stored
# failed (its error says why), so that a bound no episode can meet does not loop forever.
STALE_ATTEMPTS = 16
CANCELLED_POLL_SECONDS = 0.5  # how often the batches of running episodes are checked for a cancel
VERSIONS_SHARE_SECONDS = 1.0  # how often, while episodes run, the newest weight version is shared
FinishedHook = Callable[[ClaimedEpisode, EpisodeResult], None]


@dataclass
class _Running:
    claim: ClaimedEpisode
    task: asyncio.Task[None]
    # Its result write (or an agent-driven episode's finish) has started: a late lease renewal
    # must not cancel it.
    writing: bool = False


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class EpisodeWorker:
    def __init__(
        self,
        settings: Settings,
        database: Database,
        runner: Runner,
        *,
        on_finished: FinishedHook | None = None,
        worker_id: str | None = None,
        engine_status: EngineStatus | None = None,
    ) -> None:
        self.settings = settings
        self.database = database
        self.writes = database.writer
        self.runner = runner
        self.on_finished = on_finished
        self.engine_status = engine_status  # while it says the engine is down, nothing is claimed
        self.worker_id = worker_id or new_worker_id()
        self.results = ResultWrites(self.writes, self.worker_id)  # stored together when finished together
        self.running: dict[str, _Running] = {}
        self._writes: set[asyncio.Future[bool]] = set()  # result writes under way (shielded)
        self._stopping = asyncio.Event()
        self._halt = asyncio.Event()  # the heartbeat, sweep and cancelled loops end (after the drain)
        self._wake = asyncio.Event()
        self._shared_version: int | None = None  # the newest weight version, as last shared
        self._versions_shared_at = -VERSIONS_SHARE_SECONDS * 2  # monotonic; long ago: never
        self._loops: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._loops = [
            asyncio.create_task(self._claim_loop(), name="claim"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._sweep_loop(), name="sweep"),
            asyncio.create_task(self._cancelled_loop(), name="cancelled"),
            asyncio.create_task(self._versions_loop(), name="weight versions"),
        ]
        logger.info("worker %s started", self.worker_id)

    def wake(self) -> None:
        """New work was enqueued: claim now instead of at the next poll."""
        self._wake.set()

    def finishing(self, episode_id: str) -> None:
        """An agent-driven episode's finish started (loop/driven.py): fenced on its token, it is
        not to be cancelled halfway, as a result write is not."""
        if (running := self.running.get(episode_id)) is not None:
            running.writing = True

    def cancel(self, episode_ids: Collection[str]) -> set[str]:
        """Stops those of `episode_ids` that run here (their batch was cancelled): cancelling an
        episode's task aborts its engine request and closes its env. Returns the ids that ran here."""
        here = set()
        for episode_id in episode_ids:
            running = self.running.get(episode_id)
            if running is None:
                continue
            here.add(episode_id)
            if not running.writing and not running.task.done():  # a write under way is fenced out
                running.task.cancel()
        return here

    async def stop(self, timeout: float | None = None) -> None:
        """Stops claiming; lets in-flight episodes finish for `timeout` seconds, then cancels and
        releases the rest (their leases go back to the queue for another process)."""
        timeout = self.settings.shutdown_timeout_seconds if timeout is None else timeout
        self._stopping.set()
        self._wake.set()
        claim_loop = self._loops[0] if self._loops else None
        if claim_loop is not None:
            await asyncio.gather(claim_loop, return_exceptions=True)
        tasks = [running.task for running in self.running.values()]
        if tasks:
            logger.info("draining %d in-flight episodes for up to %.0f s", len(tasks), timeout)
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=CANCEL_WAIT_SECONDS)
        if self._writes:  # shielded from the cancellation above: let them land before releasing
            await asyncio.wait(self._writes, timeout=WRITES_DRAIN_SECONDS)
        # The loops end at their next pause, not cancelled: a write cut off mid-statement would
        # lose its group on the shared writer connection, and on SQLite leave the lock held.
        self._halt.set()
        _, stuck = await asyncio.wait(self._loops, timeout=LOOPS_STOP_SECONDS)
        for loop in stuck:
            loop.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        released = await queue.release_episodes(self.writes, self.worker_id)
        if released:
            logger.info("released %d unfinished episodes back to the queue", released)

    async def _pause(self, seconds: float) -> bool:
        """Waits `seconds` between two rounds of a loop; False once the loops are to end."""
        try:
            await asyncio.wait_for(self._halt.wait(), seconds)
        except TimeoutError:
            return True
        return False

    async def _claim_loop(self) -> None:
        while not self._stopping.is_set():
            limit = min(self.settings.max_running_episodes - len(self.running), CLAIM_BATCH)
            claimed: list[ClaimedEpisode] = []
            if self.engine_status is not None and self.engine_status.down:
                await self.engine_status.check()  # asks the engine at most every PROBE_SECONDS
                if self.engine_status.down:
                    limit = 0
            if limit > 0:
                try:
                    if await queue.any_queued(self.database):
                        claimed = await queue.claim_episodes(
                            self.writes, self.worker_id, limit, self.settings.lease_seconds
                        )
                    self.database.status.ok()
                except Exception as error:
                    self._round_failed("claiming episodes", error)
            if claimed and time.monotonic() - self._versions_shared_at > VERSIONS_SHARE_SECONDS * 2:
                # Idle since (the versions loop shares only while episodes run): the first episodes
                # would otherwise start unbounded by the other processes' newest version, and a
                # short one could end before the loop's next round.
                try:
                    await self._share_newest_version()
                except Exception as error:
                    self._round_failed("sharing the newest weight version", error)
            for claim in claimed:
                previous = self.running.get(claim.id)
                if previous is not None:  # its lease expired (this process stalled) and came back to us
                    previous.task.cancel()
                task = asyncio.create_task(self._run(claim), name=f"episode {claim.id}")
                self.running[claim.id] = _Running(claim, task)
            if claimed and len(claimed) == limit:
                continue  # more may be waiting
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.settings.claim_interval_seconds)
            except TimeoutError:
                pass

    async def _run(self, claim: ClaimedEpisode) -> None:
        EPISODE_LOG_FIELDS.set(
            {
                "episode_id": claim.id,
                "attempt": claim.attempt,
                "batch_id": claim.batch_id,
                "worker_id": self.worker_id,
            }
        )
        # The engine places the episode's calls by it: the group's worker holds the shared prompt.
        current_route.set(Route(claim.id, f"{claim.batch_id}/{claim.group_index}"))
        try:
            try:
                result = await self.runner.run(claim.spec)
                if result is None:  # handed over to its agent (an agent-driven env), which finishes it
                    return
            except asyncio.CancelledError:
                raise
            except Exception as error:  # a bug in the loop must end this episode, not the worker
                logger.exception("episode %s crashed", claim.id)
                result = EpisodeResult.failed(f"internal error: {error!r}")
            mine = self.running.get(claim.id)
            if mine is not None and mine.claim is claim:
                mine.writing = True
            write = asyncio.ensure_future(self._write(claim, result))
            self._writes.add(write)
            write.add_done_callback(self._writes.discard)
            # A cancellation (shutdown, lost lease) must not cut the write in half; stop() awaits it.
            await asyncio.shield(write)
        finally:
            if (mine := self.running.get(claim.id)) is not None and mine.claim is claim:
                del self.running[claim.id]

    async def _write(self, claim: ClaimedEpisode, result: EpisodeResult) -> bool:
        """Stores the result, or re-queues a retryable failure that has attempts left, or a stale
        episode (past its max_staleness) for a fresh attempt, which is no failure."""
        # An engine outage is waited out: the episode goes back to the queue, no failure counted,
        # and the claim loop holds off until the engine answers. STALE_ATTEMPTS still bounds it (an
        # engine that dies of this very episode's request must not loop forever).
        rerun_stale = (result.stale or result.engine_down) and claim.attempt + 1 < STALE_ATTEMPTS
        retry_failed = result.retryable and claim.failures + 1 < self.settings.max_failed_attempts
        if rerun_stale or retry_failed:
            why = "the engine is down; queued to wait for it" if result.engine_down else "queued to run again"
            logger.warning("episode %s attempt %d: %s; %s", claim.id, claim.attempt, result.error, why)
            released = await self._with_retries(
                claim,
                lambda: queue.release_episodes(
                    self.writes, self.worker_id, [claim.id], failed=not rerun_stale, attempt=claim.attempt
                ),
            )
            return released > 0

        def finish(result: EpisodeResult) -> Awaitable[bool]:
            return self.results.finish(claim.id, claim.attempt, result)

        try:
            stored = await self._with_retries(claim, lambda: finish(result))
        except Exception as error:
            if not is_refused(error):
                raise
            # The result itself is refused (e.g. a NUL character in a JSON text): record why.
            logger.error("episode %s: its result cannot be stored: %s", claim.id, error)
            refused = EpisodeResult.failed(f"the result could not be stored: {error}"[:2000])
            stored = await self._with_retries(claim, lambda: finish(refused))
        if not stored:
            logger.warning("episode %s attempt %d lost its lease; result discarded", claim.id, claim.attempt)
        elif self.on_finished is not None:
            self.on_finished(claim, result)
        return stored

    async def _with_retries(self, claim: ClaimedEpisode, write: Callable[[], Awaitable[T]]) -> T:
        """Runs a database write until it goes through: a finished result is held in memory through
        a database outage, never thrown away. Its lease stays valid meanwhile: the heartbeat renews
        it as soon as the database answers, and no sweep re-queues leases that expired during an
        outage (see _sweep_loop). Only a transient error is retried; any other is raised.

        Its retrying object is built only if the first try fails (first_then_retrying)."""
        episode_id = claim.id  # not the claim: the closures below must not hold it

        def retrying() -> AsyncRetrying:
            def failed(state: RetryCallState) -> None:
                error, delay = failed_attempt(state)
                self.database.status.failed(error)
                logger.warning("writing episode %s failed (%s); retry in %.1f s", episode_id, error, delay)

            return AsyncRetrying(
                wait=backoff(STORE_BACKOFF_SECONDS, STORE_BACKOFF_MAX_SECONDS),
                retry=retry_if_exception(is_transient),
                before_sleep=failed,
                reraise=True,
            )

        return await first_then_retrying(write, retrying)

    def _round_failed(self, what: str, error: Exception) -> None:
        """A round of a background loop failed; the loop goes on. An outage is recorded (/health
        shows it, the lease sweep waits for the database to answer a whole lease); anything else is
        a bug: logged with its traceback, and neither marks the database down nor pauses the sweep."""
        if is_transient(error):
            self.database.status.failed(error)
            logger.warning("%s failed (%s: %s); retrying", what, type(error).__name__, error)
        else:
            logger.error("%s failed: a bug, not an outage", what, exc_info=error)

    async def _heartbeat_loop(self) -> None:
        interval = self.settings.lease_seconds / 3
        while await self._pause(interval):
            ids = list(self.running)
            if not ids:
                continue
            try:
                renewed = await queue.renew_leases(
                    self.writes, self.worker_id, ids, self.settings.lease_seconds
                )
                self.database.status.ok()
            except Exception as error:
                self._round_failed("renewing leases", error)
                continue
            for episode_id in set(ids) - renewed:
                running = self.running.get(episode_id)
                # Writing meanwhile: no longer a lease to keep.
                if running is None or running.writing or running.task.done():
                    continue
                # Re-queued behind its back (another worker runs it), or its batch was cancelled.
                logger.warning("lost the lease of episode %s; stopped", episode_id)
                running.task.cancel()

    async def _sweep_loop(self) -> None:
        lease = self.settings.lease_seconds
        while True:
            # Leases expire during a database outage although their workers live on: sweep only
            # once the database has answered for a whole lease, time for every live worker's
            # heartbeat to renew them.
            if self.database.status.answered_for(lease):
                try:
                    count = await queue.requeue_expired(
                        self.writes, self.settings.max_failed_attempts, spare_owner=self.worker_id
                    )
                except Exception as error:
                    self._round_failed("sweeping expired leases", error)
                else:
                    if count:
                        logger.info("re-queued %d episodes whose lease expired", count)
                        self.wake()
                try:
                    idle = await agents.expire_idle_agents(self.database)
                except Exception as error:
                    self._round_failed("sweeping idle external agents", error)
                else:
                    if idle:  # their groups are logged by the group log's sweep
                        logger.info("%d external episodes failed: %s", len(idle), agents.IDLE_ERROR)
            if not await self._pause(self.settings.sweep_interval_seconds):
                return

    async def _versions_loop(self) -> None:
        """Shares the newest weight version with the service's other processes, while episodes run:
        `max_staleness` is measured against the newest any of them sampled from (one trainer's
        weights behind them all), not only against this process's."""
        while await self._pause(VERSIONS_SHARE_SECONDS):
            if not self.running:
                continue
            try:
                await self._share_newest_version()
            except Exception as error:
                self._round_failed("sharing the newest weight version", error)

    async def _share_newest_version(self) -> None:
        """Raises the shared newest version to this process's, or reads it from the others'."""
        seen, shared = self.runner.newest_version, self._shared_version
        if seen is not None and (shared is None or seen > shared):
            shared = await engine_state.raise_newest_version(self.writes, seen)
        else:
            shared = await engine_state.read_newest_version(self.database)
        self._shared_version, self._versions_shared_at = shared, time.monotonic()
        if shared is not None and (seen is None or shared > seen):
            self.runner.newest_version = shared

    async def _cancelled_loop(self) -> None:
        """Stops the running episodes of batches cancelled through any process (POST
        /batches/{id}/cancel): this process's engine requests were aborted there, but an episode
        between two of them (in its env) would go on to the next."""
        while await self._pause(CANCELLED_POLL_SECONDS):
            batches = {running.claim.batch_id for running in self.running.values() if not running.writing}
            if not batches:
                continue
            try:
                cancelled = await queue.cancelled_batches(self.database, batches)
            except Exception as error:
                self._round_failed("checking for cancelled batches", error)
                continue
            if cancelled:
                ids = [
                    key
                    for key, running in self.running.items()
                    if running.claim.batch_id in cancelled and not running.writing
                ]
                logger.info("stopping %d episodes of cancelled batches %s", len(ids), sorted(cancelled))
                self.cancel(ids)
