"""What runs inside an env worker process: its main loop, and the env calls the parent sends it.

The parent sends (call_id, pickled (function, args)); the child runs each call on a thread and
answers (call_id, ok, pickled result or EnvError). The payload is pickled apart from the envelope,
so a call or result that does not (un)pickle fails only its own call, never the stream. The
functions are module-level so that they pickle by reference; the thread executor runs the same
ones in the parent's own process.
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from service.envs.base import Action, DriveOutcome, DriveRequest, Environment, Reset, Step, UserSimConfig
from service.envs.checks import EnvProtocolError, check_reset, check_step, check_tools, json_problem
from service.envs.errors import EnvError

T = TypeVar("T")

STOP = -1  # the call id of the message that tells the child to finish its calls and exit


def dumps(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


# ---- The worker process's main loop. ----


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
                ok, payload = True, dumps(future.result())
            else:
                ok, payload = False, dumps(EnvError.from_exception(error))
        except Exception as exc:  # a result that does not pickle (pickling may raise anything)
            ok, payload = False, dumps(EnvError.from_exception(exc))
        message = dumps((call_id, ok, payload))
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


# ---- The env calls. ----

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


def open_env(
    key: str, factory: Callable[[str, UserSimConfig], Environment], split: str, user_sim: UserSimConfig
) -> tuple[str, list[dict[str, Any]], int]:
    env = _guarded(_build, factory, split, user_sim)
    _ENVS[key] = env
    return env.system_prompt, env.tools, os.getpid()


def _build(
    factory: Callable[[str, UserSimConfig], Environment], split: str, user_sim: UserSimConfig
) -> Environment:
    env = factory(split, user_sim)
    check_tools(getattr(env, "system_prompt", None), getattr(env, "tools", None))
    return env


def reset_env(key: str, task_index: int) -> Reset:
    # Checked here, in the worker: an answer the service cannot use or store fails this call,
    # with a message saying what is wrong, before anything of it is recorded.
    return _guarded(_checked_reset, _ENVS[key], task_index)


def step_env(key: str, action: Action) -> Step:
    return _guarded(_checked_step, _ENVS[key], action)


def _checked_reset(env: Environment, task_index: int) -> Reset:
    return check_reset(env.reset(task_index))


def _checked_step(env: Environment, action: Action) -> Step:
    return check_step(env.step(action))


def drive_env(driver: Callable[[DriveRequest], DriveOutcome], request: DriveRequest) -> DriveOutcome:
    """Plays one episode of an agent-driven env (EnvSpec.driver) on this thread."""
    outcome = _guarded(driver, request)
    if not isinstance(outcome, DriveOutcome):
        raise EnvError(f"the driver answered {type(outcome).__name__}, not a DriveOutcome")
    # Checked here, as a step's info is: what cannot be stored fails the episode, saying why.
    if (problem := json_problem(outcome.info, "the driver's info")) is not None:
        raise EnvError.from_exception(EnvProtocolError(problem))
    return outcome


def close_env(key: str) -> None:
    # Only drops the entry: a timed-out call may still be running on the env in another thread.
    _ENVS.pop(key, None)


def pid() -> int:
    return os.getpid()


def env_count(prefix: str) -> int:
    return sum(1 for key in list(_ENVS) if key.startswith(prefix))
