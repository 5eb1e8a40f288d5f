"""Episodes of agent-driven envs (EnvSpec.driver: verifiers environments), which own their rollout
loop and call the model themselves.

The worker claims such an episode as any other; this runner then gives it a token for its agent
(service/storage/driven.py) and has the env's driver play it in an env worker against the episode's
own OpenAI endpoint (service/agents): every model call is recorded there with exact tokens, resumed
across weight updates and bounded by the episode's limits. The worker keeps the episode's lease and
heartbeats it meanwhile: if this process dies, the driver dies with it, and the lease sweep
re-queues the episode as a new attempt, which voids the token. It finishes the episode as that
endpoint's `/finish` does, in this process (no HTTP round trip to itself), with the driver's reward
and info, or its error (never a reward of 0), fenced on the token. Other envs run the service's own
loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay

from service.envs.base import DriveOutcome, DriveRequest
from service.envs.errors import EnvError, EnvWorkerCrashed
from service.records import DEADLINE_NOTE, Ending, EpisodeResult, EpisodeSpec, EpisodeStatus
from service.retries import backoff, first_then_retrying
from service.storage.db import Database
from service.storage.driven import HandedOver, hand_to_agent
from service.storage.errors import is_refused, is_transient

logger = logging.getLogger(__name__)

FINISH_BACKOFF_SECONDS = 0.2  # first delay between tries of a driven episode's finish; doubles, jittered
FINISH_BACKOFF_MAX_SECONDS = 2.0
FINISH_RETRY_SECONDS = 300.0  # tries for this long
NO_SERVICE_URL = "SERVICE_URL is not set: the driver has no endpoint to call the model at"


class Runner(Protocol):
    # The newest weight version (a number) its episodes sampled from; the worker shares it with
    # the service's other processes and sets what they saw (max_staleness is the service's bound).
    newest_version: int | None

    async def run(self, spec: EpisodeSpec) -> EpisodeResult | None: ...


class Drivers(Protocol):
    def driven(self, env_name: str) -> bool: ...

    async def drive(self, env_name: str, request: DriveRequest) -> DriveOutcome: ...


class Finish(Protocol):
    async def __call__(self, episode_id: str, ending: Ending, token: str) -> None:
        """Ends a handed-over episode as its agent's `/finish` does, if `token` is still its own
        (nothing if it ended already, or was re-queued)."""


class DrivingRunner:
    """`inner` for every env but agent-driven ones, which it hands over to their driver: `run`
    answers None for those (the worker stores nothing; the episode's endpoint has it)."""

    def __init__(
        self,
        inner: Runner,
        drivers: Drivers,
        database: Database,
        *,
        service_url: Callable[[], str | None],
        finish: Finish,
    ) -> None:
        self.inner = inner
        self.drivers = drivers
        self.database = database
        self.service_url = service_url  # SERVICE_URL, read at each handover
        self.finish = finish
        # Told the episode's id as its finish starts: the worker must not cancel it halfway (a
        # lost lease, a cancelled batch: the finish's fence has them).
        self.on_finishing: Callable[[str], None] = lambda episode_id: None
        # Told each attempt handed over, before its driver starts: the agents' endpoint holds the
        # episode, so that its first call need not read it back.
        self.on_handed_over: Callable[[EpisodeSpec, HandedOver], None] = lambda spec, handed: None

    @property
    def newest_version(self) -> int | None:  # its own loop's: drivers' calls go through agents' endpoint
        return self.inner.newest_version

    @newest_version.setter
    def newest_version(self, version: int | None) -> None:
        self.inner.newest_version = version

    async def run(self, spec: EpisodeSpec) -> EpisodeResult | None:
        request = spec.request
        if not self.drivers.driven(request.env):
            return await self.inner.run(spec)
        handed = await hand_to_agent(self.database, spec.episode_id, spec.attempt)
        if handed is None:
            return None  # cancelled, or no longer this attempt's: nothing to do
        token = handed.token
        self.on_handed_over(spec, handed)
        service_url = self.service_url()
        if service_url is None:
            outcome = DriveOutcome(None, error=NO_SERVICE_URL, env_error=False)
            await self._finish(spec.episode_id, token, outcome)
            return None
        drive = DriveRequest(
            base_url=f"{service_url.rstrip('/')}/v1/episodes/{spec.episode_id}",
            api_key=token,
            task_split=request.task_split,
            task_index=request.task_index,
            max_turns=request.max_turns,
            episode_key=spec.key,
        )
        timeout = request.episode_timeout_seconds
        try:
            async with asyncio.timeout(timeout):
                outcome = await self.drivers.drive(request.env, drive)
        except TimeoutError:
            note = f"{DEADLINE_NOTE}: still running after {timeout:g} s (driver)"
            outcome = DriveOutcome(None, error=note, truncated=True)
        except EnvWorkerCrashed as error:
            outcome = DriveOutcome(None, error=f"{error.what}: {error}", env_error=False)
        except EnvError as error:
            failure = f"env driver failed: {error}"
            outcome = DriveOutcome(None, error=failure, env_error=not error.infrastructure)
        await self._finish(spec.episode_id, token, outcome)
        return None

    async def _finish(self, episode_id: str, token: str, outcome: DriveOutcome) -> None:
        self.on_finishing(episode_id)
        if outcome.truncated:
            status = EpisodeStatus.TRUNCATED
        elif outcome.error is None:
            status = EpisodeStatus.COMPLETED
        else:
            status = EpisodeStatus.ABORTED if outcome.env_error else EpisodeStatus.FAILED
        if outcome.error is None:
            ending = Ending(status, outcome.reward, outcome.info)
        else:
            ending = Ending(status, None, outcome.info, outcome.error[:10_000])
        try:
            await self._finish_with_retries(episode_id, token, ending)
        except Exception as failure:
            if not is_refused(failure):
                raise
            # What the driver said cannot be stored (checked in the env worker; this is the rest):
            # the episode fails saying so, never rewarded.
            logger.error("driven episode %s: its ending cannot be stored: %s", episode_id, failure)
            refused = f"the driver's ending could not be stored: {failure}"[:2000]
            await self._finish_with_retries(episode_id, token, Ending(EpisodeStatus.FAILED, error=refused))

    async def _finish_with_retries(self, episode_id: str, token: str, ending: Ending) -> None:
        """Through a database outage, as the worker holds a result (past FINISH_RETRY_SECONDS the
        error goes to the worker, which stores the episode failed with it, never rewarded). Its
        retrying object is built only if the first try fails (first_then_retrying)."""

        def retrying() -> AsyncRetrying:
            return AsyncRetrying(
                retry=retry_if_exception(is_transient),
                wait=backoff(FINISH_BACKOFF_SECONDS, FINISH_BACKOFF_MAX_SECONDS),
                stop=stop_after_delay(FINISH_RETRY_SECONDS),
                reraise=True,
            )

        await first_then_retrying(lambda: self.finish(episode_id, ending, token), retrying)
