"""Whether the engine answers, as this process last saw it: the worker stops claiming episodes while
it does not (an outage is waited out, not charged to the episodes' attempts), and a batch's page
says its episodes are waiting for it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

logger = logging.getLogger(__name__)

# An answer of these statuses is a router or proxy with no engine behind it: the engine is down.
ENGINE_DOWN_STATUSES = frozenset({502, 503, 504})
PROBE_SECONDS = 2.0  # while the engine is down, it is asked again at most this often
UP_PROBE_SECONDS = 10.0  # while it answers, a page asks again at most this often (no generate calls)
PROBE_TIMEOUT_SECONDS = 3.0


class EngineStatus:
    """What this process last saw of its engine: every generate call's outcome and, between them,
    a probe (`check`) of its /health. One probe at a time, however many callers ask."""

    def __init__(self, url: str, probe: Callable[[], Awaitable[str | None]]) -> None:
        self.url = url
        self._probe = probe  # None: it answers; else why not
        self.error: str | None = None
        self.down_since: datetime | None = None
        self.checked: float | None = None  # time.monotonic() of the last outcome seen
        self._probing: asyncio.Task[None] | None = None

    @property
    def down(self) -> bool:
        return self.error is not None

    def answered(self) -> None:
        self.checked = time.monotonic()
        if self.error is not None:
            logger.info("the engine at %s answers again (it did not for %s)", self.url, self._outage())
            self.error, self.down_since = None, None

    def unreachable(self, reason: str) -> None:
        self.checked = time.monotonic()
        if self.error is None:
            self.down_since = datetime.now(UTC)
            logger.warning(
                "the engine at %s does not answer (%s): episodes wait for it (SGLANG_URL); an outage "
                "costs them no attempt",
                self.url,
                reason,
            )
        self.error = reason

    def _outage(self) -> str:
        if self.down_since is None:
            return "a moment"
        return f"{(datetime.now(UTC) - self.down_since).total_seconds():.0f} s"

    def waiting(self) -> str | None:
        """One line for people: why episodes are waiting, or None while the engine answers."""
        if self.error is None:
            return None
        since = self.down_since.strftime("%H:%M:%S UTC") if self.down_since is not None else "now"
        return (
            f"episodes are waiting for the engine at {self.url}: it does not answer ({self.error}) "
            f"since {since}"
        )

    async def check(self) -> str | None:
        """`waiting()`, after asking the engine if the last outcome is older than PROBE_SECONDS
        (while it is down) or UP_PROBE_SECONDS (while it answers)."""
        age = PROBE_SECONDS if self.down else UP_PROBE_SECONDS
        if self.checked is None or time.monotonic() - self.checked >= age:
            if self._probing is None or self._probing.done():
                self._probing = asyncio.ensure_future(self._ask())
            await asyncio.shield(self._probing)
        return self.waiting()

    async def _ask(self) -> None:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_SECONDS):
                problem = await self._probe()
        except TimeoutError:
            problem = f"no answer to GET /health within {PROBE_TIMEOUT_SECONDS:g} s"
        if problem is None:
            self.answered()
        else:
            self.unreachable(problem)
