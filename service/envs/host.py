"""EnvHost: env workers for the episode runner, and which worker each episode's environment lives in.

Each episode is pinned to one worker for its lifetime (its Environment object lives there) and its
calls run one at a time, in order (see session.py); the workers are executors (see executors.py).
A worker that dies fails only the episodes pinned to it and is replaced for later ones.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from service.call_timeouts import CallTimeouts
from service.envs import child
from service.envs.base import DriveOutcome, DriveRequest, EnvSpec, UserSimConfig
from service.envs.errors import EnvCallTimeout, EnvHostClosed, EnvHostError, EnvNotFound, EnvWorkerCrashed
from service.envs.executors import (
    EXECUTOR_KINDS,
    THREADS_PER_WORKER,
    EnvExecutor,
    EnvThreadPool,
    EnvWorker,
    ExecutorKind,
    WorkerProcess,
    ignore_outcome,
    worker_name,
)
from service.envs.session import EnvWorkerSession

T = TypeVar("T")

CALL_TIMEOUT_SECONDS = 600.0  # one reset/step/open; past it the episode's env is abandoned
SHUTDOWN_GRACE_SECONDS = 10.0  # close() lets running calls finish this long, then kills workers


def _wake(waiter: asyncio.Future[bool], finished: bool) -> None:
    if not waiter.done():
        waiter.set_result(finished)


def _wake_on(waiter: asyncio.Future[bool], call: asyncio.Future[Any]) -> None:
    _wake(waiter, True)


class EnvHost:
    """Env workers for the episode runner: `open()` an EnvWorkerSession per episode, then reset/step it.

    `envs` defaults to `registry.available_envs()`; tests pass their own specs. Worker processes
    start at the first `open` (or `worker_pids`), on the running event loop.
    """

    def __init__(
        self,
        workers: int,
        executor: ExecutorKind = "process",
        user_sim: UserSimConfig = UserSimConfig(),  # noqa: B008  (frozen)
        envs: Mapping[str, EnvSpec] | None = None,
        *,
        threads_per_worker: int = THREADS_PER_WORKER,
        call_timeout_seconds: float = CALL_TIMEOUT_SECONDS,
        shutdown_grace_seconds: float = SHUTDOWN_GRACE_SECONDS,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if executor not in EXECUTOR_KINDS:
            raise ValueError(f"executor must be one of {EXECUTOR_KINDS}, got {executor!r}")
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        if call_timeout_seconds <= 0 or shutdown_grace_seconds < 0:
            raise ValueError("call_timeout_seconds must be > 0 and shutdown_grace_seconds >= 0")
        self.executor_kind = executor
        self.user_sim = user_sim
        self.threads_per_worker = threads_per_worker
        self._timeouts = CallTimeouts(call_timeout_seconds)
        self.shutdown_grace_seconds = shutdown_grace_seconds
        self._envs = envs
        self._size = workers
        self._id = uuid.uuid4().hex[:8]
        self._keys = itertools.count()
        self._generations = itertools.count()
        self._closed = False
        self._thread_pool: EnvThreadPool | None = None
        self._workers: list[EnvWorker] = []

    @property
    def workers(self) -> int:
        return self._size

    @property
    def call_timeout_seconds(self) -> float:
        """How long a call may run (a new length holds for the calls started after it is set)."""
        return self._timeouts.seconds

    @call_timeout_seconds.setter
    def call_timeout_seconds(self, seconds: float) -> None:
        self._timeouts = CallTimeouts(seconds)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- Scheduling. ----

    def _live_workers(self) -> list[EnvWorker]:
        """The workers, started if need be, with dead processes replaced."""
        if self._closed:
            raise EnvHostClosed("the env host is closed")
        if not self._workers:
            self._workers = [self._new_worker(slot) for slot in range(self._size)]
        for slot, worker in enumerate(self._workers):
            if worker.executor.crash is not None:
                self._workers[slot] = self._new_worker(slot)
        return self._workers

    def _new_worker(self, slot: int) -> EnvWorker:
        generation = next(self._generations)
        executor: EnvExecutor
        if self.executor_kind == "process":
            name = worker_name(slot, generation)
            executor = WorkerProcess(name, self.threads_per_worker, asyncio.get_running_loop())
        else:
            if self._thread_pool is None:
                self._thread_pool = EnvThreadPool(self.threads_per_worker * self._size)
            executor = self._thread_pool
        return EnvWorker(slot, generation, executor)

    def _spec(self, env_name: str) -> EnvSpec:
        if self._envs is None:
            from service.envs.registry import available_envs

            self._envs = available_envs()
        spec = self._envs.get(env_name)
        if spec is None:
            raise EnvNotFound(f"unknown environment {env_name!r}; known: {sorted(self._envs)}")
        return spec

    async def open(self, env_name: str, split: str, episode_key: str) -> EnvWorkerSession:
        """Builds the episode's environment in the least-loaded worker, where it stays."""
        spec = self._spec(env_name)
        if split not in spec.splits:
            raise EnvNotFound(
                f"environment {env_name!r} has no split {split!r}; splits: {sorted(spec.splits)}"
            )
        # A worker that died while idle may only be noticed at its next call: if that call is
        # this open, the episode was never there, so it retries once on the replacement.
        for attempt in range(2):
            worker = min(self._live_workers(), key=lambda w: w.sessions)
            key = f"{self._id}:{next(self._keys)}:{episode_key}"
            session = EnvWorkerSession(self, worker, key, episode_key)
            try:
                system_prompt, tools, pid = await self._open_in(worker, key, spec, split, episode_key)
            except EnvWorkerCrashed:
                session.release()
                if attempt == 1:
                    raise
                continue
            except BaseException:
                session.release()
                raise
            session.system_prompt = system_prompt
            session.tools = tools
            session.pid = pid if self.executor_kind == "process" else None
            return session
        raise AssertionError("unreachable")

    def driven(self, env_name: str) -> bool:
        """Whether `env_name` is agent-driven (EnvSpec.driver): its episodes are played by drive()."""
        try:
            return self._spec(env_name).driver is not None
        except EnvNotFound:
            return False

    async def drive(self, env_name: str, request: DriveRequest) -> DriveOutcome:
        """Plays one episode of an agent-driven env in the least-loaded worker, bounded by the call
        timeout (ENV_CALL_TIMEOUT_SECONDS) as any env call."""
        spec = self._spec(env_name)
        assert spec.driver is not None, f"{env_name} is not agent-driven"
        worker = min(self._live_workers(), key=lambda w: w.sessions)
        worker.sessions += 1
        try:
            call = self.submit(worker, child.drive_env, spec.driver, request)
            return await self.outcome(call, f"the driver of {env_name!r} for episode {request.episode_key!r}")
        finally:
            worker.sessions -= 1

    async def _open_in(
        self, worker: EnvWorker, key: str, spec: EnvSpec, split: str, episode_key: str
    ) -> tuple[str, list[dict[str, Any]], int]:
        opened = self.submit(worker, child.open_env, key, spec.factory, split, self.user_sim)
        try:
            return await self.outcome(opened, f"open of {spec.name!r} for episode {episode_key!r}")
        except BaseException:
            # Cancelled or timed out (even as the open finished): the env is built all the same.
            opened.add_done_callback(functools.partial(self._drop_orphan, worker, key))
            raise

    def _drop_orphan(self, worker: EnvWorker, key: str, opened: asyncio.Future[Any]) -> None:
        if opened.cancelled() or opened.exception() is not None or self._closed:
            return
        try:
            self.submit(worker, child.close_env, key).add_done_callback(ignore_outcome)
        except EnvHostError:
            pass  # the worker died, and the env with it

    async def worker_pids(self) -> list[int]:
        """Every worker's process id once it answers (this process's with the thread executor)."""
        probes = [self.submit(w, child.pid) for w in self._live_workers()]
        return list(await asyncio.gather(*(self.outcome(p, "pid probe") for p in probes)))

    async def open_envs(self) -> int:
        """How many environments this host's workers hold: one per open session, unless one leaked."""
        probes = [
            self.submit(w, child.env_count, f"{self._id}:") for w in _one_per_executor(self._live_workers())
        ]
        return sum(await asyncio.gather(*(self.outcome(p, "env count") for p in probes)))

    def calls_in_flight(self) -> int:
        """Calls this host's workers have not answered yet, those nobody awaits included (the build
        of an open its caller gave up on, then the close that drops what it built)."""
        return sum(w.executor.calls for w in _one_per_executor(self._workers))

    # ---- Calls (the API sessions use: session.EnvCalls). ----

    def submit(self, worker: EnvWorker, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Starts `fn(*args)` (a function of `service.envs.child`) in the worker."""
        if self._closed:
            raise EnvHostClosed("the env host is closed")
        return worker.executor.submit(fn, *args)

    async def outcome(self, call: asyncio.Future[T], what: str) -> T:
        """Awaits a call; cancelling the caller or timing out leaves the call itself running.

        Hand-written on a measured hot path (every env call of every turn): a waiter, and the
        timeout one sweep of every call's (CallTimeouts: not a timer per call), instead of
        asyncio.timeout and asyncio.shield, whose Timeout, shielding future and task bookkeeping
        cost as much as the rest of the hand-off."""
        if not call.done():
            waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            timeouts = self._timeouts
            timeouts.add(waiter, functools.partial(_wake, waiter, False))
            wake = functools.partial(_wake_on, waiter)
            call.add_done_callback(wake)
            try:
                finished = await waiter
            except BaseException:  # the caller was cancelled: the call runs on
                call.remove_done_callback(wake)
                call.add_done_callback(ignore_outcome)  # nobody awaits it any more
                raise
            finally:
                timeouts.discard(waiter)
            if not finished and not call.done():
                call.remove_done_callback(wake)
                call.add_done_callback(ignore_outcome)
                raise EnvCallTimeout(f"{what} did not return within {self.call_timeout_seconds:g} s")
        return call.result()  # the call's own outcome (it finished as the timeout fell, too)

    async def close(self) -> None:
        """Shuts every worker down: running calls get `shutdown_grace_seconds` to finish, then
        worker processes are killed (threads are left behind); environments still open are dropped."""
        if self._closed:
            return
        self._closed = True
        workers = _one_per_executor(self._workers)
        await asyncio.gather(*(w.executor.stop(self.shutdown_grace_seconds) for w in workers))


def _one_per_executor(workers: list[EnvWorker]) -> list[EnvWorker]:
    """One worker of each executor (the thread executor's worker slots share one pool)."""
    return list({id(w.executor): w for w in workers}.values())
