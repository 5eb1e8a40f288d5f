"""One service group for a trainer that asks for a prompt's samples one call each, all at once.

AReaL (GroupedRolloutWorkflow) and OpenRLHF (RolloutRayActor.generate_responses) run a prompt's
`n` samples as `asyncio.gather` of `n` calls of the same function with the same prompt: each call
wants one sample, and none is told `n`. Those calls start in the same turn of the event loop, so
the first call of a prompt waits one turn for its siblings, runs one group of as many samples as
came, and each call takes its own row. The service then keeps them as one group, and its groups
stream, reward and GRPO bookkeeping see the prompt's samples together.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

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
