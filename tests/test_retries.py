"""The one backoff of the service's retries: exponential, capped, and jittered so that many callers
failing at once spread out; and first_then_retrying, the retried call whose retrying object is
built only once its first try failed."""

from __future__ import annotations

import pytest
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    wait_none,
)

from service.retries import backoff, first_then_retrying


def _delay(first: float, cap: float, attempt: int) -> float:
    state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = attempt
    return float(backoff(first, cap)(state))


def test_delays_double_within_their_upper_half_up_to_the_cap() -> None:
    for attempt in range(1, 12):
        full = min(0.2 * 2 ** (attempt - 1), 2.0)
        delays = [_delay(0.2, 2.0, attempt) for _ in range(200)]
        assert all(full / 2 - 1e-9 <= delay <= full + 1e-9 for delay in delays), (
            attempt,
            min(delays),
            max(delays),
        )


def test_callers_failing_together_do_not_retry_in_lockstep() -> None:
    delays = [_delay(0.5, 30.0, 3) for _ in range(2000)]
    assert len({round(delay, 3) for delay in delays}) > 500
    assert max(delays) - min(delays) > 0.8  # spread over most of [1, 2] s


class Flaky:
    """A call that raises the errors it is given, one per try, then answers "done"."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.tries = 0

    async def __call__(self) -> str:
        self.tries += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


class Retrying:
    """Builds the AsyncRetrying of a test (on ConnectionError, no wait, `attempts` at most) and
    records what it saw: how many were built, and each failure before its sleep."""

    def __init__(self, attempts: int = 3) -> None:
        self.attempts = attempts
        self.built = 0
        self.slept_after: list[tuple[int, BaseException | None]] = []

    def __call__(self) -> AsyncRetrying:
        self.built += 1
        return AsyncRetrying(
            retry=retry_if_exception_type(ConnectionError),
            stop=stop_after_attempt(self.attempts),
            wait=wait_none(),
            before_sleep=self.before_sleep,
        )

    def before_sleep(self, state: RetryCallState) -> None:
        assert state.outcome is not None
        self.slept_after.append((state.attempt_number, state.outcome.exception()))


async def test_a_first_try_that_answers_builds_no_retrying() -> None:
    call, retrying = Flaky(), Retrying()
    assert await first_then_retrying(call, retrying) == "done"
    assert (call.tries, retrying.built) == (1, 0)


async def test_the_first_failure_is_the_retrying_s_first_attempt() -> None:
    """Judged, slept on and counted as tenacity's attempt 1: two failures then an answer fit in
    three attempts."""
    first, second = ConnectionError("first"), ConnectionError("second")
    call, retrying = Flaky(first, second), Retrying(attempts=3)
    assert await first_then_retrying(call, retrying) == "done"
    assert (call.tries, retrying.built) == (3, 1)
    assert retrying.slept_after == [(1, first), (2, second)]


async def test_the_stop_counts_the_first_try() -> None:
    errors = [ConnectionError(str(n)) for n in range(3)]
    call = Flaky(*errors)
    with pytest.raises(RetryError) as raised:
        await first_then_retrying(call, Retrying(attempts=2))
    assert call.tries == 2 and raised.value.last_attempt.exception() is errors[1]


async def test_an_error_the_retrying_does_not_retry_is_raised_as_it_came() -> None:
    refused = ValueError("not transient")
    call = Flaky(refused)
    with pytest.raises(ValueError) as raised:
        await first_then_retrying(call, Retrying())
    assert raised.value is refused and call.tries == 1
