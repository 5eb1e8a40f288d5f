"""The executors env calls run on, off the event loop: worker processes, or threads in this process.

tau-bench's reward computation is pure-Python CPU that holds the GIL for 0.3-0.75 s per episode, so
env work is spread over N worker processes; its user simulator blocks for seconds on an HTTP call
inside `step`, so each process runs calls on a pool of threads (THREADS_PER_WORKER of them).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import multiprocessing
import pickle
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Final, Literal, Protocol, TypeVar, get_args

from service.envs import child
from service.envs.errors import EnvError, EnvHostClosed, EnvHostError, EnvWorkerCrashed, describe_exit

logger = logging.getLogger(__name__)

T = TypeVar("T")

ExecutorKind = Literal["process", "thread"]
EXECUTOR_KINDS: tuple[ExecutorKind, ...] = get_args(ExecutorKind)
THREADS_PER_WORKER = 32  # concurrent env calls per worker: user-simulator turns wait on HTTP

# Spawn, not fork (the parent runs threads and an event loop) nor forkserver (its server process
# keeps the sys.path and os.environ of the moment it started; spawn children get the current ones).
MP_START_METHOD: Final = "spawn"
STOP_MARGIN_SECONDS = 1.0  # past the child's own drain time, before the parent terminates it
KILL_WAIT_SECONDS = 2.0  # after SIGTERM (then SIGKILL), for the exit to be seen
EXIT_CODE_WAIT_SECONDS = 1.0  # the pipe can report EOF just before the process can be reaped


class EnvExecutor(Protocol):
    """Runs env calls (module-level functions of `service.envs.child`) off the event loop."""

    @property
    def crash(self) -> str | None:
        """Why the executor died, once it did; it then takes no more calls."""

    @property
    def pid(self) -> int | None:
        """The process the calls run in; None for this process."""

    @property
    def calls(self) -> int:
        """Calls submitted and not answered yet."""

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Starts fn(*args); the future holds its result, or an EnvHostError (EnvError for an
        exception of the call itself)."""

    async def stop(self, grace_seconds: float) -> None:
        """Takes no more calls and lets running ones finish for up to `grace_seconds`."""


@dataclass(eq=False)
class EnvWorker:
    """One worker slot's executor and the episodes pinned to it; a dead process is replaced, under a
    new generation, at the next open."""

    slot: int
    generation: int
    executor: EnvExecutor
    sessions: int = 0  # episodes pinned here

    @property
    def name(self) -> str:
        return worker_name(self.slot, self.generation)


def worker_name(slot: int, generation: int) -> str:
    return f"env worker {slot}.{generation}"


def ignore_outcome(future: asyncio.Future[Any]) -> None:
    """Done-callback of a call nobody awaits: its exception is expected, not to be logged."""
    if not future.cancelled():
        future.exception()


# ---- Threads in this process. ----


class EnvThreadPool:
    """The thread executor: every worker slot shares one pool in this process. No crash isolation
    and no CPU parallelism (the GIL); for tests and light environments.

    Hand-written rather than concurrent.futures' ThreadPoolExecutor, on a measured hot path (every
    env call of every turn): its submit (a Future with its Condition, a work item, two locks, the
    idle semaphore) and its done-callback were most of the hand-off's CPU at 2,000 episodes in
    flight. Here a call is one queue put and one call_soon_threadsafe back. As there, a thread is
    started only when no idle one is left to take the call, up to `threads`; the threads are
    daemons: a call still running at the interpreter's exit is abandoned."""

    crash: str | None = None
    pid: int | None = None

    def __init__(self, threads: int) -> None:
        self._max_threads = threads
        self._threads = 0
        # (loop, future, fn, args, the pending set) per call; None stops a thread.
        self._calls: queue.SimpleQueue[_ThreadCall | None] = queue.SimpleQueue()
        # One entry per thread that finished a call and went back to the queue: a submit takes one
        # (that thread will run its call) or, with none left, starts a thread (list ops are atomic).
        self._idle: list[None] = []
        self._pending: set[asyncio.Future[Any]] = set()
        self._stopping = False

    @property
    def calls(self) -> int:
        return len(self._pending)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if self._stopping:
            raise EnvHostClosed("the env host is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._pending.add(future)
        self._calls.put((loop, future, fn, args, self._pending))
        try:
            self._idle.pop()
        except IndexError:
            if self._threads < self._max_threads:
                self._threads += 1
                name = f"env-call_{self._threads - 1}"
                threading.Thread(
                    target=_run_calls, args=(self._calls, self._idle), name=name, daemon=True
                ).start()
        return future

    async def stop(self, grace_seconds: float) -> None:
        self._stopping = True
        while True:  # calls no thread took yet are not run
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                break
            if call is not None:
                _settle(call[1], call[4], False, EnvHostClosed("the env host is closed"))
        for _ in range(self._threads):
            self._calls.put(None)
        if self._pending:
            _, late = await asyncio.wait(set(self._pending), timeout=grace_seconds)
            if late:
                # Threads cannot be killed: they run on (daemons: abandoned at the interpreter's exit).
                logger.warning(
                    "%d env calls still running after %.0f s; leaving them", len(late), grace_seconds
                )
            for future in late:
                future.set_exception(EnvHostClosed("the env host is closed"))


_ThreadCall = tuple[
    asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...], set[Any]
]


def _run_calls(calls: queue.SimpleQueue[_ThreadCall | None], idle: list[None]) -> None:
    """A pool thread: runs calls until it gets None, handing each outcome over to its event loop."""
    while (call := calls.get()) is not None:
        loop, future, fn, args, pending = call
        try:
            ok, value = True, fn(*args)
        except BaseException as error:  # the call's own outcome, whatever it is
            ok, value = False, error
        try:
            loop.call_soon_threadsafe(_settle, future, pending, ok, value)
        except RuntimeError:
            pass  # the event loop is closed: nobody waits for this call any more
        del call, future, fn, args, value  # hold nothing of it while idle
        idle.append(None)


def _settle(future: asyncio.Future[Any], pending: set[Any], ok: bool, value: Any) -> None:
    """On the event loop: a finished call's outcome to its future."""
    pending.discard(future)
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value if isinstance(value, EnvHostError) else EnvError.from_exception(value))


# ---- A worker process (its main loop is `child.serve`). ----


class WorkerProcess:
    """The parent's handle on one worker process, which runs many calls at once on its own thread
    pool, over one pipe. `submit` sends a call and returns an asyncio future; a reader thread
    settles the futures, and when the process dies fails every pending one with EnvWorkerCrashed
    (pid and exit code in the message) and sets `crash`."""

    def __init__(self, name: str, threads: int, loop: asyncio.AbstractEventLoop) -> None:
        self.name = name
        self.crash: str | None = None  # why it died, once it did
        self._loop = loop
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._exited = asyncio.Event()
        # Sends happen on a writer thread: a busy child with a full pipe must not block the loop.
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        context = multiprocessing.get_context(MP_START_METHOD)
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=child.serve, args=(child_conn, threads), name=name, daemon=True)
        self.process.start()
        child_conn.close()
        self.pid: int | None = self.process.pid
        threading.Thread(target=self._read, name=f"{name} reader", daemon=True).start()
        threading.Thread(target=self._write, name=f"{name} writer", daemon=True).start()

    @property
    def calls(self) -> int:
        return len(self._pending)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Sends fn(*args) to the worker (fn must be a module-level function)."""
        if self.crash is not None:
            raise EnvWorkerCrashed(self.crash)
        if self._stopping:
            raise EnvHostClosed("the env host is closed")
        try:
            body = child.dumps((fn, args))
        except Exception as exc:  # arguments that do not pickle (pickling may raise anything)
            raise EnvError.from_exception(exc) from exc
        call_id = next(self._ids)
        future: asyncio.Future[T] = self._loop.create_future()
        self._pending[call_id] = future
        self._outbox.put(child.dumps((call_id, body)))
        return future

    async def stop(self, grace_seconds: float) -> None:
        """Lets running calls finish for up to `grace_seconds`, then terminates the process."""
        if not self._stopping:
            self._stopping = True
            self._outbox.put(child.dumps((child.STOP, grace_seconds)))
        if await self._wait_exit(grace_seconds + STOP_MARGIN_SECONDS):
            return
        logger.warning("%s did not stop within %.0f s; terminating it", self.name, grace_seconds)
        self.process.terminate()
        if not await self._wait_exit(KILL_WAIT_SECONDS):
            self.process.kill()
            await self._wait_exit(KILL_WAIT_SECONDS)

    async def _wait_exit(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._exited.wait()
        except TimeoutError:
            return False
        return True

    # The reader and writer threads; they reach the loop only through _post.

    def _read(self) -> None:
        try:
            while True:
                if self._conn not in wait([self._conn, self.process.sentinel]):
                    break  # the process exited and left nothing to read
                try:
                    call_id, ok, payload = pickle.loads(self._conn.recv_bytes())
                except (EOFError, OSError):
                    break
                try:
                    value = pickle.loads(payload)
                except Exception as exc:  # e.g. a result class this side cannot import
                    ok, value = False, EnvError.from_exception(exc)
                self._post(self._settle, call_id, ok, value)
        finally:
            self.process.join(EXIT_CODE_WAIT_SECONDS)
            deadline = time.monotonic() + EXIT_CODE_WAIT_SECONDS
            while self.process.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.01)  # another thread may be reaping it right now
            self._outbox.put(None)
            self._post(self._on_exit, self.process.exitcode)

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:
                pass  # the process is gone; the reader reports it
        self._conn.close()  # here, after the reader is done with it

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # the event loop is closed: nobody waits for these calls any more

    # On the event loop.

    def _settle(self, call_id: int, ok: bool, value: Any) -> None:
        future = self._pending.pop(call_id, None)
        if future is None or future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _on_exit(self, exitcode: int | None) -> None:
        error: Callable[[], EnvHostError]
        if self._stopping:
            error = functools.partial(EnvHostClosed, "the env host is closed")
        else:
            self.crash = f"{self.name} died ({describe_exit(self.pid, exitcode)}); its episodes are lost"
            logger.error("%s", self.crash)
            error = functools.partial(EnvWorkerCrashed, self.crash)
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error())
        self._exited.set()
