"""Episodes of agent-driven envs (EnvSpec.driver: verifiers environments), which own their rollout
loop and call the model themselves.

The worker claims such an episode as any other; this runner then hands it over to an agent (a token
of its own, its idle deadline as its lease: service/storage/driven.py) and has the env's driver
play it in an env worker against the episode's own OpenAI endpoint (service/agents): every model
call is recorded there with exact tokens, resumed across weight updates and bounded by the
episode's limits. It finishes the episode through that endpoint's `/finish` with the driver's
reward and info, or its error (never a reward of 0). Other envs run the service's own loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from service.envs.base import DriveOutcome, DriveRequest
from service.envs.errors import EnvError, EnvWorkerCrashed
from service.records import DEADLINE_NOTE, EpisodeResult, EpisodeSpec
from service.storage.db import Database
from service.storage.driven import hand_to_agent

logger = logging.getLogger(__name__)

FINISH_TIMEOUT_SECONDS = 30.0


class Runner(Protocol):
    # The newest weight version (a number) its episodes sampled from; the worker shares it with
    # the service's other processes and sets what they saw (max_staleness is the service's bound).
    newest_version: int | None

    async def run(self, spec: EpisodeSpec) -> EpisodeResult | None: ...


class Drivers(Protocol):
    def driven(self, env_name: str) -> bool: ...

    async def drive(self, env_name: str, request: DriveRequest) -> DriveOutcome: ...


class DrivingRunner:
    """`inner` for every env but agent-driven ones, which it hands over to their driver: `run`
    answers None for those (the worker stores nothing; the episode's endpoint has it)."""

    def __init__(
        self,
        inner: Runner,
        drivers: Drivers,
        database: Database,
        *,
        service_url: Callable[[], str],
        idle_seconds: float,
    ) -> None:
        self.inner = inner
        self.drivers = drivers
        self.database = database
        self.service_url = service_url  # SERVICE_URL, read at each handover
        self.idle_seconds = idle_seconds
        self._http: httpx.AsyncClient | None = None
        # Told the episode's id once it is handed over: the worker no longer holds its lease.
        self.on_handover: Callable[[str], None] = lambda episode_id: None

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
        token = await hand_to_agent(self.database, spec.episode_id, spec.attempt, self.idle_seconds)
        if token is None:
            return None  # cancelled, or no longer this attempt's: nothing to do
        self.on_handover(spec.episode_id)
        base_url = f"{self.service_url().rstrip('/')}/v1/episodes/{spec.episode_id}"
        drive = DriveRequest(
            base_url=base_url,
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
            outcome = DriveOutcome(None, error=f"env worker crashed: {error}", env_error=False)
        except EnvError as error:
            failure = f"env driver failed: {error}"
            outcome = DriveOutcome(None, error=failure, env_error=not error.infrastructure)
        await self._finish(base_url, token, outcome)
        return None

    async def _finish(self, base_url: str, token: str, outcome: DriveOutcome) -> None:
        if outcome.truncated:
            status = "truncated"
        elif outcome.error is None:
            status = "completed"
        else:
            status = "aborted" if outcome.env_error else "failed"
        body: dict[str, Any] = {"status": status, "reward": outcome.reward, "info": outcome.info}
        if outcome.error is not None:
            body["error"] = outcome.error[:10_000]
            body["reward"] = None
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=FINISH_TIMEOUT_SECONDS)
        try:
            answer = await self._http.post(
                f"{base_url}/finish", json=body, headers={"Authorization": f"Bearer {token}"}
            )
        except httpx.HTTPError as error:
            # The episode then fails at its idle deadline (EXTERNAL_IDLE_SECONDS), never rewarded.
            logger.error("finishing driven episode at %s failed: %r", base_url, error)
            return
        if answer.status_code != 200 and answer.status_code != 409:  # 409: it ended already (cancelled)
            logger.error("finishing driven episode at %s: %d %s", base_url, answer.status_code, answer.text)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
