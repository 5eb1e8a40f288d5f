"""One episode's environment, pinned to one env worker for its lifetime; `EnvHost.open` makes it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from service.envs import child
from service.envs.base import Action, Reset, Step
from service.envs.errors import EnvCallTimeout, EnvHostClosed, EnvHostError, EnvWorkerCrashed
from service.envs.executors import EnvWorker, ignore_outcome

T = TypeVar("T")

CLOSE_WAIT_SECONDS = 2.0  # how long closing a session waits for its worker before moving on


class EnvCalls(Protocol):
    """What a session needs of its host (EnvHost): calls into a worker, awaited with the call timeout."""

    @property
    def call_timeout_seconds(self) -> float: ...

    def submit(self, worker: EnvWorker, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Starts `fn(*args)` (a function of `service.envs.child`) in the worker; EnvHostClosed once
        the host is closed."""

    async def outcome(self, call: asyncio.Future[T], what: str) -> T:
        """Awaits a call; past the call timeout raises EnvCallTimeout and leaves the call running."""


class EnvWorkerSession:
    """One episode's environment, living in one env worker: what EnvHost.open gives the runner as
    its EnvSession (loop/runner.py). Its calls run one at a time, in order."""

    system_prompt: str
    tools: list[dict[str, Any]]
    pid: int | None  # the worker process, or None with the thread executor

    def __init__(self, host: EnvCalls, worker: EnvWorker, key: str, episode_key: str) -> None:
        self._host = host
        self._worker = worker
        self._key = key
        self.episode_key = episode_key
        self._released = False
        self._turn = asyncio.Lock()
        self._running: asyncio.Future[Any] | None = None  # the env's latest call
        self._stuck: str | None = None  # why the session was abandoned: a call that never returned
        self.system_prompt = ""
        self.tools = []
        self.pid = None
        worker.sessions += 1

    @property
    def worker_name(self) -> str:
        return self._worker.name

    async def reset(self, task_index: int) -> Reset:
        return await self._call("reset", child.reset_env, self._key, task_index)

    async def step(self, action: Action) -> Step:
        return await self._call(f"step {action.name!r}", child.step_env, self._key, action)

    async def _call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        self._check_open()
        async with self._turn:
            self._check_open()
            running = self._running
            if running is not None and not running.done():
                # Its caller was cancelled but the env is still in that call: one call at a time.
                await asyncio.wait({running}, timeout=self._host.call_timeout_seconds)
                if not running.done():
                    self._stuck = f"an earlier call of episode {self.episode_key!r} never returned"
                    self._check_open()
            self._running = call = self._host.submit(self._worker, fn, *args)
            try:
                return await self._host.outcome(call, f"{what} of episode {self.episode_key!r}")
            except EnvCallTimeout as error:
                self._stuck = str(error)  # the env may be in any state, and busy
                raise

    async def close(self) -> None:
        """Drops the environment in its worker. Idempotent; a no-op if the worker died."""
        if self._released:
            return
        self.release()
        try:
            closing = self._host.submit(self._worker, child.close_env, self._key)
        except (EnvWorkerCrashed, EnvHostClosed):
            return
        closing.add_done_callback(ignore_outcome)  # whether or not it is awaited below
        if self._stuck is not None:
            return  # the worker's threads may all be stuck
        # A close must neither fail an episode whose result is ready nor hold up a shutdown: it
        # waits briefly for the worker (its threads may be busy with other episodes), then lets
        # the close finish on its own.
        try:
            async with asyncio.timeout(CLOSE_WAIT_SECONDS):
                await asyncio.shield(closing)
        except (TimeoutError, EnvHostError):
            pass

    def release(self) -> None:
        """Unpins the session from its worker (the host calls it when the open failed)."""
        if not self._released:
            self._released = True
            self._worker.sessions -= 1

    def _check_open(self) -> None:
        if self._released:
            raise EnvHostError(f"the env session of episode {self.episode_key!r} is closed")
        if self._stuck is not None:
            raise EnvCallTimeout(f"the env session is abandoned: {self._stuck}")
