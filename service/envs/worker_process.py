"""One env worker process: it runs many calls at once on its own thread pool, over one pipe.

The parent sends (call_id, pickled (function, args)); the child runs each call on a thread and
answers (call_id, ok, pickled result or EnvError). The payload is pickled apart from the envelope,
so a call or result that does not (un)pickle fails only its own call, never the stream.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection, wait
from typing import Any, Final, TypeVar

from service.envs.errors import EnvError, EnvHostClosed, EnvHostError, EnvWorkerCrashed, describe_exit

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Spawn, not fork (the parent runs threads and an event loop) nor forkserver (its server process
# keeps the sys.path and os.environ of the moment it started; spawn children get the current ones).
MP_START_METHOD: Final = "spawn"
STOP = -1  # the call id of the message that tells the child to finish its calls and exit
STOP_MARGIN_SECONDS = 1.0  # past the child's own drain time, before the parent terminates it
KILL_WAIT_SECONDS = 2.0  # after SIGTERM (then SIGKILL), for the exit to be seen
EXIT_CODE_WAIT_SECONDS = 1.0  # the pipe can report EOF just before the process can be reaped


def _dumps(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


# ---- The child. ----


def serve(conn: Connection, threads: int) -> None:
    """The worker process's main: runs the parent's calls on `threads` threads until it is told
    to stop (then waits for running calls, up to the drain time sent) or the parent is gone."""
    # Ctrl-C reaches the whole process group; the parent decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="env-call")
    send_lock = threading.Lock()
    drain_seconds = 0.0

    def answer(call_id: int, future: Future[Any]) -> None:
        if future.cancelled():
            return
        error = future.exception()
        try:
            if error is None:
                ok, payload = True, _dumps(future.result())
            else:
                ok, payload = False, _dumps(EnvError.from_exception(error))
        except Exception as exc:  # a result that does not pickle (pickling may raise anything)
            ok, payload = False, _dumps(EnvError.from_exception(exc))
        message = _dumps((call_id, ok, payload))
        with send_lock:
            try:
                conn.send_bytes(message)
            except OSError:
                pass  # the parent is gone; the receive loop sees EOF and stops

    while True:
        try:
            call_id, body = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if call_id == STOP:
            drain_seconds = body
            break
        pool.submit(_run, body).add_done_callback(functools.partial(answer, call_id))
    pool.shutdown(wait=False, cancel_futures=True)
    drain = threading.Thread(target=pool.shutdown, daemon=True)
    drain.start()
    drain.join(drain_seconds)
    if drain.is_alive():
        # A call that never returns (a hung user-simulator request) cannot be interrupted, and
        # the interpreter would wait for its thread at exit.
        os._exit(0)


def _run(body: bytes) -> Any:
    fn, args = pickle.loads(body)
    return fn(*args)


# ---- The parent. ----


class WorkerProcess:
    """The parent's handle on one worker process. `submit` sends a call and returns an asyncio
    future; a reader thread settles the futures, and when the process dies fails every pending
    one with EnvWorkerCrashed (pid and exit code in the message) and sets `crash`."""

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
        self.process = context.Process(target=serve, args=(child_conn, threads), name=name, daemon=True)
        self.process.start()
        child_conn.close()
        self.pid: int | None = self.process.pid
        threading.Thread(target=self._read, name=f"{name} reader", daemon=True).start()
        threading.Thread(target=self._write, name=f"{name} writer", daemon=True).start()

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Sends fn(*args) to the worker (fn must be a module-level function)."""
        if self.crash is not None:
            raise EnvWorkerCrashed(self.crash)
        if self._stopping:
            raise EnvHostClosed("the env host is closed")
        try:
            body = _dumps((fn, args))
        except Exception as exc:  # arguments that do not pickle (pickling may raise anything)
            raise EnvError.from_exception(exc) from exc
        call_id = next(self._ids)
        future: asyncio.Future[T] = self._loop.create_future()
        self._pending[call_id] = future
        self._outbox.put(_dumps((call_id, body)))
        return future

    async def stop(self, grace_seconds: float) -> None:
        """Lets running calls finish for up to `grace_seconds`, then terminates the process."""
        if not self._stopping:
            self._stopping = True
            self._outbox.put(_dumps((STOP, grace_seconds)))
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
