"""The resources one app owns, built by its lifespan and handed to the routes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from service.agents.service import AgentSessions
from service.api.batch_json import GroupSummaries
from service.config import Settings
from service.engine.client import SGLangClient
from service.envs.base import EnvSpec
from service.loop.tokens import TokenTexts
from service.metrics import Metrics
from service.storage.db import Database
from service.worker.group_log import GroupLog
from service.worker.worker import EpisodeWorker

logger = logging.getLogger(__name__)
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

RESUME_RETRY_SECONDS = 5.0  # between tries of the pause limit's resume, while workers refuse it
# A control call's outcome per worker URL: None where it went through, else the problem.
ControlCall = Callable[[], Awaitable[dict[str, str | None]]]


class ResultsSignal:
    """Wakes long-polls when this process stores a result (other processes' results are polled)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> None:
        """Returns when the next result is stored or after `timeout` seconds, whichever is first."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            pass


class SharedReads(Generic[K, V]):
    """Concurrent identical reads share one: a read asked for while another of its key runs waits
    for the next one, which starts once that one ends and answers everyone who asked meanwhile. Each
    caller so gets a read that started after it asked (never an older answer), and under load a
    key costs one read at a time however many ask: 200 trainers polling one batch."""

    def __init__(self) -> None:
        self._next: dict[K, asyncio.Future[V]] = {}  # the read callers now join, not started yet
        self._running: dict[K, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def read(self, key: K, read: Callable[[], Awaitable[V]]) -> V:
        answer = self._next.get(key)
        if answer is None:
            answer = self._next[key] = asyncio.get_running_loop().create_future()
            answer.add_done_callback(lambda future: future.cancelled() or future.exception())
            task = asyncio.create_task(self._run(key, answer, read))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(answer)  # a caller that goes away leaves the read to the others

    async def _run(self, key: K, answer: asyncio.Future[V], read: Callable[[], Awaitable[V]]) -> None:
        while (running := self._running.get(key)) is not None:
            await asyncio.wait([running])
        del self._next[key]  # who asks from now on needs a later read
        self._running[key] = asyncio.current_task()  # type: ignore[assignment]  # this one
        try:
            answer.set_result(await read())
        except Exception as error:
            answer.set_exception(error)
        finally:
            del self._running[key]


class Lazy(Generic[V]):
    """A value built once, on first use: however many ask at once, `build` runs once."""

    def __init__(self, build: Callable[[], Awaitable[V]]) -> None:
        self._build = build
        self._value: V | None = None
        self._building = asyncio.Lock()

    async def get(self) -> V:
        async with self._building:
            if self._value is None:
                self._value = await self._build()
        return self._value


class EnginePause:
    """Generation paused by POST /engine/pause, until POST /engine/continue or, at the latest,
    `max_seconds` after the last pause: then `resume` runs (a trainer that died mid weight update
    must not leave the engine paused for ever)."""

    def __init__(self, max_seconds: float, resume: ControlCall) -> None:
        self.max_seconds = max_seconds
        self._resume = resume
        self._since: float | None = None  # time.monotonic() of the pause
        self._timer: asyncio.Task[None] | None = None

    @property
    def paused(self) -> bool:
        return self._since is not None

    def describe(self) -> str:
        assert self._since is not None
        elapsed = time.monotonic() - self._since
        return (
            f"generation paused by POST /engine/pause {elapsed:.0f} s ago; POST /engine/continue "
            f"resumes it, or the service itself {max(0.0, self.max_seconds - elapsed):.0f} s from now"
        )

    def started(self) -> None:
        self._cancel_timer()
        self._since = time.monotonic()
        self._timer = asyncio.create_task(self._resume_at_limit(), name="engine pause limit")

    def ended(self) -> None:
        self._cancel_timer()
        self._since = None

    async def _resume_at_limit(self) -> None:
        await asyncio.sleep(self.max_seconds)
        while True:
            outcome = await self._resume()
            failed = {url: problem for url, problem in outcome.items() if problem is not None}
            if not failed:
                logger.warning(
                    "generation stayed paused %g s (MAX_PAUSE_SECONDS) without POST /engine/continue: "
                    "resumed it on %d workers",
                    self.max_seconds,
                    len(outcome),
                )
                self._since, self._timer = None, None
                return
            logger.error(
                "resuming generation after MAX_PAUSE_SECONDS failed on %s; retrying in %g s",
                failed,
                RESUME_RETRY_SECONDS,
            )
            await asyncio.sleep(RESUME_RETRY_SECONDS)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def aclose(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            await asyncio.wait([timer])


@dataclass(frozen=True)
class Services:
    """What the lifespan builds, whole, and the routes use; one per app."""

    settings: Settings
    database: Database
    engine: SGLangClient
    envs: dict[str, EnvSpec]
    metrics: Metrics
    results: ResultsSignal  # fires whenever this process stores a result
    shutting_down: asyncio.Event  # set when the server was told to stop: long-polls return at once
    pause: EnginePause  # whether a trainer paused generation, and since when
    worker: EpisodeWorker | None  # None when this process only serves the API (RUN_WORKER=false)
    group_log: GroupLog  # logs complete groups in the stream of GET /groups
    tool_call_format: str  # TOOL_CALL_FORMAT, `auto` resolved
    token_texts: TokenTexts  # token ids as text, for people (the viewer)
    agents: AgentSessions  # external agents' episodes; their tokenizer is loaded on first call
    summaries: GroupSummaries = field(default_factory=GroupSummaries)
    summary_reads: SharedReads[str, bytes | None] = field(default_factory=SharedReads)
