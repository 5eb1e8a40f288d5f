"""Runs environments off the event loop: in worker processes (or threads), one episode per worker.

tau-bench's reward computation is pure-Python CPU that holds the GIL for 0.3-0.75 s per episode,
so env work runs in N single-process pools. Each episode is pinned to one worker for its lifetime
(its Environment object lives there); a worker that dies fails only the episodes pinned to it and
is replaced for later ones.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import signal
import traceback
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import BrokenExecutor, Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, TypeVar

from service.envs.base import Action, Environment, EnvSpec, Reset, Step, UserSimConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")
EnvFactory = Callable[[str, UserSimConfig], Environment]

EXECUTORS = ("process", "thread")
# Spawn, not fork (the parent runs threads and an event loop) nor forkserver (its server process
# keeps the sys.path and os.environ of the moment it started; spawn children get the current ones).
MP_START_METHOD = "spawn"
SHUTDOWN_TIMEOUT_SECONDS = 10.0
EXIT_CODE_POLLS = 50
EXIT_CODE_POLL_SECONDS = 0.01


class EnvHostError(Exception):
    """Base of the errors EnvHost raises."""


class EnvNotFound(EnvHostError, LookupError):
    """An unknown environment name or split."""


class EnvError(EnvHostError):
    """Environment code raised: the original exception's type, message and traceback, as text
    (it crossed a process boundary, and its class may not be importable on this side)."""

    def __init__(self, exc_type: str, message: str, traceback: str = "") -> None:
        super().__init__(exc_type, message, traceback)
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback

    def __str__(self) -> str:
        return f"{self.exc_type}: {self.message}"

    @classmethod
    def from_exception(cls, exc: BaseException) -> EnvError:
        exc_type = type(exc)
        name = exc_type.__qualname__
        if exc_type.__module__ not in ("builtins", "__main__"):
            name = f"{exc_type.__module__}.{name}"
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(name, str(exc), text)


class EnvWorkerCrashed(EnvHostError):
    """The worker process an episode was pinned to died; the episode's environment is gone."""


class EnvHostClosed(EnvHostError):
    """The host was shut down."""


# ---- The worker side: module-level functions run in the worker process (or thread). ----

# Environments alive in this worker, by session key. In thread mode every worker thread shares
# this dict; keys are unique per session, and each key is only ever touched by its own thread.
_ENVS: dict[str, Environment] = {}


def _guarded(fn: Callable[..., T], *args: Any) -> T:
    # Exceptions cross the process boundary by pickling; env exceptions may not pickle, or may
    # not unpickle here, so they travel as text.
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
    _ENVS.pop(key, None)


def _worker_pid() -> int:
    return os.getpid()


# ---- The host side. ----


def _processes_of(executor: Executor) -> list[Any]:
    # ProcessPoolExecutor's Process objects (private, so optional): they give a dead worker's exit code.
    return list((getattr(executor, "_processes", None) or {}).values())


def _describe_exit(processes: list[Any]) -> str:
    causes = []
    for process in processes:
        code = process.exitcode
        if code is None:
            continue
        if code < 0:
            try:
                causes.append(f"pid {process.pid} killed by {signal.Signals(-code).name}")
            except ValueError:
                causes.append(f"pid {process.pid} killed by signal {-code}")
        else:
            causes.append(f"pid {process.pid} exited with code {code}")
    return ", ".join(causes) or "exited abruptly"


class _Worker:
    """One single-process (or single-thread) pool; replaced as a whole when its process dies."""

    def __init__(self, slot: int, generation: int, executor: Executor) -> None:
        self.slot = slot
        self.generation = generation
        self.executor = executor
        self.sessions = 0
        self.broken = False
        self.processes: list[Any] = []  # of a broken process pool
        self.crash: str | None = None  # why it died, once known

    @property
    def name(self) -> str:
        return f"env worker {self.slot}.{self.generation}"


class EnvHost:
    """Env workers for the episode runner: `open()` an EnvSession per episode, then reset/step it.

    `envs` defaults to `registry.available_envs()`; tests pass their own specs.
    """

    def __init__(
        self,
        workers: int,
        executor: str = "process",
        user_sim: UserSimConfig = UserSimConfig(),  # noqa: B008  (frozen dataclass)
        envs: Mapping[str, EnvSpec] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
        self.executor_kind = executor
        self.user_sim = user_sim
        self._envs = envs
        self._id = uuid.uuid4().hex[:8]
        self._keys = itertools.count()
        self._generations = itertools.count()
        self._closed = False
        self._workers = [self._new_worker(slot) for slot in range(workers)]

    @property
    def workers(self) -> int:
        return len(self._workers)

    def _new_worker(self, slot: int) -> _Worker:
        executor: Executor
        if self.executor_kind == "process":
            executor = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context(MP_START_METHOD)
            )
        else:
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"env-worker-{slot}")
        return _Worker(slot, next(self._generations), executor)

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
        if self._closed:
            raise EnvHostClosed("the env host is closed")
        # A worker that died while idle is only noticed at its next call: if that call is this
        # open, the episode was never there, so it retries once on the replacement.
        for attempt in range(2):
            worker = min(self._workers, key=lambda w: w.sessions)
            key = f"{self._id}:{next(self._keys)}:{episode_key}"
            worker.sessions += 1
            session = EnvSession(self, worker, key, episode_key)
            try:
                system_prompt, tools, pid = await self._call(
                    worker, _worker_open, key, spec.factory, split, self.user_sim
                )
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

    async def worker_pids(self) -> list[int]:
        """Starts every worker (a process pool spawns lazily) and returns their process ids."""
        return list(await asyncio.gather(*(self._call(w, _worker_pid) for w in self._workers)))

    async def _call(self, worker: _Worker, fn: Callable[..., T], *args: Any) -> T:
        if worker.broken:
            raise EnvWorkerCrashed(worker.crash or f"{worker.name} died; its episodes are lost")
        if self._closed:
            raise EnvHostClosed("the env host is closed")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(worker.executor, fn, *args)
        except BrokenExecutor as exc:
            if self._closed:
                raise EnvHostClosed("the env host is closed") from exc
            raise EnvWorkerCrashed(await self._worker_died(worker)) from exc
        except EnvHostError:
            raise
        except RuntimeError as exc:
            if self._closed:  # "cannot schedule new futures after shutdown"
                raise EnvHostClosed("the env host is closed") from exc
            raise EnvError.from_exception(exc) from exc
        except Exception as exc:
            # Arguments or results that do not pickle: the env's doing, reported like its errors.
            raise EnvError.from_exception(exc) from exc

    async def _worker_died(self, worker: _Worker) -> str:
        """Replaces a dead worker (once) and returns why it died."""
        if not worker.broken:
            worker.broken = True
            worker.processes = _processes_of(worker.executor)
            worker.executor.shutdown(wait=False, cancel_futures=True)
            if self._workers[worker.slot] is worker and not self._closed:
                self._workers[worker.slot] = self._new_worker(worker.slot)
        if worker.crash is None:
            # The pool fails its futures before it reaps the process: the exit code comes shortly.
            for _ in range(EXIT_CODE_POLLS):
                if all(process.exitcode is not None for process in worker.processes):
                    break
                await asyncio.sleep(EXIT_CODE_POLL_SECONDS)
            if worker.crash is None:
                worker.crash = (
                    f"{worker.name} died ({_describe_exit(worker.processes)}); its episodes are lost"
                )
                logger.error("%s", worker.crash)
        return worker.crash

    async def close(self) -> None:
        """Shuts every worker down; environments still open are dropped."""
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(self._shutdown(w) for w in self._workers))

    async def _shutdown(self, worker: _Worker) -> None:
        stopping = asyncio.ensure_future(
            asyncio.to_thread(worker.executor.shutdown, wait=True, cancel_futures=True)
        )
        done, _ = await asyncio.wait({stopping}, timeout=SHUTDOWN_TIMEOUT_SECONDS)
        if done:
            stopping.result()
            return
        # An env call that never returns: its process is killed, which lets the shutdown finish.
        logger.warning("%s did not stop in %.0f s; terminating it", worker.name, SHUTDOWN_TIMEOUT_SECONDS)
        for process in _processes_of(worker.executor):
            process.terminate()
        await stopping


class EnvSession:
    """One episode's environment, living in one env worker. Not for concurrent use."""

    system_prompt: str
    tools: list[dict[str, Any]]
    pid: int | None  # the worker process, or None with the thread executor

    def __init__(self, host: EnvHost, worker: _Worker, key: str, episode_key: str) -> None:
        self._host = host
        self._worker = worker
        self._key = key
        self.episode_key = episode_key
        self._released = False
        self.system_prompt = ""
        self.tools = []
        self.pid = None

    @property
    def worker_name(self) -> str:
        return self._worker.name

    async def reset(self, task_index: int) -> Reset:
        self._check_open()
        return await self._host._call(self._worker, _worker_reset, self._key, task_index)

    async def step(self, action: Action) -> Step:
        self._check_open()
        return await self._host._call(self._worker, _worker_step, self._key, action)

    async def close(self) -> None:
        """Drops the environment in its worker. Idempotent; a no-op if the worker died."""
        if self._released:
            return
        self._release()
        if self._worker.broken or self._host._closed:
            return
        try:
            await self._host._call(self._worker, _worker_close, self._key)
        except (EnvWorkerCrashed, EnvHostClosed):
            pass

    def _check_open(self) -> None:
        if self._released:
            raise EnvHostError(f"the env session of episode {self.episode_key!r} is closed")

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._worker.sessions -= 1
