"""Generation paused by a trainer (POST /engine/pause), and the limit past which the service resumes
it itself. The pause is the whole service's: recorded in the database, so that every process's
/ready says so, whichever one the trainer called."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, RetryCallState, retry_if_result

from service.retries import backoff, next_delay
from service.storage import engine_state
from service.storage.db import Database, utcnow

logger = logging.getLogger(__name__)

RESUME_RETRY_SECONDS = 5.0  # between tries of the pause limit's resume, while workers refuse it
RESUME_RETRY_MAX_SECONDS = 60.0  # doubling up to this
SHUTDOWN_RESUME_SECONDS = 10.0  # a shutdown's resume of the pause it made, at most
# A control call's outcome per worker URL: None where it went through, else the problem.
ControlCall = Callable[[], Awaitable[dict[str, str | None]]]


def _failed(outcome: dict[str, str | None]) -> dict[str, str]:
    return {url: problem for url, problem in outcome.items() if problem is not None}


class EnginePause:
    """Generation paused by POST /engine/pause, until POST /engine/continue or, at the latest,
    `max_seconds` after the last pause: then `resume` runs (a trainer that died mid weight update
    must not leave the engine paused for ever). A process that stops while its pause holds resumes
    generation first, for the same reason."""

    def __init__(
        self,
        max_seconds: float,
        pause: Callable[[str], Awaitable[dict[str, str | None]]],
        resume: ControlCall,
        database: Database,
    ) -> None:
        self.max_seconds = max_seconds
        self._pause = pause
        self._resume = resume
        self._database = database
        self.process = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._paused_here = False  # this process paused generation, and nobody has resumed it since
        self._timer: asyncio.Task[None] | None = None

    async def paused(self) -> str | None:
        """Why generation is paused, whichever process paused it, or None."""
        pause = await engine_state.read_pause(self._database)
        if pause is None:
            return None
        elapsed = (utcnow() - pause.since).total_seconds()
        left = max(0.0, self.max_seconds - elapsed)
        return (
            f"generation paused by POST /engine/pause (mode {pause.mode}) {elapsed:.0f} s ago; POST "
            f"/engine/continue resumes it, or the service itself {left:.0f} s from now"
        )

    async def pause(self, mode: str) -> dict[str, str | None]:
        """Records the pause, then pauses the workers; the limit counts from their answers, even if
        some refused (it resumes those that paused). Started before them, a limit shorter than the
        record's write and the workers' answers (1 s in a test, on a loaded machine) found no pause
        on record and stopped, or resumed the workers before their pause reached them."""
        self._cancel_timer()
        self._paused_here = True
        await engine_state.record_pause(self._database.writer, self.process, mode)
        try:
            return await self._pause(mode)
        finally:
            self._cancel_timer()  # another pause's, made meanwhile: this one's limit replaces it
            self._timer = asyncio.create_task(self._resume_at_limit(), name="engine pause limit")

    async def ended(self) -> None:
        self._cancel_timer()
        self._paused_here = False
        await engine_state.clear_pause(self._database.writer)

    async def _holds(self) -> bool:
        """Whether the pause on record is still this process's: not continued, nor paused anew,
        through another process (whose own limit then holds)."""
        try:
            pause = await engine_state.read_pause(self._database)
        except Exception as error:  # cannot tell: resuming what may be resumed already is harmless
            logger.warning("could not read the pause on record: %s", error)
            return True
        return pause is not None and pause.by == self.process

    async def _resume_at_limit(self) -> None:
        await asyncio.sleep(self.max_seconds)
        if not await self._holds():
            self._paused_here, self._timer = False, None
            return

        async def resume() -> dict[str, str | None]:
            return await self._resume()

        retrying = AsyncRetrying(  # until every worker took it
            wait=backoff(RESUME_RETRY_SECONDS, RESUME_RETRY_MAX_SECONDS),
            retry=retry_if_result(lambda outcome: bool(_failed(outcome))),
            before_sleep=self._resume_failed,
        )
        outcome: dict[str, str | None] = await retrying(resume)
        await self._clear()
        logger.warning(
            "generation stayed paused %g s (MAX_PAUSE_SECONDS) without POST /engine/continue: "
            "resumed it on %d workers",
            self.max_seconds,
            len(outcome),
        )
        self._paused_here, self._timer = False, None

    def _resume_failed(self, state: RetryCallState) -> None:
        outcome = state.outcome.result() if state.outcome is not None else {}
        logger.error(
            "resuming generation after MAX_PAUSE_SECONDS failed on %s; retrying in %.1f s",
            _failed(outcome),
            next_delay(state),
        )

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def _clear(self) -> None:
        try:
            await engine_state.clear_pause(self._database.writer)
        except Exception as error:  # the database is down: the next pause or continue sets it right
            logger.warning("could not record that generation resumed: %s", error)

    async def aclose(self) -> None:
        """Stops the limit's timer; a pause this process made and nobody continued is resumed."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            await asyncio.wait([timer])
        if not self._paused_here or not await self._holds():
            return
        self._paused_here = False
        try:
            async with asyncio.timeout(SHUTDOWN_RESUME_SECONDS):
                failed = _failed(await self._resume())
        except TimeoutError:
            failed = {"*": f"no answer in {SHUTDOWN_RESUME_SECONDS:g} s"}
        if failed:
            logger.error("stopping while generation is paused: resuming it failed on %s", failed)
            return
        logger.warning("stopping while generation is paused (no POST /engine/continue): resumed it")
        await self._clear()
