"""The one backoff of the service's retries: exponential, capped, and jittered so that many callers
failing at once spread out."""

from __future__ import annotations

from tenacity import RetryCallState

from service.retries import backoff


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
