"""RolloutClient and AsyncRolloutClient: the service's API for a training job.

Both run the same plans (plans.py), one with httpx.Client and time.sleep, the other with
httpx.AsyncClient and asyncio.sleep: a method is one line in each.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Generic, TypedDict, TypeVar, Unpack

import httpx
import pyarrow as pa

from rollout_client import plans
from rollout_client.batch import Batch
from rollout_client.plans import (
    Access,
    Call,
    GroupFilters,
    GroupsPage,
    Outcome,
    Pause,
    Plan,
    Retries,
    Submission,
    SubmitFields,
)

T = TypeVar("T")


class Options(TypedDict, total=False):
    timeout: float  # seconds per request, beyond a long-poll's wait (default 60)
    retries: int  # tries after the first, for connection errors, 5xx, 408, 429 (default 8)
    backoff: float  # first pause between tries, doubling (default 0.5 s)
    max_backoff: float  # longest pause (default 10 s)


_SCOPES: dict[tuple[str, str | None], Access] = {}  # (service URL, key) -> what the key opens


@cache
def _ssl_context() -> ssl.SSLContext:
    """httpx's default context (certifi's CAs, SSL_CERT_FILE/SSL_CERT_DIR as the process started),
    built once: loading the CAs takes tens of milliseconds, and a trainer adapter opens a client
    per step."""
    return httpx.create_ssl_context()


@dataclass
class _Done(Generic[T]):
    value: T


class _Api:
    """What both clients share: where the service is, how to authenticate, how long to wait, how
    often to retry, the plan of each call, and how a plan moves on."""

    def __init__(self, url: str, api_key: str | None, options: Options) -> None:
        if httpx.URL(url).scheme not in ("http", "https"):
            # Else every call would retry httpx's UnsupportedProtocol (a TransportError) in vain.
            raise ValueError(f"the service's URL must be http:// or https://, not {url!r}")
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = options.get("timeout", 60.0)
        self.retries = Retries(
            options.get("retries", 8), options.get("backoff", 0.5), options.get("max_backoff", 10.0)
        )
        self.key = api_key

    @staticmethod
    def advance(plan: Plan[T], outcome: Outcome | None) -> Call | Pause | _Done[T]:
        """The plan's next step, given the outcome of the last (None: a pause, or the start)."""
        try:
            return plan.send(outcome)  # a plan not started yet takes None as next() would
        except StopIteration as done:
            return _Done(done.value)

    def http_options(self) -> dict[str, Any]:
        # Long-polls hold a connection each: no pool limit makes concurrent waits queue behind them.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        return {"timeout": self.timeout, "limits": limits, "verify": _ssl_context()}

    def request_options(self, call: Call) -> dict[str, Any]:
        # The URL and the key go with each request, not into the httpx client: one passed in as
        # `http` needs neither a base_url nor the key.
        return {
            "method": call.method,
            "url": self.url + call.path,
            "params": call.params,
            "json": call.json,
            "headers": {**self.headers, **(call.headers or {})},
            "timeout": call.timeout if call.timeout is not None else self.timeout,
        }

    # The plan of each call of the API.

    def envs(self) -> Plan[Any]:
        return plans.json_of(Call("GET", "/envs"), self.retries)

    def access(self) -> Plan[Access]:
        """The key's scope, asked once per process and service (clients made per step or group
        share it): a key's scope changes only with the service's configuration."""
        scope = _SCOPES.get((self.url, self.key))
        if scope is None:
            scope = _SCOPES[self.url, self.key] = yield from plans.access(self.retries)
        return scope

    def batch_id(self, *parts: object) -> Plan[str]:
        prefix = (yield from self.access()).batch_prefix
        return plans.batch_id(*parts, prefix=prefix)

    def submit(self, env: str, task_indices: Sequence[int], fields: SubmitFields) -> Plan[Submission]:
        if fields.get("batch_id") is None:  # generated here: in the key's scope
            prefix = (yield from self.access()).batch_prefix
            return (yield from plans.submit(self.retries, env, task_indices, **fields, batch_prefix=prefix))
        return (yield from plans.submit(self.retries, env, task_indices, **fields))

    def wait(self, batch_id: str, timeout: float | None, poll: float) -> Plan[dict[str, Any]]:
        return plans.wait(self.retries, batch_id, timeout, poll, self.timeout)

    def summary(self, batch_id: str, wait: float) -> Plan[dict[str, Any]]:
        return plans.summary(self.retries, batch_id, wait, self.timeout)

    def batch(self, batch_id: str, include_cancelled: bool) -> Plan[Batch]:
        return plans.batch(self.retries, batch_id, self.timeout, include_cancelled)

    def batch_table(self, batch_id: str) -> Plan[pa.Table]:
        return plans.batch_table(self.retries, batch_id, self.timeout)

    def groups(
        self, after: int, limit: int, wait: float, filters: GroupFilters, include_cancelled: bool
    ) -> Plan[GroupsPage]:
        return plans.groups(self.retries, after, limit, wait, self.timeout, filters, include_cancelled)

    def episode(self, episode_id: str, wait: float) -> Plan[dict[str, Any]]:
        return plans.episode(self.retries, episode_id, wait, self.timeout)

    def cancel(self, batch_id: str) -> Plan[Any]:
        return plans.json_of(Call("POST", f"/batches/{batch_id}/cancel"), self.retries)


class RolloutClient:
    """The service's API, blocking. `RolloutClient(url, api_key)`; use it in a `with` block or
    close() it. Every call retries connection errors and 5xx; a 4xx raises RequestError."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        http: httpx.Client | None = None,
        **options: Unpack[Options],
    ) -> None:
        self._api = _Api(url, api_key, options)
        self._http = http or httpx.Client(**self._api.http_options())

    def _run(self, plan: Plan[T]) -> T:
        step = self._api.advance(plan, None)
        while not isinstance(step, _Done):
            step = self._api.advance(plan, self._outcome(step))
        return step.value

    def _outcome(self, step: Call | Pause) -> Outcome | None:
        if isinstance(step, Pause):
            time.sleep(step.seconds)
            return None
        try:
            return self._http.request(**self._api.request_options(step))
        except httpx.TransportError as error:
            return error

    def envs(self) -> list[dict[str, Any]]:
        """GET /envs: the environments, their splits and sizes."""
        return self._run(self._api.envs())

    def access(self) -> Access:
        """GET /access (asked once): what the key opens; a project key's batch ids start with its
        `batch_prefix`."""
        return self._run(self._api.access())

    def batch_id(self, *parts: object) -> str:
        """A batch id from its parts (steps.batch_id), in the key's scope: its project's prefix first."""
        return self._run(self._api.batch_id(*parts))

    def submit(self, env: str, task_indices: Sequence[int], **fields: Unpack[SubmitFields]) -> Submission:
        """POST /episodes: `samples_per_task`, `task_split`, `sampling_params`, `max_turns`,
        `max_response_tokens`, `metadata`, `batch_id` (generated when absent) as keywords; a
        field left out (or None) takes the service's default. `task_split` is required unless the
        env declares its training split (`train_split` in envs())."""
        return self._run(self._api.submit(env, task_indices, fields))

    def wait(self, batch_id: str, timeout: float | None = None, *, poll: float = 30.0) -> dict[str, Any]:
        """Long-polls until the batch is complete; returns its summary. Raises WaitTimeout."""
        return self._run(self._api.wait(batch_id, timeout, poll))

    def summary(self, batch_id: str, wait: float = 0) -> dict[str, Any]:
        """GET /batches/{id}: counts and the complete groups' episodes, without tokens."""
        return self._run(self._api.summary(batch_id, wait))

    def batch(self, batch_id: str, *, include_cancelled: bool = False) -> Batch:
        """The complete groups' episodes with their token arrays (the Arrow stream, decoded). A
        group with a `cancelled` episode (its batch was cancelled) is left out unless
        `include_cancelled`; each episode's `trainable` says whether to train on it."""
        return self._run(self._api.batch(batch_id, include_cancelled))

    def batch_table(self, batch_id: str) -> pa.Table:
        return self._run(self._api.batch_table(batch_id))

    def groups(
        self,
        after: int = 0,
        limit: int = 100,
        wait: float = 0,
        *,
        include_cancelled: bool = False,
        **filters: Unpack[GroupFilters],
    ) -> GroupsPage:
        """GET /groups: complete groups past the cursor `after`, in the order they completed, as
        Arrow; `page.next` is the cursor for the next call. `wait` long-polls for a group; the
        filters `batch_id`, `env`, `min_reward_std` (0 skips groups whose rewards are all equal,
        counted in `page.filtered`) are keywords. Groups of a cancelled batch (with a `cancelled`
        episode) are left out unless `include_cancelled`."""
        return self._run(self._api.groups(after, limit, wait, filters, include_cancelled))

    def episode(self, episode_id: str, wait: float = 0) -> dict[str, Any]:
        """GET /episodes/{id}; `wait` long-polls until it finished."""
        return self._run(self._api.episode(episode_id, wait))

    def cancel(self, batch_id: str) -> dict[str, Any]:
        """POST /batches/{id}/cancel: its unfinished episodes end cancelled. Idempotent."""
        return self._run(self._api.cancel(batch_id))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncRolloutClient:
    """RolloutClient's API for asyncio: the same methods, awaited; `async with` or close()."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        http: httpx.AsyncClient | None = None,
        **options: Unpack[Options],
    ) -> None:
        self._api = _Api(url, api_key, options)
        self._http = http or httpx.AsyncClient(**self._api.http_options())

    async def _run(self, plan: Plan[T]) -> T:
        step = self._api.advance(plan, None)
        while not isinstance(step, _Done):
            step = self._api.advance(plan, await self._outcome(step))
        return step.value

    async def _outcome(self, step: Call | Pause) -> Outcome | None:
        if isinstance(step, Pause):
            await asyncio.sleep(step.seconds)
            return None
        try:
            return await self._http.request(**self._api.request_options(step))
        except httpx.TransportError as error:
            return error

    async def envs(self) -> list[dict[str, Any]]:
        return await self._run(self._api.envs())

    async def access(self) -> Access:
        return await self._run(self._api.access())

    async def batch_id(self, *parts: object) -> str:
        return await self._run(self._api.batch_id(*parts))

    async def submit(
        self, env: str, task_indices: Sequence[int], **fields: Unpack[SubmitFields]
    ) -> Submission:
        return await self._run(self._api.submit(env, task_indices, fields))

    async def wait(
        self, batch_id: str, timeout: float | None = None, *, poll: float = 30.0
    ) -> dict[str, Any]:
        return await self._run(self._api.wait(batch_id, timeout, poll))

    async def summary(self, batch_id: str, wait: float = 0) -> dict[str, Any]:
        return await self._run(self._api.summary(batch_id, wait))

    async def batch(self, batch_id: str, *, include_cancelled: bool = False) -> Batch:
        return await self._run(self._api.batch(batch_id, include_cancelled))

    async def groups(
        self,
        after: int = 0,
        limit: int = 100,
        wait: float = 0,
        *,
        include_cancelled: bool = False,
        **filters: Unpack[GroupFilters],
    ) -> GroupsPage:
        return await self._run(self._api.groups(after, limit, wait, filters, include_cancelled))

    async def batch_table(self, batch_id: str) -> pa.Table:
        return await self._run(self._api.batch_table(batch_id))

    async def episode(self, episode_id: str, wait: float = 0) -> dict[str, Any]:
        return await self._run(self._api.episode(episode_id, wait))

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        return await self._run(self._api.cancel(batch_id))

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
