"""One service batch per trainer step, for a trainer that asks for its samples one call each.

AReaL (GroupedRolloutWorkflow) and OpenRLHF (RolloutRayActor.generate_responses) run a prompt's
`n` samples as `asyncio.gather` of `n` calls of the same function with the same prompt, and a
step's prompts all at once (AReaL's rollout_batch, OpenRLHF's dispatch of a step's prompts to its
actors): each call wants one sample, and none is told `n` or the step. StepCalls coalesces them:
the calls that arrive within `window` seconds of a window's first call are one service batch
(split only where the service needs it: a batch has one group size and one set of sampling params,
and at most MAX_EPISODES_PER_BATCH episodes); the calls of one prompt (one `call_key`) are one
group of it, each call its row. The batch's groups come from one GET /groups long-poll (Arrow) for
all the process's batches (GroupWaiter), never a GET per episode, and each call returns its row as
soon as its group is complete.

Cancellation: a call that is cancelled (the caller's task) gives up its row, and only its row: the
other calls' group and batch go on, and its row is counted (StepCounts.abandoned). A group whose
calls were all cancelled before its window closed is left out of the batch; when every call of a
batch is cancelled, the batch is cancelled in the service (or never submitted, if its window is
still open). A batch that fails (the service refused it, or the client's retries are spent) fails
its calls still waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

from rollout_client.batch import EpisodeArrays
from rollout_client.client import AsyncRolloutClient
from rollout_client.steps import (
    DEFAULT_COALESCE_SECONDS,
    GROUPS_PER_PAGE,
    GROUPS_WAIT_SECONDS,
    StepBatch,
    StepCounts,
    batch_id,
    cancel_once_submitted,
)

Row = TypeVar("Row")
MAX_EPISODES_PER_BATCH = 10_000  # the service's default max_episodes_per_request
# A group's rows from its episodes: `wanted` are the sample indices whose calls still wait.
Convert = Callable[[list[EpisodeArrays], list[int]], list[Row]]


@dataclass(frozen=True)
class GroupAsk(Generic[Row]):
    """What a call asks for: a row of the group of `call_key` (the calls of one prompt share it)."""

    call_key: Hashable
    batch_key: Hashable  # groups with the same one (and size) may share a service batch
    task: int
    label: Any  # what tells this group from another of the same task in a batch id (JSON-able)
    convert: Convert[Row]


@dataclass(eq=False)
class _Call(Generic[Row]):
    result: asyncio.Future[Row]
    group: _Group[Row]
    abandoned: bool = False


@dataclass(eq=False)
class _Group(Generic[Row]):
    ask: GroupAsk[Row]
    owner: _Batch[Row]  # its window's, then its service batch's
    calls: list[_Call[Row]] = field(default_factory=list)


@dataclass(eq=False)
class _Batch(Generic[Row]):
    """A window while it gathers calls, then each service batch it closes into."""

    loop: asyncio.AbstractEventLoop
    groups: list[_Group[Row]] = field(default_factory=list)
    by_key: dict[Hashable, _Group[Row]] = field(default_factory=dict)  # while gathering
    live: int = 0  # calls not cancelled
    timer: asyncio.TimerHandle | None = None
    task: asyncio.Task[None] | None = None  # its submit and its groups' wait, once closed


class StepCalls(Generic[Row]):
    """`await calls.row(ask)`: this call's row of its group, from the batch of the calls that
    arrived within `window` seconds of the first one. `make_step(batch_key, asks, samples)` is the
    service batch of those groups (its id, from the trainer's step, must be the same whenever the
    same calls come again)."""

    def __init__(
        self,
        waiter: LoopWaiter,
        make_step: Callable[[Hashable, list[GroupAsk[Row]], int], StepBatch],
        counts: StepCounts,
        window: float = DEFAULT_COALESCE_SECONDS,
    ) -> None:
        if window < 0:
            raise ValueError(f"the coalescing window is seconds >= 0, not {window}")
        self.waiter, self.make_step, self.counts, self.window = waiter, make_step, counts, window
        self._open: _Batch[Row] | None = None
        self.batches_submitted = 0

    async def row(self, ask: GroupAsk[Row]) -> Row:
        # No await before the call has joined: its siblings must find its group still gathering.
        loop = asyncio.get_running_loop()
        window = self._open
        if window is None or window.loop is not loop:
            window = self._open = _Batch(loop)
            window.timer = loop.call_later(self.window, self._close, window)
        group = window.by_key.get(ask.call_key)
        if group is None:
            group = window.by_key[ask.call_key] = _Group(ask, window)
            window.groups.append(group)
        call: _Call[Row] = _Call(loop.create_future(), group)
        group.calls.append(call)
        window.live += 1
        try:
            return await asyncio.shield(call.result)
        except asyncio.CancelledError:
            if not call.result.done():  # this caller was cancelled: its row only
                self._abandon(call)
            raise

    def _abandon(self, call: _Call[Row]) -> None:
        call.abandoned = True
        call.result.cancel()
        self.counts.abandoned += 1
        owner = call.group.owner
        owner.live -= 1
        if owner.live > 0:
            return
        if owner.timer is not None:  # still gathering: nothing submitted, nothing to run
            owner.timer.cancel()
            owner.timer = None
            if self._open is owner:
                self._open = None
        elif owner.task is not None:
            owner.task.cancel()  # cancels the batch in the service

    def _close(self, window: _Batch[Row]) -> None:
        """The window's calls as service batches: by batch key and group size, in arrival order."""
        window.timer = None
        if self._open is window:
            self._open = None
        parts: dict[tuple[Hashable, int], list[_Group[Row]]] = {}
        for group in window.groups:
            if any(not call.abandoned for call in group.calls):
                parts.setdefault((group.ask.batch_key, len(group.calls)), []).append(group)
        for (batch_key, samples), groups in parts.items():
            per_batch = max(1, MAX_EPISODES_PER_BATCH // samples)
            for start in range(0, len(groups), per_batch):
                batch = _Batch(window.loop, groups[start : start + per_batch])
                for group in batch.groups:
                    group.owner = batch
                    batch.live += sum(not call.abandoned for call in group.calls)
                step = self.make_step(batch_key, [group.ask for group in batch.groups], samples)
                batch.task = window.loop.create_task(self._run(batch, step))
                self.batches_submitted += 1

    async def _run(self, batch: _Batch[Row], unscoped: StepBatch) -> None:
        waiter = self.waiter()
        try:
            async with AsyncRolloutClient(waiter.url, waiter.api_key) as client:
                # In the key's scope: a project key's batch ids start with its prefix (GET /access).
                prefix = (await client.access()).batch_prefix
                step = replace(unscoped, batch_id=batch_id(unscoped.batch_id, prefix=prefix))

                def deliver(index: int, episodes: list[EpisodeArrays]) -> None:
                    self._deliver(batch.groups[index], episodes, step)

                await waiter.batch(client, step, deliver)
        except asyncio.CancelledError:
            raise  # every call was cancelled: nobody waits
        except Exception as error:
            for group in batch.groups:
                self._fail(group, error)

    def _deliver(self, group: _Group[Row], episodes: list[EpisodeArrays], step: StepBatch) -> None:
        if len(episodes) != len(group.calls):
            self._fail(group, RuntimeError(
                f"a group of batch {step.batch_id} came back with {len(episodes)} episodes, not "
                f"{len(group.calls)}"
            ))  # fmt: skip
            return
        self.counts.count(episodes)
        wanted = [index for index, call in enumerate(group.calls) if not call.abandoned]
        try:
            rows = group.ask.convert(episodes, wanted)
        except Exception as error:
            self._fail(group, error)
            return
        for index, row in zip(wanted, rows, strict=True):
            if not group.calls[index].result.done():
                group.calls[index].result.set_result(row)

    @staticmethod
    def _fail(group: _Group[Row], error: BaseException) -> None:
        for call in group.calls:
            if not call.result.done():
                call.result.set_exception(error)


@dataclass(eq=False)
class _Watch:
    step: StepBatch
    deliver: Callable[[int, list[EpisodeArrays]], None]
    remaining: set[int]
    done: asyncio.Future[None]


class GroupWaiter:
    """Every group an adapter's process waits on, from one GET /groups long-poll (the filter names
    all their batches): a long-poll per batch would hold that many of the service's requests (and
    database reads). A new batch interrupts the poll in flight, which did not name it; the cursor
    moves only past a page read while no batch was added, and goes back to where it was when the
    batch's POST began, so that no group is skipped."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url, self.api_key = url, api_key
        self.loop = asyncio.get_running_loop()  # its futures and its poll live in this loop
        self._waiting: dict[str, _Watch] = {}
        self._added = asyncio.Event()
        self._cursor = 0
        self._polling: asyncio.Task[None] | None = None

    async def batch(
        self, client: AsyncRolloutClient, step: StepBatch, deliver: Callable[[int, list[EpisodeArrays]], None]
    ) -> None:
        """Submits `step` (idempotent under its id) and hands each of its groups, once complete, to
        `deliver(group_index, episodes)`; returns when every group was handed. If cancelled, the
        batch is cancelled in the service."""
        # Pages read while the POST was in flight (retried, or slow) named other batches only: their
        # `next` may have passed this batch's groups, if they ended by then. Read again from here.
        cursor = self._cursor
        submitting = asyncio.ensure_future(client.submit(step.env, step.tasks, **step.submit_fields()))
        watch: _Watch | None = None
        try:
            await asyncio.shield(submitting)
            watch = _Watch(step, deliver, set(range(len(step.tasks))), self.loop.create_future())
            self._waiting[step.batch_id] = watch
            self._cursor = min(self._cursor, cursor)
            self._added.set()
            if self._polling is None or self._polling.done():
                self._polling = asyncio.create_task(self._poll())
            await asyncio.shield(watch.done)
        except asyncio.CancelledError:
            if watch is None or not watch.done.done():  # a complete batch has nothing to stop
                self._waiting.pop(step.batch_id, None)
                await asyncio.shield(cancel_once_submitted(client, submitting, step.batch_id))
            raise

    async def _poll(self) -> None:
        async with AsyncRolloutClient(self.url, self.api_key) as client:
            while self._waiting:
                self._added.clear()
                batch_ids = list(self._waiting)[:GROUPS_PER_PAGE]
                reading = asyncio.ensure_future(
                    client.groups(
                        self._cursor, GROUPS_PER_PAGE, GROUPS_WAIT_SECONDS,
                        include_cancelled=True, batch_id=batch_ids,
                    )
                )  # fmt: skip
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
                    for watch in self._waiting.values():
                        if not watch.done.done():
                            watch.done.set_exception(error)
                    self._waiting.clear()
                    continue
                for (batch, group), episodes in page.groups().items():
                    watching = self._waiting.get(batch)
                    if watching is None or group not in watching.remaining:
                        continue
                    watching.remaining.discard(group)
                    watching.deliver(group, episodes)
                    if not watching.remaining:
                        del self._waiting[batch]
                        if not watching.done.done():
                            watching.done.set_result(None)
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
