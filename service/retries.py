"""The one backoff every retry of the service waits by (tenacity's strategies): exponential, and
jittered so that the thousands of episodes an outage hits at once do not retry in lockstep; and
`first_then_retrying`, how a retried call on a hot path builds its retrying object only once its
first try failed."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, wait_exponential, wait_random_exponential
from tenacity.wait import wait_base

T = TypeVar("T")


def backoff(first_seconds: float, max_seconds: float) -> wait_base:
    """`first_seconds` before the first retry, doubling up to `max_seconds`; each delay is drawn
    from the upper half of that ("equal jitter"): spread out, yet never sooner than half of it."""
    half, half_max = first_seconds / 2, max_seconds / 2
    return wait_exponential(multiplier=half, max=half_max) + wait_random_exponential(
        multiplier=half, max=half_max
    )


def failed_attempt(state: RetryCallState) -> tuple[BaseException, float]:
    """In a `before_sleep` hook of a retry on exceptions: the exception the attempt raised, and the
    seconds until the next attempt."""
    error = state.outcome.exception() if state.outcome is not None else None
    assert error is not None, "a retry on exceptions sleeps after one only"
    return error, next_delay(state)


def next_delay(state: RetryCallState) -> float:
    """In a `before_sleep` hook: the seconds until the next attempt."""
    return state.next_action.sleep if state.next_action is not None else 0.0


async def first_then_retrying(call: Callable[[], Awaitable[T]], retrying: Callable[[], AsyncRetrying]) -> T:
    """`call()`, retried as the AsyncRetrying that `retrying()` builds says (which errors, the
    waits, when to stop, its hooks), built only if the first try raised: the first failure is its
    first attempt, so it counts towards the stop, is judged by the retry predicate, and goes
    through `before_sleep` and the wait like any other.

    Built for every call, a retrying object was a measured share of CPU on the hot paths that
    use this (9% of the service's CPU per env call of a remote env's placement, 0.6% of agent-
    driven episodes' finishes; py-spy), and garbage in reference cycles that held what its
    closures held until a full collection (an episode's claim: the soak's RSS grew)."""
    try:
        return await call()
    except Exception as error:
        first_failure: Exception | None = error
    async for trying in retrying():
        with trying:
            if first_failure is not None:
                failure, first_failure = first_failure, None
                raise failure
            return await call()
    raise AssertionError("unreachable: the retrying returns the call's result or raises")
