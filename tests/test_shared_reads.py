"""Polls of one batch share their database reads: shared.SharedReads, and GET /batches/{id}."""

from __future__ import annotations

import asyncio

import httpx
from sqlalchemy import event
from sqlalchemy.engine import Engine

from service.shared import SharedReads
from tests.support.polling import until


class Reads:
    """A read that returns how many reads started before it, and can be held until released."""

    def __init__(self) -> None:
        self.started = 0
        self.release = asyncio.Event()

    async def __call__(self) -> int:
        self.started += 1
        number = self.started
        await self.release.wait()
        return number


async def test_callers_during_a_read_share_the_next_one() -> None:
    shared: SharedReads[str, int] = SharedReads()
    reads = Reads()
    first = asyncio.create_task(shared.read("b", reads))
    await until(lambda: reads.started == 1)
    later = [asyncio.create_task(shared.read("b", reads)) for _ in range(10)]
    await asyncio.sleep(0.01)
    assert reads.started == 1  # the later callers wait for a read that starts after they asked
    other_key = asyncio.create_task(shared.read("c", reads))
    await until(lambda: reads.started == 2)  # another key is not held up
    reads.release.set()
    assert await first == 1
    assert await other_key == 2
    assert await asyncio.gather(*later) == [3] * 10
    assert reads.started == 3


async def test_a_failed_read_fails_its_callers_only() -> None:
    shared: SharedReads[str, int] = SharedReads()
    calls = 0

    async def flaky() -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        if calls == 1:
            raise ConnectionError("database down")
        return calls

    failing = [asyncio.create_task(shared.read("b", flaky)) for _ in range(3)]
    results = await asyncio.gather(*failing, return_exceptions=True)
    assert all(isinstance(result, ConnectionError) for result in results)
    assert await shared.read("b", flaky) == 2


async def test_a_caller_that_goes_away_leaves_the_read_to_the_others() -> None:
    shared: SharedReads[str, int] = SharedReads()
    reads = Reads()
    leaving = asyncio.create_task(shared.read("b", reads))
    staying = asyncio.create_task(shared.read("b", reads))
    await until(lambda: reads.started == 1)
    leaving.cancel()
    reads.release.set()
    assert await staying == 1
    assert leaving.cancelled()


async def test_concurrent_polls_of_a_batch_share_database_reads(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/episodes",
        json={"env": "builtin/shop", "task_split": "test", "task_indices": [0, 1], "samples_per_task": 2},
    )
    assert response.status_code == 202, response.text
    batch_id = response.json()["batch_id"]
    complete = await client.get(f"/batches/{batch_id}", params={"wait": 30})
    assert complete.json()["complete"], complete.text
    heads: list[str] = []  # the summary's head reads, counted on every engine of this process

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        if "GROUP BY episodes.group_index" in statement:
            heads.append(statement)

    event.listen(Engine, "before_cursor_execute", count)
    try:
        polls = await asyncio.gather(*(client.get(f"/batches/{batch_id}") for _ in range(20)))
    finally:
        event.remove(Engine, "before_cursor_execute", count)
    assert {poll.status_code for poll in polls} == {200}
    assert len({poll.content for poll in polls}) == 1 and polls[0].content == complete.content
    assert 1 <= len(heads) < 20
