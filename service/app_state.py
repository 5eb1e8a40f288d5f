"""The resources one app owns, built by its lifespan and handed to the routes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from service.config import Settings
from service.engine.client import SGLangClient
from service.envs.base import EnvSpec
from service.metrics import Metrics
from service.storage.db import Database
from service.worker.worker import EpisodeWorker


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
class Services:
    """What the lifespan builds, whole, and the routes use; one per app."""

    settings: Settings
    database: Database
    engine: SGLangClient
    envs: dict[str, EnvSpec]
    metrics: Metrics
    results: ResultsSignal  # fires whenever this process stores a result
    shutting_down: asyncio.Event  # set when the server was told to stop: long-polls return at once
    worker: EpisodeWorker | None  # None when this process only serves the API (RUN_WORKER=false)
