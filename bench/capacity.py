"""How far one PostgreSQL carries: the database work per turn and per episode, with 1, 2 and 4
service processes on it, and the projection it gives.

Each run starts `python -m service serve --workers N` on a fresh PostgreSQL database against one
simulated SGLang worker (its own process, a fixed latency per /generate), submits one batch of
builtin/shop episodes (2,000 in flight by default) and long-polls it to completion. The service
reaches PostgreSQL through a counting TCP proxy in this process that reads the frontend protocol:
statements (Execute and simple Query messages), bytes each way. Beside it: commits and tuples from
pg_stat_database (this database only, so other work on the server is not counted), and the CPU of
the PostgreSQL backends that served this database (/proc, sampled while their connections live).

The projection: the database's work (statements, bytes, commits, its CPU) is fitted over the runs as
so much per episode plus so much per second of each service process (lease renewals and claim polls
cost whether episodes run or not). A process running flat out (its least CPU per turn measured here)
then costs the server so many cores; `--pg-cores` at `--pg-utilisation` carries that many processes
and their turns/s. The assumptions are printed with the figures.

Run from the repo root:
    .venv/bin/python bench/capacity.py [--episodes 2000] [--latency 0.5] [--processes 1 2 4]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import numpy

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    POSTGRES_HOST,
    SHOP_TEST_TASKS,
    fresh_database,
    serve_process,
    sim_worker,
    submit_and_wait,
)
from bench.workers import machine_cpu_seconds, process_tree_cpu_seconds  # noqa: E402

CHUNK_BYTES = 65536
SSL_REQUEST, GSSENC_REQUEST = 80877103, 80877104  # untyped start-up messages before the real one
STATEMENT_MESSAGES = {ord("E"), ord("Q")}  # Execute (extended protocol), Query (simple)
BACKEND_SAMPLE_SECONDS = 0.5
# The projection's defaults: a dedicated database server, and how busy it may run.
PG_CORES = 16
PG_UTILISATION = 0.7


@dataclass
class Traffic:
    connections: int = 0
    statements: int = 0
    parses: int = 0
    bytes_to_server: int = 0
    bytes_from_server: int = 0


class CountingProxy:
    """A TCP forwarder to PostgreSQL that counts what the service sends and receives (no TLS: the
    service connects with ssl=disable, so the protocol can be read)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.traffic = Traffic()
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._streams: set[asyncio.StreamWriter] = set()  # both ends of every connection open
        self._thread = threading.Thread(target=self._run, name="counting proxy", daemon=True)

    def __enter__(self) -> CountingProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        # The service has stopped by now, but the proxy may not have read the end of each of its
        # connections yet: what is still open is closed here, both ends, before the loop closes.
        # Else the garbage collector closes it: a ResourceWarning, which the suite counts as a
        # failure of whichever test collects it (tests/support/open_connections.py names this one).
        server.close()
        streams = list(self._streams)
        for stream in streams:
            stream.close()
        await asyncio.gather(*(stream.wait_closed() for stream in streams), return_exceptions=True)
        await server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._streams.add(writer)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except BaseException:
            writer.close()
            raise
        self._streams.add(upstream_writer)
        self.traffic.connections += 1
        replies = asyncio.ensure_future(self._from_server(upstream_reader, writer))
        await self._from_client(reader, upstream_writer)
        await replies
        self._streams -= {writer, upstream_writer}

    async def _from_server(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(CHUNK_BYTES):
                self.traffic.bytes_from_server += len(data)
                sink.write(data)
                await sink.drain()
        except OSError:
            pass
        finally:
            sink.close()

    async def _from_client(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        """Forwards message by message: untyped start-up messages, then typed ones."""
        started = False
        try:
            while True:
                if not started:
                    head = await source.readexactly(8)
                    length, code = struct.unpack("!II", head)
                    body = await source.readexactly(length - 8)
                    started = code not in (SSL_REQUEST, GSSENC_REQUEST)
                    message = head + body
                else:
                    head = await source.readexactly(5)
                    kind, length = head[0], struct.unpack("!I", head[1:])[0]
                    message = head + await source.readexactly(length - 4)
                    if kind in STATEMENT_MESSAGES:
                        self.traffic.statements += 1
                    elif kind == ord("P"):
                        self.traffic.parses += 1
                self.traffic.bytes_to_server += len(message)
                sink.write(message)
                await sink.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            sink.close()


async def database_stats(database: str) -> dict[str, int]:
    connection = await asyncpg.connect(f"postgresql://{POSTGRES_HOST}/{database}")
    try:
        await connection.execute("SELECT pg_stat_clear_snapshot()")
        row = await connection.fetchrow(
            "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted, tup_returned, "
            "tup_fetched, blks_hit, blks_read FROM pg_stat_database WHERE datname = $1",
            database,
        )
        return dict(row) if row else {}
    finally:
        await connection.close()


class BackendCpu(threading.Thread):
    """CPU seconds of the PostgreSQL backends serving one database: their pids from pg_stat_activity,
    each one's CPU from /proc, kept at the last reading while it lives (run on the server's host)."""

    def __init__(self, database: str) -> None:
        super().__init__(name="backend cpu", daemon=True)
        self.database = database
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        asyncio.run(self._sample())

    async def _sample(self) -> None:
        connection = await asyncpg.connect(f"postgresql://{POSTGRES_HOST}/postgres")
        try:
            while not self.stopped.is_set():
                rows = await connection.fetch(
                    "SELECT pid FROM pg_stat_activity WHERE datname = $1", self.database
                )
                for row in rows:
                    cpu = process_tree_cpu_seconds(row["pid"])
                    self.first.setdefault(row["pid"], cpu)
                    self.last[row["pid"]] = cpu
                await asyncio.sleep(BACKEND_SAMPLE_SECONDS)
        finally:
            await connection.close()

    def seconds(self) -> float:
        return sum(self.last[pid] - self.first[pid] for pid in self.last)


@contextmanager
def sampling_backends(database: str) -> Iterator[BackendCpu]:
    sampler = BackendCpu(database)
    sampler.start()
    try:
        yield sampler
    finally:
        sampler.stopped.set()
        sampler.join(10)


def run_once(
    processes: int, episodes: int, sim: tuple[str, int], tmp: Path, max_wall: float
) -> dict[str, Any]:
    sim_url, sim_pid = sim
    samples = max(1, episodes // SHOP_TEST_TASKS)
    tasks = min(episodes, SHOP_TEST_TASKS)
    host, _, pg_port = POSTGRES_HOST.rpartition("@")[2].partition(":")
    with (
        fresh_database("postgres", tmp, migrate=True) as direct_url,
        CountingProxy((host, int(pg_port))) as proxy,
    ):
        database = direct_url.rsplit("/", 1)[1]
        user = POSTGRES_HOST.partition("@")[0]
        proxied = f"postgresql+asyncpg://{user}@127.0.0.1:{proxy.port}/{database}?ssl=disable"
        bound = str(max(episodes, 2048))
        with serve_process(
            proxied, sim_url, tmp, options=("--workers", str(processes)), processes=processes,
            LOG_LEVEL="INFO", ENV_EXECUTOR="thread", ENV_WORKERS="2",
            MAX_RUNNING_EPISODES=bound, MAX_INFLIGHT_GENERATES=bound,
        ) as served:  # fmt: skip
            with sampling_backends(database) as backends:
                time.sleep(2 * BACKEND_SAMPLE_SECONDS)  # the pools' connections seen before the clock starts
                stats0 = asyncio.run(database_stats(database))
                traffic0 = Traffic(**asdict(proxy.traffic))
                cpu0, sim_cpu0 = process_tree_cpu_seconds(served.pid), process_tree_cpu_seconds(sim_pid)
                machine0 = machine_cpu_seconds()
                load = os.getloadavg()[0]
                started = time.perf_counter()
                batch = submit_and_wait(served.url, tasks, samples, max_wall)
                wall = time.perf_counter() - started
                cpu = process_tree_cpu_seconds(served.pid) - cpu0
                sim_cpu = process_tree_cpu_seconds(sim_pid) - sim_cpu0
                machine = machine_cpu_seconds() - machine0
                stats = asyncio.run(database_stats(database))
                traffic = proxy.traffic
            pg_cpu = backends.seconds()
        exit_code = served.process.returncode
    turns = sum(episode["num_turns"] or 0 for episode in batch["episodes"])
    finished = batch["finished"]
    delta = {key: stats[key] - stats0.get(key, 0) for key in stats}
    statements = traffic.statements - traffic0.statements
    sent = traffic.bytes_to_server - traffic0.bytes_to_server
    received = traffic.bytes_from_server - traffic0.bytes_from_server
    per_turn = max(turns, 1)
    return {
        "processes": processes,
        "episodes": tasks * samples,
        "finished": finished,
        "complete": batch["complete"],
        "wall_s": round(wall, 2),
        "turns": turns,
        "turns_per_s": round(turns / wall, 1),
        "statements": statements,
        "statements_per_turn": round(statements / per_turn, 2),
        "statements_per_episode": round(statements / max(finished, 1), 1),
        "parses_per_turn": round((traffic.parses - traffic0.parses) / per_turn, 2),
        "bytes_to_db_per_turn": round(sent / per_turn),
        "bytes_from_db_per_turn": round(received / per_turn),
        "bytes": sent + received,
        "bytes_per_episode": round((sent + received) / max(finished, 1)),
        "commits": delta.get("xact_commit", 0),
        "commits_per_s": round(delta.get("xact_commit", 0) / wall, 1),
        "commits_per_turn": round(delta.get("xact_commit", 0) / per_turn, 3),
        "rollbacks": delta.get("xact_rollback", 0),
        "tuples_written_per_turn": round(
            sum(delta.get(key, 0) for key in ("tup_inserted", "tup_updated", "tup_deleted")) / per_turn, 2
        ),
        "statements_per_s": round(statements / wall, 1),
        "connections": traffic.connections,
        "pg_cpu_s": round(pg_cpu, 2),
        "pg_cpu_ms_per_turn": round(1e3 * pg_cpu / per_turn, 3),
        "service_cpu_s": round(cpu, 1),
        "service_cpu_ms_per_turn": round(1e3 * cpu / per_turn, 2),
        "sim_cpu_s": round(sim_cpu, 1),
        "machine_busy_cores": round(machine / wall, 2),
        "others_busy_cores": round(max(0.0, machine - cpu - sim_cpu - pg_cpu) / wall, 2),
        "load_1m_before": round(load, 2),
        "statuses": {status: count for status, count in batch["counts"].items() if count},
        "exit_code": exit_code,
    }


# Database work that a run's totals are fitted to: per finished episode, and per second of each
# service process (lease renewals, claim polls, sweeps: paid whether episodes run or not).
FITTED = ("statements", "bytes", "commits", "pg_cpu_s")


def fit(runs: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """`key`'s total over the runs, least squares: (per episode, per process-second), neither below 0."""
    rows = [[run["finished"], run["processes"] * run["wall_s"]] for run in runs]
    totals = [run[key] for run in runs]
    (per_episode, per_process_second), *_ = numpy.linalg.lstsq(
        numpy.array(rows), numpy.array(totals), rcond=None
    )
    return max(float(per_episode), 0.0), max(float(per_process_second), 0.0)


def projection(runs: list[dict[str, Any]], pg_cores: float, utilisation: float) -> dict[str, Any]:
    """What one PostgreSQL of `pg_cores` carries at `utilisation`: each service process running flat
    out (its least CPU per turn measured) costs the database its episodes' work plus its own per-second
    work (the fit over the runs); the processes that fill the server, and their turns/s."""
    fits = {key: fit(runs, key) for key in FITTED}
    turns_per_episode = sum(run["turns"] for run in runs) / max(sum(run["finished"] for run in runs), 1)
    service_ms = min(run["service_cpu_ms_per_turn"] for run in runs)
    process_turns_per_s = 1e3 / service_ms
    process_episodes_per_s = process_turns_per_s / turns_per_episode

    def per_process(key: str) -> float:  # per second, of one process running flat out
        per_episode, per_second = fits[key]
        return process_episodes_per_s * per_episode + per_second

    processes = pg_cores * utilisation / max(per_process("pg_cpu_s"), 1e-9)
    return {
        "pg_cores": pg_cores,
        "pg_utilisation": utilisation,
        "fit_per_episode": {key: round(fits[key][0], 6) for key in FITTED},
        "fit_per_process_second": {key: round(fits[key][1], 6) for key in FITTED},
        "turns_per_episode": round(turns_per_episode, 2),
        "service_cpu_ms_per_turn": service_ms,
        "turns_per_s_per_service_process": round(process_turns_per_s),
        "pg_cores_per_service_process": round(per_process("pg_cpu_s"), 4),
        "service_processes_one_pg_carries": round(processes),
        "turns_per_s_one_pg_carries": round(processes * process_turns_per_s),
        "commits_per_s_at_that_rate": round(processes * per_process("commits")),
        "statements_per_s_at_that_rate": round(processes * per_process("statements")),
        "mb_per_s_at_that_rate": round(processes * per_process("bytes") / 1e6, 1),
        "connections_at_that_rate": "processes x (DATABASE_POOL_SIZE + DATABASE_MAX_OVERFLOW)",
        "assumptions": [
            "the database's work is per episode plus per second of each process, as fitted over the runs",
            f"a dedicated server of {pg_cores:g} cores is used to {utilisation:.0%} by the service",
            "the disk keeps up with the commit rate (group commit: one WAL flush per writer batch)",
            "a service process runs one core flat out at its least measured CPU per turn; the engine is "
            "elsewhere",
            "episodes like builtin/shop's (about 5 turns, a few hundred tokens each); longer ones write "
            "more bytes per episode",
        ],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=2000, help="in flight at once (one batch)")
    parser.add_argument("--latency", type=float, default=0.5, help="seconds per /generate")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--max-wall", type=float, default=900.0)
    parser.add_argument("--pg-cores", type=float, default=PG_CORES)
    parser.add_argument("--pg-utilisation", type=float, default=PG_UTILISATION)
    parser.add_argument(
        "--quick", action="store_true", help="100 episodes, 0.05 s latency, 1 and 2 processes"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.episodes, args.latency, args.processes = 100, 0.05, [1, 2]
    measured_at = datetime.now(UTC).isoformat(timespec="seconds")
    with (
        tempfile.TemporaryDirectory(prefix="bench-capacity-") as tmp,
        sim_worker(args.latency, Path(tmp)) as sim,
    ):
        runs = [
            run_once(processes, args.episodes, sim, Path(tmp), args.max_wall) for processes in args.processes
        ]
    result: dict[str, Any] = {
        "bench": "capacity",
        "measured_at": measured_at,
        "database": "postgres",
        "latency_s": args.latency,
        "cpus": os.cpu_count(),
        "runs": runs,
        # The same-run baseline: each figure per turn against the one-process run's.
        "per_turn_vs_one_process": {
            key: [round(run[key] / max(runs[0][key], 1e-9), 2) for run in runs]
            for key in (
                "statements_per_turn",
                "bytes_to_db_per_turn",
                "commits_per_turn",
                "pg_cpu_ms_per_turn",
            )
        },
        "projection": projection(runs, args.pg_cores, args.pg_utilisation),
    }
    for run in runs:
        print(
            f"{run['processes']} processes: {run['finished']}/{run['episodes']} episodes, "
            f"{run['turns']} turns in {run['wall_s']} s ({run['turns_per_s']} turns/s); "
            f"per turn {run['statements_per_turn']} statements, "
            f"{run['bytes_to_db_per_turn']} B to and {run['bytes_from_db_per_turn']} B from the database, "
            f"{run['commits_per_turn']} commits, PostgreSQL CPU {run['pg_cpu_ms_per_turn']} ms; "
            f"{run['commits_per_s']} commits/s; service CPU {run['service_cpu_ms_per_turn']} ms a turn; "
            f"cores busy {run['machine_busy_cores']} ({run['others_busy_cores']} others')"
        )
    plan = result["projection"]
    print(
        f"projection: one PostgreSQL of {plan['pg_cores']:g} cores at {plan['pg_utilisation']:.0%} carries "
        f"{plan['turns_per_s_one_pg_carries']} turns/s, {plan['service_processes_one_pg_carries']} service "
        f"processes at {plan['turns_per_s_per_service_process']} turns/s each"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
