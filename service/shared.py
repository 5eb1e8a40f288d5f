"""Async work shared among concurrent callers: a value built once (`Lazy`), reads of one key run one
at a time for everyone who asked (`SharedReads`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


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
