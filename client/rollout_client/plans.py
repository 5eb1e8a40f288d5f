"""What each client call asks of the service, written once for both clients.

A call is a plan: a generator that yields what to do next (an HTTP request, or a pause before a
retry) and receives the outcome (an httpx.Response, or the transport error the request raised). The
synchronous and the asynchronous client each drive plans with their own I/O (client.py), so the
retries, the long-poll loop and the parsing are the same code in both.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from rollout_client.batch import Batch, read_table
from rollout_client.errors import RequestError, ServiceUnavailable, WaitTimeout

T = TypeVar("T")
ARROW_STREAM = "application/vnd.apache.arrow.stream"
RETRY_STATUSES = frozenset({408, 429})  # and every 5xx


@dataclass(frozen=True)
class Call:
    """One HTTP request; `timeout` None is the client's default."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = None
    headers: dict[str, str] | None = None
    timeout: float | None = None


@dataclass(frozen=True)
class Pause:
    seconds: float


Outcome = httpx.Response | httpx.TransportError
Plan = Generator[Call | Pause, Outcome | None, T]


@dataclass(frozen=True)
class Submission:
    batch_id: str
    episode_ids: list[str]  # by task (group), then sample
    created: bool  # False: the service had this batch already (a retried or repeated submit)


@dataclass(frozen=True)
class Retries:
    """Connection errors, timeouts, 5xx, 408 and 429 are tried again `count` times, after
    `backoff` * 2**n seconds (at most `max_backoff`, with jitter)."""

    count: int = 8
    backoff: float = 0.5
    max_backoff: float = 10.0

    def delay(self, attempt: int) -> float:
        return float(min(self.backoff * 2**attempt, self.max_backoff) * random.uniform(0.8, 1.2))


def _message(response: httpx.Response) -> tuple[str, Any]:
    """The service's error message ({"detail": ...}), else the body's text."""
    try:
        body = response.json()
    except ValueError:
        return response.text, None
    detail = body.get("detail") if isinstance(body, dict) else None
    return (str(detail) if detail is not None else response.text), body


def request(call: Call, retries: Retries) -> Plan[httpx.Response]:
    """The call, tried until it gets an answer that is not a server-side failure."""
    problem = ""
    for attempt in range(retries.count + 1):
        if attempt:
            yield Pause(retries.delay(attempt - 1))
        outcome = yield call
        if isinstance(outcome, httpx.TransportError):
            problem = f"{type(outcome).__name__}: {outcome}"
            continue
        assert outcome is not None
        if outcome.status_code >= 500 or outcome.status_code in RETRY_STATUSES:
            problem = f"HTTP {outcome.status_code}: {_message(outcome)[0]}"
            continue
        if outcome.status_code >= 400:
            message, body = _message(outcome)
            raise RequestError(outcome.status_code, message, body)
        return outcome
    raise ServiceUnavailable(f"{call.method} {call.path} failed {retries.count + 1} times; last: {problem}")


def json_of(call: Call, retries: Retries) -> Plan[Any]:
    response = yield from request(call, retries)
    return response.json()


def submit(
    retries: Retries,
    env: str,
    task_indices: Sequence[int],
    *,
    samples_per_task: int = 1,
    task_split: str | None = None,
    sampling_params: dict[str, Any] | None = None,
    max_turns: int | None = None,
    max_response_tokens: int | None = None,
    metadata: dict[str, Any] | None = None,
    batch_id: str | None = None,
) -> Plan[Submission]:
    """POST /episodes under a batch id fixed before the first try: a retry after a lost answer
    gets the same episodes back, never a second copy."""
    optional = {
        "task_split": task_split,
        "sampling_params": sampling_params,
        "max_turns": max_turns,
        "max_response_tokens": max_response_tokens,
        "metadata": metadata,
    }
    body = {
        "batch_id": batch_id or f"b-{uuid.uuid4().hex}",
        "env": env,
        "task_indices": list(task_indices),
        "samples_per_task": samples_per_task,
        **{name: value for name, value in optional.items() if value is not None},
    }
    answer = yield from json_of(Call("POST", "/episodes", json=body), retries)
    return Submission(answer["batch_id"], answer["episode_ids"], answer["created"])


def summary(retries: Retries, batch_id: str, wait: float, timeout: float) -> Plan[dict[str, Any]]:
    call = Call(
        "GET", f"/batches/{batch_id}", params={"wait": wait} if wait else None, timeout=wait + timeout
    )
    answer: dict[str, Any] = yield from json_of(call, retries)
    return answer


def wait(
    retries: Retries, batch_id: str, timeout: float | None, poll: float, request_timeout: float
) -> Plan[dict[str, Any]]:
    """Long-polls the batch until it is complete. A service that stops answering (restarting, its
    database down) is asked again until `timeout`: only a 4xx ends the wait early."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        remaining = poll if deadline is None else min(poll, deadline - time.monotonic())
        if remaining <= 0:
            raise WaitTimeout(f"batch {batch_id} not complete after {timeout} s")
        try:
            answer = yield from summary(retries, batch_id, remaining, request_timeout)
        except ServiceUnavailable:
            continue
        if answer["complete"]:
            return answer


def batch_table(retries: Retries, batch_id: str, timeout: float) -> Plan[Any]:
    call = Call("GET", f"/batches/{batch_id}", headers={"Accept": ARROW_STREAM}, timeout=timeout)
    response = yield from request(call, retries)
    return read_table(response.content)


def batch(retries: Retries, batch_id: str, timeout: float) -> Plan[Batch]:
    table = yield from batch_table(retries, batch_id, timeout)
    return Batch(table)


def episode(retries: Retries, episode_id: str, wait: float, timeout: float) -> Plan[dict[str, Any]]:
    call = Call(
        "GET", f"/episodes/{episode_id}", params={"wait": wait} if wait else None, timeout=wait + timeout
    )
    answer: dict[str, Any] = yield from json_of(call, retries)
    return answer
