"""What each client call asks of the service, written once for both clients.

A call is a plan: a generator that yields what to do next (an HTTP request, or a pause before a
retry) and receives the outcome (an httpx.Response, or the transport error the request raised). The
synchronous and the asynchronous client each drive plans with their own I/O (client.py), so the
retries, the long-poll loop and the parsing are the same code in both.
"""

from __future__ import annotations

import operator
import random
import re
import time
import uuid
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

import httpx

from rollout_client.batch import Batch, EpisodeArrays, read_table
from rollout_client.errors import RequestError, ServiceUnavailable, WaitTimeout

T = TypeVar("T")
ARROW_STREAM = "application/vnd.apache.arrow.stream"
# Arrow's IPC end-of-stream marker. pyarrow reads a stream cut short at a message boundary (the
# service failing mid-pull) as a shorter table without complaint: only the marker tells them apart.
ARROW_STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"
RETRY_STATUSES = frozenset({408, 429})  # and every 5xx
MAX_DOUBLINGS = 32  # of the backoff: enough to reach any max_backoff, and 2**n stays a float


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


class SubmitFields(TypedDict, total=False):
    """POST /episodes' optional fields; one left out takes the service's default."""

    samples_per_task: int
    task_split: str | None
    sampling_params: dict[str, Any] | None
    max_turns: int | None
    max_response_tokens: int | None
    metadata: dict[str, Any] | None
    batch_id: str | None  # generated when absent


@dataclass(frozen=True)
class Retries:
    """Connection errors, timeouts, 5xx, 408 and 429 are tried again `count` times, after
    `backoff` * 2**n seconds (at most `max_backoff`, with jitter)."""

    count: int = 8
    backoff: float = 0.5
    max_backoff: float = 10.0

    def delay(self, attempt: int) -> float:
        doubled = self.backoff * 2 ** min(attempt, MAX_DOUBLINGS)
        return float(min(doubled, self.max_backoff) * random.uniform(0.8, 1.2))


def _message(response: httpx.Response) -> tuple[str, Any]:
    """The service's error message ({"detail": ...}), else the body's text."""
    try:
        body = response.json()
    except ValueError:
        return response.text, None
    detail = body.get("detail") if isinstance(body, dict) else None
    return (str(detail) if detail is not None else response.text), body


def _failure(outcome: Outcome | None, complete: Callable[[httpx.Response], bool] | None = None) -> str | None:
    """What went wrong, if it is worth another try: a transport error, a 5xx, 408 or 429, or a body
    that `complete` finds cut short. None: a usable answer. A 4xx raises RequestError."""
    if isinstance(outcome, httpx.TransportError):
        return f"{type(outcome).__name__}: {outcome}"
    assert outcome is not None
    if outcome.status_code >= 500 or outcome.status_code in RETRY_STATUSES:
        return f"HTTP {outcome.status_code}: {_message(outcome)[0]}"
    if outcome.status_code >= 400:
        message, body = _message(outcome)
        raise RequestError(outcome.status_code, message, body)
    if complete is not None and not complete(outcome):
        return f"the body of {len(outcome.content)} bytes was cut short"
    return None


def request(
    call: Call, retries: Retries, complete: Callable[[httpx.Response], bool] | None = None
) -> Plan[httpx.Response]:
    """The call, tried until it gets an answer that is not a server-side failure."""
    problem = ""
    for attempt in range(retries.count + 1):
        if attempt:
            yield Pause(retries.delay(attempt - 1))
        outcome = yield call
        failure = _failure(outcome, complete)
        if failure is None:
            assert isinstance(outcome, httpx.Response)
            return outcome
        problem = failure
    raise ServiceUnavailable(f"{call.method} {call.path} failed {retries.count + 1} times; last: {problem}")


def json_of(call: Call, retries: Retries) -> Plan[Any]:
    response = yield from request(call, retries)
    return response.json()


def batch_id(*parts: object, prefix: str = "") -> str:
    """A batch id from its parts, within the service's alphabet ([A-Za-z0-9._:-], 128 characters),
    starting with `prefix`: a project key's (GET /access), outside which the service refuses it."""
    return (prefix + re.sub(r"[^A-Za-z0-9._:-]", "_", "-".join(str(part) for part in parts)))[:128]


@dataclass(frozen=True)
class Access:
    """What the client's key opens (GET /access): every batch (an admin), or one project's, whose
    batch ids start with `batch_prefix`."""

    admin: bool
    project: str | None
    batch_prefix: str


def access(retries: Retries) -> Plan[Access]:
    """GET /access; a service that predates it (404) has no scoped keys: an admin's."""
    try:
        answer = yield from json_of(Call("GET", "/access"), retries)
    except RequestError as error:
        if error.status_code != 404:
            raise
        return Access(admin=True, project=None, batch_prefix="")
    return Access(admin=answer["admin"], project=answer["project"], batch_prefix=answer["batch_prefix"])


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
    batch_prefix: str = "",
) -> Plan[Submission]:
    """POST /episodes under a batch id fixed before the first try: a retry after a lost answer
    gets the same episodes back, never a second copy. A generated id starts with `batch_prefix`
    (a project key's: GET /access)."""
    optional = {
        "task_split": task_split,
        "sampling_params": sampling_params,
        "max_turns": max_turns,
        "max_response_tokens": max_response_tokens,
        "metadata": metadata,
    }
    body = {
        "batch_id": batch_id or f"{batch_prefix}b-{uuid.uuid4().hex}",
        "env": env,
        # operator.index: numpy integers (a trainer's usual) become JSON numbers; floats are refused.
        "task_indices": [operator.index(task) for task in task_indices],
        "samples_per_task": samples_per_task,
        **{name: value for name, value in optional.items() if value is not None},
    }
    answer = yield from json_of(Call("POST", "/episodes", json=body), retries)
    return Submission(answer["batch_id"], answer["episode_ids"], answer["created"])


def _long_poll(path: str, wait: float, timeout: float) -> Call:
    # The request outlasts the long-poll by `timeout`: the service answers when `wait` ends.
    return Call("GET", path, params={"wait": wait} if wait else None, timeout=wait + timeout)


def summary(retries: Retries, batch_id: str, wait: float, timeout: float) -> Plan[dict[str, Any]]:
    answer: dict[str, Any] = yield from json_of(_long_poll(f"/batches/{batch_id}", wait, timeout), retries)
    return answer


def wait(
    retries: Retries, batch_id: str, timeout: float | None, poll: float, request_timeout: float
) -> Plan[dict[str, Any]]:
    """Long-polls the batch until it is complete (every episode has a final status). A service that
    stops answering (restarting, its database down) is asked again with backoff, as long as
    `timeout` allows (None: forever), so `retries` does not bound it: only a 4xx ends the wait
    early. No poll or pause runs past the deadline."""
    deadline = None if timeout is None else time.monotonic() + timeout
    failures, problem = 0, ""
    while True:
        remaining = poll if deadline is None else min(poll, deadline - time.monotonic())
        if remaining <= 0:
            last = f"; last: {problem}" if problem else ""
            raise WaitTimeout(f"batch {batch_id} not complete after {timeout} s{last}")
        outcome = yield _long_poll(f"/batches/{batch_id}", remaining, request_timeout)
        failure = _failure(outcome)
        if failure is None:
            assert isinstance(outcome, httpx.Response)
            answer: dict[str, Any] = outcome.json()
            if answer["complete"]:
                return answer
            failures, problem = 0, ""
            continue
        pause = retries.delay(failures)
        failures, problem = failures + 1, failure
        if deadline is not None:
            pause = min(pause, deadline - time.monotonic())
        if pause > 0:
            yield Pause(pause)


def batch_table(retries: Retries, batch_id: str, timeout: float) -> Plan[Any]:
    call = Call("GET", f"/batches/{batch_id}", headers={"Accept": ARROW_STREAM}, timeout=timeout)
    response = yield from request(call, retries, complete=_whole_arrow_stream)
    return read_table(response.content)


def _whole_arrow_stream(response: httpx.Response) -> bool:
    return response.content.endswith(ARROW_STREAM_END)


def batch(retries: Retries, batch_id: str, timeout: float, include_cancelled: bool = False) -> Plan[Batch]:
    table = yield from batch_table(retries, batch_id, timeout)
    return Batch(table) if include_cancelled else Batch(table).without_cancelled_groups()


class GroupFilters(TypedDict, total=False):
    """GET /groups' filters; one left out (or None) filters nothing. `batch_id` takes one id or a
    sequence of them (the groups of any of those batches)."""

    batch_id: str | Sequence[str] | None
    env: str | None
    min_reward_std: float | None


@dataclass(frozen=True)
class GroupsPage:
    """A page of GET /groups: its complete groups' episodes (group by group, in the order they
    completed), the cursor for the next page, and how many groups `min_reward_std` skipped."""

    batch: Batch
    next: int
    filtered: int

    def groups(self) -> dict[tuple[str, int], list[EpisodeArrays]]:
        """Episodes by (batch id, group index), in the order the groups completed, by sample."""
        groups: dict[tuple[str, int], list[EpisodeArrays]] = {}
        for episode in self.batch:
            groups.setdefault((episode.batch_id, episode.group_index), []).append(episode)
        return groups


def groups(
    retries: Retries,
    after: int,
    limit: int,
    wait: float,
    timeout: float,
    filters: GroupFilters,
    include_cancelled: bool = False,
) -> Plan[GroupsPage]:
    params: dict[str, Any] = {"after": after, "limit": limit}
    params.update((name, value) for name, value in filters.items() if value is not None)
    if wait:
        params["wait"] = wait
    call = Call("GET", "/groups", params=params, headers={"Accept": ARROW_STREAM}, timeout=wait + timeout)
    response = yield from request(call, retries, complete=_whole_arrow_stream)
    batch = Batch(read_table(response.content))
    return GroupsPage(
        batch if include_cancelled else batch.without_cancelled_groups(),
        int(response.headers["Rollout-Next-Cursor"]),
        int(response.headers["Rollout-Groups-Filtered"]),
    )


def episode(retries: Retries, episode_id: str, wait: float, timeout: float) -> Plan[dict[str, Any]]:
    answer: dict[str, Any] = yield from json_of(_long_poll(f"/episodes/{episode_id}", wait, timeout), retries)
    return answer
