"""Bounded waits for tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

POLL_SECONDS = 0.005


async def until(condition: Callable[[], bool], timeout_seconds: float = 5.0) -> None:
    """Waits (bounded) for a condition on a worker that another task or thread changes."""
    for _ in range(int(timeout_seconds / POLL_SECONDS)):
        if condition():
            return
        await asyncio.sleep(POLL_SECONDS)
    raise AssertionError("condition not reached in time")
