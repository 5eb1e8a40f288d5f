"""What follows an episode's end in this process, however it ended (its result stored, its agent's
finish, its batch cancelled): the metrics count it, its group may be complete (the group log checks),
and the long-polls waiting on results wake."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from service.metrics import Metrics
from service.records import EpisodeResult, EpisodeStatus
from service.storage.groups import GroupKey
from service.storage.queue import ClaimedEpisode
from service.worker.group_log import GroupLog


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


@dataclass(frozen=True)
class Endings:
    metrics: Metrics
    group_log: GroupLog
    results: ResultsSignal

    def result_stored(self, claim: ClaimedEpisode, result: EpisodeResult) -> None:
        """The worker's: `claim`'s final result is stored."""
        self.metrics.episode_finished(result)
        self._ended(groups=[(claim.batch_id, claim.group_index)])

    def agent_finished(self, group: GroupKey, status: EpisodeStatus) -> None:
        self.metrics.agent_finished(status)
        self._ended(groups=[group])

    def batch_cancelled(self, batch_id: str, queued: int, running: int) -> None:
        self.metrics.episodes_cancelled(queued, running)
        self._ended(batches=[batch_id])

    def _ended(self, groups: Iterable[GroupKey] = (), batches: Iterable[str] = ()) -> None:
        self.group_log.touch(groups, batches)
        self.results.notify()  # long-polls of these batches: they may be complete now
