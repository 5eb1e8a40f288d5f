"""One service group for a trainer that asks for a prompt's samples one call each, all at once.

AReaL (GroupedRolloutWorkflow) and OpenRLHF (RolloutRayActor.generate_responses) run a prompt's
`n` samples as `asyncio.gather` of `n` calls of the same function with the same prompt: each call
wants one sample, and none is told `n`. Those calls start in the same turn of the event loop, so
the first call of a prompt waits one turn for its siblings, runs one group of as many samples as
came, and each call takes its own row. The service then keeps them as one group, and its groups
stream, reward and GRPO bookkeeping see the prompt's samples together. Each group is a batch of its
own; GroupWaiter takes them all from one GET /groups long-poll.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from rollout_client.batch import EpisodeArrays
from rollout_client.client import AsyncRolloutClient
from rollout_client.steps import (
    GROUPS_PER_PAGE,
    GROUPS_WAIT_SECONDS,
    StepBatch,
    StepCounts,
    cancel_once_submitted,
)

Row = TypeVar("Row")


@dataclass
class _Gathering(Generic[Row]):
    result: asyncio.Future[list[Row]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    calls: int = 1


class SiblingCalls(Generic[Row]):
    """`await siblings.row(key, run)`: this call's row of the group `run(size)` returns, where
    `size` is how many calls of `key` started in this turn of the loop."""

    def __init__(self) -> None:
        self._gathering: dict[Hashable, _Gathering[Row]] = {}

    async def row(self, key: Hashable, run: Callable[[int], Awaitable[list[Row]]]) -> Row:
        gathering = self._gathering.get(key)
        if gathering is not None:  # a sibling of a call that is still gathering: take the next row
            index = gathering.calls
            gathering.calls += 1
            rows = await asyncio.shield(gathering.result)
            return rows[index]
        gathering = _Gathering()
        self._gathering[key] = gathering
        try:
            try:
                await asyncio.sleep(0)  # the siblings' first steps run in this turn, after this call's
            finally:
                del self._gathering[key]
            rows = await run(gathering.calls)
        except BaseException as error:
            if isinstance(error, asyncio.CancelledError):
                gathering.result.cancel()
            else:
                gathering.result.set_exception(error)
            raise
        if len(rows) != gathering.calls:
            raise RuntimeError(f"a group of {gathering.calls} calls got {len(rows)} rows")
        gathering.result.set_result(rows)
        return rows[0]


class GroupWaiter:
    """Every group an adapter's process waits on, from one GET /groups long-poll (the filter names
    all their batches): a trainer that asks per prompt has many batches in flight at once, and a
    long-poll each would hold that many of the service's requests (and database reads). A new
    batch interrupts the poll in flight, which did not name it; the cursor moves only past a page
    read while no batch was added, so that no group is skipped."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url, self.api_key = url, api_key
        self.loop = asyncio.get_running_loop()  # its futures and its poll live in this loop
        self._waiting: dict[str, tuple[StepBatch, asyncio.Future[list[EpisodeArrays]]]] = {}
        self._added = asyncio.Event()
        self._cursor = 0
        self._polling: asyncio.Task[None] | None = None

    async def group(
        self, client: AsyncRolloutClient, step: StepBatch, counts: StepCounts
    ) -> list[EpisodeArrays]:
        """Submits the one-group batch `step` and returns its group once complete; if cancelled, the
        batch is cancelled in the service."""
        submitting = asyncio.ensure_future(client.submit(step.env, step.tasks, **step.submit_fields()))
        try:
            await asyncio.shield(submitting)
            result: asyncio.Future[list[EpisodeArrays]] = asyncio.get_running_loop().create_future()
            self._waiting[step.batch_id] = (step, result)
            self._added.set()
            if self._polling is None or self._polling.done():
                self._polling = asyncio.create_task(self._poll())
            episodes = await asyncio.shield(result)
        except asyncio.CancelledError:
            self._waiting.pop(step.batch_id, None)
            await asyncio.shield(cancel_once_submitted(client, submitting, step.batch_id))
            raise
        counts.count(episodes)
        return episodes

    async def _poll(self) -> None:
        async with AsyncRolloutClient(self.url, self.api_key) as client:
            while self._waiting:
                self._added.clear()
                batch_ids = list(self._waiting)[:GROUPS_PER_PAGE]
                reading = asyncio.ensure_future(
                    client.groups(self._cursor, GROUPS_PER_PAGE, GROUPS_WAIT_SECONDS, batch_id=batch_ids)
                )
                added = asyncio.ensure_future(self._added.wait())
                try:
                    await asyncio.wait({reading, added}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    added.cancel()
                    if not reading.done():
                        reading.cancel()  # a new batch (read again, naming it), or the loop's end
                if not reading.done():
                    continue
                try:
                    page = reading.result()
                except Exception as error:  # the client's retries are spent: every waiter fails
                    for _, result in self._waiting.values():
                        result.set_exception(error)
                    self._waiting.clear()
                    continue
                for (batch, group), episodes in page.groups().items():
                    if batch not in self._waiting or group != 0:
                        continue
                    step, result = self._waiting.pop(batch)
                    if len(episodes) != step.samples:
                        result.set_exception(RuntimeError(
                            f"batch {batch} came back with {len(episodes)} episodes, not {step.samples}"
                        ))  # fmt: skip
                    else:
                        result.set_result(episodes)
                if not self._added.is_set():
                    self._cursor = page.next
            # No await since `self._waiting` was found empty: a batch added from here on starts a
            # new poll (this one still closes its client).
            self._polling = None


class LoopWaiter:
    """The GroupWaiter of the running event loop (a trainer may run each rollout in a new loop)."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url, self.api_key = url, api_key
        self._waiter: GroupWaiter | None = None

    def __call__(self) -> GroupWaiter:
        if self._waiter is None or self._waiter.loop is not asyncio.get_running_loop():
            self._waiter = GroupWaiter(self.url, self.api_key)
        return self._waiter
