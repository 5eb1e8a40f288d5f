"""The one backoff every retry of the service waits by (tenacity's strategies): exponential, and
jittered so that the thousands of episodes an outage hits at once do not retry in lockstep."""

from __future__ import annotations

from tenacity import RetryCallState, wait_exponential, wait_random_exponential
from tenacity.wait import wait_base


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
