"""The service as a real OS process (`python -m service serve`), for crash, shutdown and multi-process
tests: started in its own session so that it and its env worker processes die together."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

from service.records import FINISHED_STATUSES
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread
from service.storage.db import Database
from service.storage.models import Episode
from tests.support.ports import free_port
from tests.support.settings import TEST_SETTINGS
from tests.support.zygote import ServiceCommand, launch

REPO_DIR = Path(__file__).resolve().parents[2]
# A bound, not a wait: /health is asked every 0.1 s and a process that exits fails at once. Under load
# (2 cores, 2 xdist workers, load 15) `serve --workers 2 --api-processes 1` with two env processes per
# worker took 36 s before uvicorn started and was not healthy at 60 s (test_env_plugins, random-order
# seed 1001): each of its processes imports the service and its env processes the plugins.
STARTUP_TIMEOUT_SECONDS = 180.0
POLL_SECONDS = 0.05
# The settings the service runs with in subprocess tests, as environment variables (keyword
# arguments of `service_process` override them): the tests' own, INFO logs, which the tests read,
# and one env worker process.
SERVICE_ENV: dict[str, object] = {
    **TEST_SETTINGS,
    "log_level": "INFO",
    "env_executor": "process",
    "env_workers": 1,
}


# The sim's mistakes that end an episode before its task's plan does: a malformed tool call aborts
# it, a rambling turn is cut by max_new_tokens and truncates it. A test that needs an episode mid-way
# to have its plan's turns still to go turns them off (the shutdown tests: a drain must outlast one).
PLAN_TO_THE_END = {"malformed_call_rate": 0.0, "ramble_rate": 0.0}


@asynccontextmanager
async def simulated_sglang(latency_seconds: float, **config: Any) -> AsyncIterator[tuple[SimWorker, str]]:
    worker = SimWorker(SimConfig(latency_seconds=latency_seconds, **config))
    with serve_in_thread(create_sim_app(worker.config, worker=worker)) as url:
        yield worker, url


class ServiceProcess:
    """One `python -m service serve` process on a free port; its stderr (JSON log lines) goes to a file."""

    def __init__(self, process: ServiceCommand, url: str, log_path: Path) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                lines.append({"message": line})
        return lines

    def log_tail(self, count: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-count:])

    async def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.url, timeout=2) as http:
            while time.monotonic() < deadline:
                if (code := self.process.poll()) is not None:
                    raise AssertionError(f"service exited with {code}:\n{self.log_tail()}")
                try:
                    if (await http.get("/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError(f"service not healthy after {timeout} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL to the whole process group: the server and its env worker processes."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        """SIGTERM to the server only, as an orchestrator stopping a container sends it."""
        self.process.send_signal(signal.SIGTERM)

    async def wait_exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.process.poll()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"service still running after {timeout} s:\n{self.log_tail(80)}")
            await asyncio.sleep(POLL_SECONDS)
        return code


@asynccontextmanager
async def service_process(
    log_dir: Path,
    database_url: str,
    sglang_url: str,
    name: str = "service",
    *,
    port: int | None = None,
    **settings: object,
) -> AsyncIterator[ServiceProcess]:
    """Starts the service (on `port`, else a free one) with SERVICE_ENV updated by `settings`
    (lower-case setting names) and waits for /health; always kills its process group on exit."""
    port = port or free_port()
    environment = {
        **os.environ,
        "DATABASE_URL": database_url,
        "SGLANG_URL": sglang_url,
        **{key.upper(): str(value) for key, value in (SERVICE_ENV | settings).items()},
    }
    log_path = log_dir / f"{name}-{port}.log"
    process = launch(["serve", "--host", "127.0.0.1", "--port", str(port)], environment, REPO_DIR, log_path)
    service = ServiceProcess(process, f"http://127.0.0.1:{port}", log_path)
    try:
        await service.wait_healthy()
        yield service
    finally:
        service.kill()
        await service.wait_exit(30)


async def wait_for(condition: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(POLL_SECONDS)


async def episodes_of(db: Database, batch_id: str) -> list[Episode]:
    async with db.sessionmaker() as session:
        statement = (
            select(Episode)
            .where(Episode.batch_id == batch_id)
            .order_by(Episode.group_index, Episode.sample_index)
        )
        return list(await session.scalars(statement))


async def wait_batch_finished(db: Database, batch_id: str, timeout: float) -> list[Episode]:
    async def finished() -> bool:
        return all(episode.status in FINISHED_STATUSES for episode in await episodes_of(db, batch_id))

    await wait_for(finished, timeout, f"batch {batch_id} to finish")
    return await episodes_of(db, batch_id)


def in_second_call(sim: SimWorker) -> set[str]:
    """Episodes whose second generate call went out and their third not yet (rid "<id>:<attempt>:<turn>"):
    with PLAN_TO_THE_END, each has its plan's 3 more calls to go."""
    second = {r.rid.split(":")[0] for r in sim.requests if r.rid.endswith(":1")}
    return second - {r.rid.split(":")[0] for r in sim.requests if r.rid.endswith(":2")}


def attempts_seen(sim: SimWorker, episode_id: str) -> set[int]:
    """The attempts of an episode that sent at least one generate call (rid "<id>:<attempt>:<turn>")."""
    return {int(r.rid.split(":")[1]) for r in sim.requests if r.rid.startswith(f"{episode_id}:")}


def submission(batch_id: str, tasks: int, samples: int, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "batch_id": batch_id,
        "env": "builtin/shop",
        "task_split": "test",
        "task_indices": list(range(tasks)),
        "samples_per_task": samples,
        "sampling_params": {"temperature": 0.7, "max_new_tokens": 200},
        "max_turns": 10,
    }
    body.update(overrides)
    return body


async def submit(url: str, batch_id: str, tasks: int, samples: int) -> list[str]:
    """POSTs a builtin/shop batch to a service; its episode ids."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        response = await http.post("/episodes", json=submission(batch_id, tasks, samples))
    assert response.status_code == 202, response.text
    episode_ids: list[str] = response.json()["episode_ids"]
    return episode_ids


@asynccontextmanager
async def generation_held(url: str) -> AsyncIterator[None]:
    """Generation paused at the engine (the service's POST /engine/pause, mode in_place) while the
    block runs: a test that cancels work in flight finds it in flight however fast the machine is
    (a fixed sleep raced the episodes' end)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        assert (await http.post("/engine/pause", json={"mode": "in_place"})).status_code == 200
        try:
            yield
        finally:
            await http.post("/engine/continue")


async def episodes_running(db: Database) -> None:
    async def running() -> bool:
        async with db.sessionmaker() as session:
            return "running" in set(await session.scalars(select(Episode.status)))

    await wait_for(running, 30, "episodes running")
