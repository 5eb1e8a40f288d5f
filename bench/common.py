"""What the benchmarks share: the simulated SGLang worker and `serve` as processes, fresh databases,
CPU accounting from /proc, and percentiles. Run the benches from the repo root."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import httpx

from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[1]
POSTGRES_HOST = os.environ.get("BENCH_POSTGRES_HOST", "postgres@127.0.0.1:5432")
START_TIMEOUT_SECONDS = 120.0
STOP_TIMEOUT_SECONDS = 60.0
SHOP_TEST_TASKS = 50  # builtin/shop's test split
HEALTH_INTERVAL_SECONDS = 0.2
LONG_POLL_SECONDS = 300.0  # the service's MAX_LONG_POLL_SECONDS
T = TypeVar("T")


def shop_oracle_without_rambles(prompt_text: str, key: str) -> str:
    """The simulated worker's builtin/shop oracle (with its mistakes) less its rambling turns, for a
    `sim_worker(..., ("--policy", "bench.common:shop_oracle_without_rambles"))`: no response is cut
    at a cap, whatever the caps."""
    from service.sim.policy import SimConfig, policy_reply

    return policy_reply(prompt_text, key, SimConfig(ramble_rate=0.0))[0]


def wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not healthy after {START_TIMEOUT_SECONDS} s")
        time.sleep(0.2)


def submit_and_wait(url: str, tasks: int, samples: int, max_wall: float) -> dict[str, Any]:
    """POSTs a batch of builtin/shop episodes and long-polls it, as a trainer does, until it is
    complete or `max_wall` seconds have passed; the batch as last read."""
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=LONG_POLL_SECONDS + 60) as http:
        response = http.post(
            "/episodes",
            json={
                "env": "builtin/shop",
                "task_split": "test",
                "task_indices": list(range(tasks)),
                "samples_per_task": samples,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 256},
                "max_turns": 12,
            },
        )
        response.raise_for_status()
        batch_id = response.json()["batch_id"]
        batch: dict[str, Any] = {"complete": False}
        while not batch["complete"] and time.perf_counter() - started < max_wall:
            wait = min(LONG_POLL_SECONDS, max(0.1, max_wall - (time.perf_counter() - started)))
            polled = http.get(f"/batches/{batch_id}", params={"wait": wait})
            polled.raise_for_status()
            batch = polled.json()
    return batch


def launch(arguments: Sequence[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`python <arguments>` from the repo root in a process group of its own, its output to `log`.
    (The benches' smoke tests fork their `-m service` ones from a preloaded process instead:
    tests/test_bench_smoke.py.)"""
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, *arguments], cwd=REPO, env=env, stdout=out, stderr=out, start_new_session=True
        )


def stop(process: subprocess.Popen[bytes]) -> int:
    """SIGTERM, then SIGKILL to its process group if it does not exit in time."""
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


@contextmanager
def sim_worker(latency: float, log_dir: Path, options: tuple[str, ...] = ()) -> Iterator[tuple[str, int]]:
    """`python -m service sim-worker` in its own process (with more `options`): its URL and pid."""
    port = free_port()
    log = log_dir / f"sim-{port}.log"
    arguments = ["-m", "service", "sim-worker", "--port", str(port), "--latency", str(latency), *options]
    process = launch(arguments, {**os.environ, "LOG_LEVEL": "WARNING"}, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, log)
        yield url, process.pid
    finally:
        stop(process)


def started_processes(log: Path) -> int:
    """How many of `serve`'s processes have started, from its INFO log."""
    return log.read_text(errors="replace").count('"message": "Application startup complete."')


@dataclass(frozen=True)
class ServeProcess:
    """A running `python -m service serve`: its URL, process and log file."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def error_log_lines(self) -> int:
        return sum(1 for line in self.log.read_text(errors="replace").splitlines() if '"ERROR"' in line)


@contextmanager
def serve_process(
    database_url: str,
    sglang_url: str,
    log_dir: Path,
    *,
    options: Sequence[str] = (),
    processes: int = 1,
    launcher: Sequence[str] = ("-m", "service"),
    **environment: str,
) -> Iterator[ServeProcess]:
    """`python <launcher> serve --port <free port> <options>` in its own process (group), on
    `database_url` with the engine at `sglang_url`, no API keys, LOG_LEVEL=WARNING, and `environment`
    on top; yielded once healthy and, if `processes` > 1, once that many of its processes have
    started (read from its log: LOG_LEVEL=INFO). Stopped on the way out: its exit code is then
    `.process.returncode`."""
    port = free_port()
    log = log_dir / f"serve-{port}.log"
    env = {**os.environ, "DATABASE_URL": database_url, "SGLANG_URL": sglang_url, "API_KEYS": "",
           "LOG_LEVEL": "WARNING", **environment}  # fmt: skip
    process = launch([*launcher, "serve", "--port", str(port), *options], env, log)
    served = ServeProcess(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_healthy(served.url, process, log)
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while processes > 1 and started_processes(log) < processes:  # all up before any clock starts
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"{processes} processes did not start:\n{log.read_text()[-3000:]}")
            time.sleep(HEALTH_INTERVAL_SECONDS)
        yield served
    finally:
        stop(process)


@contextmanager
def fresh_database(kind: str, tmp: Path, *, migrate: bool = False) -> Iterator[str]:
    """A new database, a SQLite file in `tmp` or a PostgreSQL database dropped afterwards; migrated
    to head if `migrate` (`serve` migrates SQLite itself, PostgreSQL with --migrate)."""
    if kind == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp / f'bench-{uuid.uuid4().hex[:8]}.db'}"
    else:
        name = f"bench_{uuid.uuid4().hex[:12]}"
        asyncio.run(postgres_admin(f"CREATE DATABASE {name}"))
        url = f"postgresql+asyncpg://{POSTGRES_HOST}/{name}"
    try:
        if migrate:
            from service.storage.db import run_migrations

            run_migrations(url)
        yield url
    finally:
        if kind != "sqlite":
            asyncio.run(postgres_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


async def postgres_admin(statement: str) -> None:
    connection = await asyncpg.connect(f"postgresql://{POSTGRES_HOST}/postgres")
    try:
        await connection.execute(statement)
    finally:
        await connection.close()


def cpu_seconds_of(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc); 0.0 elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    """p50, p99 and max of durations in seconds, in milliseconds, and how many there were."""
    if not seconds:
        return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0, "samples": 0}
    ordered = sorted(seconds)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return {
        "p50_ms": round(pct(0.50), 2),
        "p99_ms": round(pct(0.99), 2),
        "max_ms": round(ordered[-1] * 1e3, 2),
        "samples": len(ordered),
    }


def run_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """On uvloop where it is installed, as `python -m service serve` runs (uvicorn's default)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


class HealthProbe(threading.Thread):
    """GET /health every HEALTH_INTERVAL_SECONDS on its own connection, as an orchestrator's
    liveness probe does: latencies and failures."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.latencies: list[float] = []
        self.errors: Counter[str] = Counter()
        self.done = threading.Event()
        self.cpu_seconds = 0.0  # this thread's own CPU, once it ended: a bench in-process subtracts it

    def run(self) -> None:
        try:
            self._probe()
        finally:
            self.cpu_seconds = time.thread_time()

    def _probe(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as http:
            while not self.done.is_set():
                started = time.perf_counter()
                try:
                    if (status := http.get("/health").status_code) != 200:
                        self.errors[str(status)] += 1
                except httpx.HTTPError as error:
                    self.errors[type(error).__name__] += 1
                self.latencies.append(time.perf_counter() - started)
                self.done.wait(HEALTH_INTERVAL_SECONDS)

    def stats(self) -> dict[str, Any]:
        self.done.set()
        self.join()
        figures = percentiles_ms(self.latencies)
        return {"health_p50_ms": figures["p50_ms"], "health_p99_ms": figures["p99_ms"],
                "health_max_ms": figures["max_ms"], "health_probes": figures["samples"],
                "health_errors": dict(self.errors)}  # fmt: skip
