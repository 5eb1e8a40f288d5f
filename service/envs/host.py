"""Runs environments off the event loop: in worker processes (or a thread pool), many calls at once.

tau-bench's reward computation is pure-Python CPU that holds the GIL for 0.3-0.75 s per episode, so
env work is spread over N worker processes; its user simulator blocks for seconds on an HTTP call
inside `step`, so each process runs calls on a pool of threads. Each episode is pinned to one worker
for its lifetime (its Environment object lives there) and its calls run one at a time, in order.
A worker that dies fails only the episodes pinned to it and is replaced for later ones.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from service.envs.base import Action, Environment, EnvSpec, Reset, Step, UserSimConfig
from service.envs.errors import EnvError, EnvHostClosed, EnvHostError, EnvNotFound, EnvWorkerCrashed
from service.envs.worker_process import WorkerProcess

__all__ = [
    "EnvError",
    "EnvHost",
    "EnvHostClosed",
    "EnvHostError",
    "EnvNotFound",
    "EnvSession",
    "EnvWorkerCrashed",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
EnvFactory = Callable[[str, UserSimConfig], Environment]

EXECUTORS = ("process", "thread")
THREADS_PER_WORKER = 32  # concurrent env calls per worker: user-simulator turns wait on HTTP
CALL_TIMEOUT_SECONDS = 600.0  # one reset/step/open; past it the episode's env is abandoned
SHUTDOWN_GRACE_SECONDS = 10.0  # close() lets running calls finish this long, then kills workers


# ---- The worker side: module-level functions run in a worker process (or thread). ----

# Environments alive in this process, by session key. Keys are unique per session and a session
# runs one call at a time, so each entry is only ever touched by one thread at a time.
_ENVS: dict[str, Environment] = {}


def _guarded(fn: Callable[..., T], *args: Any) -> T:
    # Exceptions cross the process boundary by pickling; env exceptions may not pickle, or may
    # not unpickle there, so they travel as text.
    try:
        return fn(*args)
    except Exception as exc:
        raise EnvError.from_exception(exc) from None


def _worker_open(
    key: str, factory: EnvFactory, split: str, user_sim: UserSimConfig
) -> tuple[str, list[dict[str, Any]], int]:
    env = _guarded(factory, split, user_sim)
    _ENVS[key] = env
    return env.system_prompt, env.tools, os.getpid()


def _worker_reset(key: str, task_index: int) -> Reset:
    return _guarded(_ENVS[key].reset, task_index)


def _worker_step(key: str, action: Action) -> Step:
    return _guarded(_ENVS[key].step, action)


def _worker_close(key: str) -> None:
    # Only drops the entry: a timed-out call may still be running on the env in another thread.
    _ENVS.pop(key, None)


def _worker_pid() -> int:
    return os.getpid()


def _worker_env_count(prefix: str) -> int:
    return sum(1 for key in list(_ENVS) if key.startswith(prefix))


# ---- The host side. ----


CLOSE_WAIT_SECONDS = 2.0  # how long closing a session waits for its worker before moving on


def _consume(future: asyncio.Future[Any]) -> None:
    """Done-callback of a future nobody awaits: its exception is expected, not to be logged."""
    if not future.cancelled():
        future.exception()


class _ThreadPool:
    """The thread executor: every worker slot shares one pool in this process. No crash isolation
    and no CPU parallelism (the GIL); for tests and light environments."""

    crash: str | None = None
    pid: int | None = None

    def __init__(self, threads: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="env-call")
        self._pending: set[asyncio.Future[Any]] = set()
        self._stopping = False

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if self._stopping:
            raise EnvHostClosed("the env host is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        self._executor.submit(fn, *args).add_done_callback(functools.partial(_settle, loop, future))
        return future

    async def stop(self, grace_seconds: float) -> None:
        self._stopping = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._pending:
            _, late = await asyncio.wait(set(self._pending), timeout=grace_seconds)
            if late:
                # Threads cannot be killed: they run on, and the interpreter waits for them at exit.
                logger.warning(
                    "%d env calls still running after %.0f s; leaving them", len(late), grace_seconds
                )
            for future in late:
                future.set_exception(EnvHostClosed("the env host is closed"))


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future[T], done: Future[T]) -> None:
    """On the pool's thread: hands a finished call over to the event loop."""

    def settle() -> None:
        if future.done():
            return
        if done.cancelled():
            future.set_exception(EnvHostClosed("the env host is closed"))
        elif (error := done.exception()) is not None:
            future.set_exception(error if isinstance(error, EnvHostError) else EnvError.from_exception(error))
        else:
            future.set_result(done.result())

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass  # the event loop is closed: nobody waits for this call any more


@dataclass(eq=False)
class _Worker:
    """One slot's worker; a dead process is replaced, under a new generation, at the next open."""

    slot: int
    generation: int
    runner: WorkerProcess | _ThreadPool
    sessions: int = 0  # episodes pinned here

    @property
    def name(self) -> str:
        return f"env worker {self.slot}.{self.generation}"


class EnvHost:
    """Env workers for the episode runner: `open()` an EnvSession per episode, then reset/step it.

    `envs` defaults to `registry.available_envs()`; tests pass their own specs. Worker processes
    start at the first `open` (or `worker_pids`), on the running event loop.
    """

    def __init__(
        self,
        workers: int,
        executor: str = "process",
        user_sim: UserSimConfig = UserSimConfig(),  # noqa: B008  (frozen dataclass)
        envs: Mapping[str, EnvSpec] | None = None,
        *,
        threads_per_worker: int = THREADS_PER_WORKER,
        call_timeout_seconds: float = CALL_TIMEOUT_SECONDS,
        shutdown_grace_seconds: float = SHUTDOWN_GRACE_SECONDS,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {threads_per_worker}")
        if call_timeout_seconds <= 0 or shutdown_grace_seconds < 0:
            raise ValueError("call_timeout_seconds must be > 0 and shutdown_grace_seconds >= 0")
        self.executor_kind = executor
        self.user_sim = user_sim
        self.threads_per_worker = threads_per_worker
        self.call_timeout_seconds = call_timeout_seconds
        self.shutdown_grace_seconds = shutdown_grace_seconds
        self._envs = envs
        self._size = workers
        self._id = uuid.uuid4().hex[:8]
        self._keys = itertools.count()
        self._generations = itertools.count()
        self._closed = False
        self._thread_pool: _ThreadPool | None = None
        self._workers: list[_Worker] = []

    @property
    def workers(self) -> int:
        return self._size

    def _live_workers(self) -> list[_Worker]:
        """The workers, started if need be, with dead processes replaced."""
        if self._closed:
            raise EnvHostClosed("the env host is closed")
        if not self._workers:
            self._workers = [self._new_worker(slot) for slot in range(self._size)]
        for slot, worker in enumerate(self._workers):
            if worker.runner.crash is not None:
                self._workers[slot] = self._new_worker(slot)
        return self._workers

    def _new_worker(self, slot: int) -> _Worker:
        generation = next(self._generations)
        runner: WorkerProcess | _ThreadPool
        if self.executor_kind == "process":
            name = f"env worker {slot}.{generation}"
            runner = WorkerProcess(name, self.threads_per_worker, asyncio.get_running_loop())
        else:
            if self._thread_pool is None:
                self._thread_pool = _ThreadPool(self.threads_per_worker * self._size)
            runner = self._thread_pool
        return _Worker(slot, generation, runner)

    def _spec(self, env_name: str) -> EnvSpec:
        if self._envs is None:
            from service.envs.registry import available_envs

            self._envs = available_envs()
        spec = self._envs.get(env_name)
        if spec is None:
            raise EnvNotFound(f"unknown environment {env_name!r}; known: {sorted(self._envs)}")
        return spec

    async def open(self, env_name: str, split: str, episode_key: str) -> EnvSession:
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
            session = EnvSession(self, worker, key, episode_key)
            try:
                system_prompt, tools, pid = await self._open_in(worker, key, spec, split, episode_key)
            except EnvWorkerCrashed:
                session._release()
                if attempt == 1:
                    raise
                continue
            except BaseException:
                session._release()
                raise
            session.system_prompt = system_prompt
            session.tools = tools
            session.pid = pid if self.executor_kind == "process" else None
            return session
        raise AssertionError("unreachable")

    async def _open_in(
        self, worker: _Worker, key: str, spec: EnvSpec, split: str, episode_key: str
    ) -> tuple[str, list[dict[str, Any]], int]:
        opened = self._submit(worker, _worker_open, key, spec.factory, split, self.user_sim)
        try:
            return await self._outcome(opened, f"open of {spec.name!r} for episode {episode_key!r}")
        except BaseException:
            # Cancelled or timed out (even as the open finished): the env is built all the same.
            opened.add_done_callback(functools.partial(self._drop_orphan, worker, key))
            raise

    def _drop_orphan(self, worker: _Worker, key: str, opened: asyncio.Future[Any]) -> None:
        if opened.cancelled() or opened.exception() is not None or self._closed:
            return
        try:
            self._submit(worker, _worker_close, key).add_done_callback(_consume)
        except EnvHostError:
            pass  # the worker died, and the env with it

    async def worker_pids(self) -> list[int]:
        """Every worker's process id once it answers (this process's with the thread executor)."""
        probes = [self._submit(w, _worker_pid) for w in self._live_workers()]
        return list(await asyncio.gather(*(self._outcome(p, "pid probe") for p in probes)))

    async def open_envs(self) -> int:
        """How many environments this host's workers hold: one per open session, unless one leaked."""
        runners = {id(w.runner): w for w in self._live_workers()}.values()
        probes = [self._submit(w, _worker_env_count, f"{self._id}:") for w in runners]
        return sum(await asyncio.gather(*(self._outcome(p, "env count") for p in probes)))

    def _submit(self, worker: _Worker, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if self._closed:
            raise EnvHostClosed("the env host is closed")
        return worker.runner.submit(fn, *args)

    async def _outcome(self, future: asyncio.Future[T], what: str) -> T:
        """Awaits a call; cancelling the caller or timing out leaves the call itself running."""
        try:
            async with asyncio.timeout(self.call_timeout_seconds):
                return await asyncio.shield(future)
        except BaseException as error:
            if future.done():
                if isinstance(error, TimeoutError) and not future.cancelled():
                    return future.result()  # it finished as the timeout fell: its own outcome
                raise  # the call's own outcome, or the caller's cancellation
            future.add_done_callback(_consume)  # nobody awaits it any more
            if isinstance(error, TimeoutError):
                raise EnvError(
                    "TimeoutError", f"{what} did not return within {self.call_timeout_seconds:g} s"
                ) from None
            raise

    async def close(self) -> None:
        """Shuts every worker down: running calls get `shutdown_grace_seconds` to finish, then
        worker processes are killed (threads are left behind); environments still open are dropped."""
        if self._closed:
            return
        self._closed = True
        runners = {id(w.runner): w.runner for w in self._workers}.values()
        await asyncio.gather(*(runner.stop(self.shutdown_grace_seconds) for runner in runners))


class EnvSession:
    """One episode's environment, living in one env worker. Its calls run one at a time, in order."""

    system_prompt: str
    tools: list[dict[str, Any]]
    pid: int | None  # the worker process, or None with the thread executor

    def __init__(self, host: EnvHost, worker: _Worker, key: str, episode_key: str) -> None:
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
        return await self._call("reset", _worker_reset, self._key, task_index)

    async def step(self, action: Action) -> Step:
        return await self._call(f"step {action.name!r}", _worker_step, self._key, action)

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
            self._running = future = self._host._submit(self._worker, fn, *args)
            try:
                return await self._host._outcome(future, f"{what} of episode {self.episode_key!r}")
            except EnvError as error:
                if not future.done():  # timed out; the env may be in any state, and busy
                    self._stuck = str(error)
                raise

    async def close(self) -> None:
        """Drops the environment in its worker. Idempotent; a no-op if the worker died."""
        if self._released:
            return
        self._release()
        if self._worker.runner.crash is not None or self._host._closed:
            return
        try:
            closing = self._host._submit(self._worker, _worker_close, self._key)
        except (EnvWorkerCrashed, EnvHostClosed):
            return
        closing.add_done_callback(_consume)  # whether or not it is awaited below
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

    def _check_open(self) -> None:
        if self._released:
            raise EnvHostError(f"the env session of episode {self.episode_key!r} is closed")
        if self._stuck is not None:
            raise EnvError("TimeoutError", f"the env session is abandoned: {self._stuck}")

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._worker.sessions -= 1
