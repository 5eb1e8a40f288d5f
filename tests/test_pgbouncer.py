"""PostgreSQL through a real PgBouncer in transaction mode (Debian's, scripts/ensure_pgbouncer.sh; its
tests skip where it is not installed): with DATABASE_TRANSACTION_POOLER=true the service keeps no
prepared statement across transactions, so a server connection handed from one client to another
never holds a statement name the next one prepares; the migration and its check work through it as
they are; the groups log's advisory lock (pg_advisory_xact_lock) is held by its transaction only."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from service.app import create_app
from service.serving import serve_app
from service.sim.worker import SimWorker
from service.storage.db import Database, check_schema, run_migrations, wait_for_schema
from tests.conftest import service_settings
from tests.support.ports import free_port
from tests.support.service_process import REPO_DIR, submission, wait_batch_finished
from tests.support.settings import CONNECT_TIMEOUT_SECONDS

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
POSTGRES_ONLY = pytest.mark.parametrize("backend", ["postgres"], indirect=True)
pytestmark = [
    POSTGRES_ONLY,
    pytest.mark.skipif(
        not os.access(PGBOUNCER, os.X_OK), reason="PgBouncer is not installed (scripts/ensure_pgbouncer.sh)"
    ),
]
# Fewer server connections than the service's pool holds client connections: every server
# connection serves several clients in turn, the case that breaks kept prepared statements.
SERVER_CONNECTIONS = 2
START_TIMEOUT_SECONDS = 15.0
TASKS, SAMPLES = 6, 2
FINISH_TIMEOUT_SECONDS = 180.0  # a loaded shared machine


def pgbouncer_config(directory: Path, port: int) -> Path:
    url = make_url(
        os.environ.get("ROLLOUT_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    config = directory / "pgbouncer.ini"
    config.write_text(
        "[databases]\n"
        f"* = host={url.host} port={url.port or 5432} user={url.username}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\n"
        "auth_type = any\n"
        "pool_mode = transaction\n"
        f"default_pool_size = {SERVER_CONNECTIONS}\n"
        "max_client_conn = 200\n"
        "unix_socket_dir =\n"
    )
    return config


@pytest.fixture
def pgbouncer(tmp_path: Path) -> Iterator[int]:
    """A PgBouncer in transaction mode in front of the test server, on a free port (its port)."""
    port = free_port()
    config = pgbouncer_config(tmp_path, port)
    # It refuses to run as root: it reads its configuration, then becomes the postgres user.
    command = [PGBOUNCER, *(["-u", "postgres"] if os.geteuid() == 0 else []), str(config)]
    log = (tmp_path / "pgbouncer.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_listening(port, process, tmp_path / "pgbouncer.log")
        yield port
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def wait_listening(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"pgbouncer exited: {log.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"pgbouncer did not listen within {START_TIMEOUT_SECONDS} s: {log.read_text()}")


def through(url: str, port: int) -> str:
    return make_url(url).set(host="127.0.0.1", port=port).render_as_string(hide_password=False)


# One service process (a pod) querying through the pooler: asyncpg names its prepared statements
# by a counter of its own, the same in every process, and by default SQLAlchemy reuses them.
CLIENT = """
import asyncio, sys
from sqlalchemy import text
from service.storage.db import Database

async def main(url: str, pooler: bool, connect_timeout: float) -> None:
    database = Database.open(url, transaction_pooler=pooler, connect_timeout=connect_timeout)
    try:
        async with database.engine.connect() as connection:
            for _ in range(3):
                await connection.execute(text("SELECT count(*) FROM episodes"))
                await connection.commit()
    finally:
        await database.dispose()

asyncio.run(main(sys.argv[1], sys.argv[2] == "true", float(sys.argv[3])))
"""


def run_client(url: str, *, pooler: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CLIENT, url, str(pooler).lower(), str(CONNECT_TIMEOUT_SECONDS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO_DIR,
    )


def test_processes_collide_on_kept_statements_unless_the_setting_is_on(
    database_url: str, pgbouncer: int
) -> None:
    """Two service processes in turn on the pooler's server connection: the second prepares a name
    the first left there. With the setting, every name is unique and none is kept."""
    url = through(database_url, pgbouncer)
    first, second = run_client(url, pooler=False), run_client(url, pooler=False)
    assert first.returncode == 0, first.stderr
    assert second.returncode != 0 and "prepared statement" in second.stderr, second.stderr[-2000:]
    for _ in range(3):
        client = run_client(url, pooler=True)
        assert client.returncode == 0, client.stderr[-2000:]


async def test_migrations_and_the_schema_check_work_through_it(
    empty_database_url: str, pgbouncer: int
) -> None:
    url = through(empty_database_url, pgbouncer)
    assert await asyncio.to_thread(wait_for_schema, url, 0) == 2  # not migrated yet
    await asyncio.to_thread(run_migrations, url)
    await asyncio.to_thread(check_schema, url)
    assert await asyncio.to_thread(wait_for_schema, url, 0) == 0


async def test_the_service_runs_a_batch_and_streams_its_groups_through_it(
    database_url: str, db: Database, pgbouncer: int, sim: tuple[SimWorker, str]
) -> None:
    settings = service_settings(
        through(database_url, pgbouncer), sim[1], database_transaction_pooler=True, max_running_episodes=8
    )
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        response = await http.post("/episodes", json=submission("pooled", TASKS, SAMPLES))
        assert response.status_code == 202, response.text
        episodes = await wait_batch_finished(db, "pooled", FINISH_TIMEOUT_SECONDS)
        groups = await complete_groups(http, "pooled")
        assert (await http.get("/ready")).status_code == 200
        counts = (await http.get("/batches/pooled")).json()["counts"]
    assert len(episodes) == sum(counts.values()) == TASKS * SAMPLES
    assert not any(episode.status == "failed" for episode in episodes), [
        (episode.status, episode.error) for episode in episodes
    ]
    # The groups log numbered every group under its advisory lock: each once, in order.
    assert sorted(groups) == list(range(TASKS))


async def complete_groups(http: httpx.AsyncClient, batch_id: str) -> list[int]:
    seen: list[int] = []
    cursor = 0
    while len(seen) < TASKS:
        page = await http.get("/groups", params={"batch_id": batch_id, "after": cursor, "wait": 5})
        assert page.status_code == 200, page.text
        body = page.json()
        seen += [group["group_index"] for group in body["groups"]]
        cursor = body["next"]
    return seen
