"""Generation paused by a trainer (POST /engine/pause), and the limit past which the service resumes
it itself."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, RetryCallState, retry_if_result

from service.retries import backoff, next_delay

logger = logging.getLogger(__name__)

RESUME_RETRY_SECONDS = 5.0  # between tries of the pause limit's resume, while workers refuse it
RESUME_RETRY_MAX_SECONDS = 60.0  # doubling up to this
# A control call's outcome per worker URL: None where it went through, else the problem.
ControlCall = Callable[[], Awaitable[dict[str, str | None]]]


def _failed(outcome: dict[str, str | None]) -> dict[str, str]:
    return {url: problem for url, problem in outcome.items() if problem is not None}


class EnginePause:
    """Generation paused by POST /engine/pause, until POST /engine/continue or, at the latest,
    `max_seconds` after the last pause: then `resume` runs (a trainer that died mid weight update
    must not leave the engine paused for ever)."""

    def __init__(self, max_seconds: float, resume: ControlCall) -> None:
        self.max_seconds = max_seconds
        self._resume = resume
        self._since: float | None = None  # time.monotonic() of the pause
        self._timer: asyncio.Task[None] | None = None

    @property
    def paused(self) -> bool:
        return self._since is not None

    def describe(self) -> str:
        assert self._since is not None
        elapsed = time.monotonic() - self._since
        return (
            f"generation paused by POST /engine/pause {elapsed:.0f} s ago; POST /engine/continue "
            f"resumes it, or the service itself {max(0.0, self.max_seconds - elapsed):.0f} s from now"
        )

    def started(self) -> None:
        self._cancel_timer()
        self._since = time.monotonic()
        self._timer = asyncio.create_task(self._resume_at_limit(), name="engine pause limit")

    def ended(self) -> None:
        self._cancel_timer()
        self._since = None

    async def _resume_at_limit(self) -> None:
        await asyncio.sleep(self.max_seconds)

        async def resume() -> dict[str, str | None]:
            return await self._resume()

        retrying = AsyncRetrying(  # until every worker took it
            wait=backoff(RESUME_RETRY_SECONDS, RESUME_RETRY_MAX_SECONDS),
            retry=retry_if_result(lambda outcome: bool(_failed(outcome))),
            before_sleep=self._resume_failed,
        )
        outcome: dict[str, str | None] = await retrying(resume)
        logger.warning(
            "generation stayed paused %g s (MAX_PAUSE_SECONDS) without POST /engine/continue: "
            "resumed it on %d workers",
            self.max_seconds,
            len(outcome),
        )
        self._since, self._timer = None, None

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

    async def aclose(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            await asyncio.wait([timer])
