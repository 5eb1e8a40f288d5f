"""What concurrent callers of one process share: a value built once (`Lazy`), reads of one key run one
at a time for everyone who asked (`SharedReads`), and the JSON summaries of complete groups between
polls (`GroupSummaries`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

from cachetools import LRUCache

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


GROUP_SUMMARIES_BYTES = 64 * 1024 * 1024  # JSON of complete groups kept for polls, all batches


def _summaries_bytes(groups: dict[int, bytes]) -> int:
    return sum(len(text) for text in groups.values())


class GroupSummaries:
    """The JSON summaries of batches' complete groups, kept to answer the next poll: a group, once
    complete, never changes (each of its episodes' final result is written once), so the polls of a
    running batch encode each group once. A batch is forgotten once a poll finds it whole (its
    trainer has what it waited for, and an hour's soak of finished batches would otherwise fill the
    cache); the least recently polled batches go past `max_bytes`, and a batch whose summaries
    alone weigh more is not kept."""

    def __init__(self, max_bytes: int = GROUP_SUMMARIES_BYTES) -> None:
        self._batches: LRUCache[str, dict[int, bytes]] = LRUCache(max_bytes, getsizeof=_summaries_bytes)

    def of(self, batch_id: str) -> dict[int, bytes]:
        """The batch's groups summarized so far (a copy, by group index)."""
        return dict(self._batches.get(batch_id, {}))

    def add(self, batch_id: str, groups: dict[int, bytes]) -> None:
        try:
            self._batches[batch_id] = self._batches.get(batch_id, {}) | groups
        except ValueError:  # more than max_bytes by itself
            self.forget(batch_id)

    def forget(self, batch_id: str) -> None:
        self._batches.pop(batch_id, None)
