"""The command line's start-up, as a new user meets it: every configuration mistake is one line on
stderr saying what to do, exit code 2, no traceback; `migrate` says what it did; `sim-worker` says
where it listens and what it plays, and its /health says it too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from service.config import Settings
from service.storage.db import async_url, current_revision, head_revision
from tests.support.ports import free_port

CLI_TIMEOUT_SECONDS = 120.0


def run_cli(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "API_KEYS": "", **env}
    return subprocess.run(
        [sys.executable, "-m", "service", *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_SECONDS,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The failure's stderr, checked to be one `error:` line and exit code 2."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_the_urls_people_type_get_the_installed_drivers() -> None:
    assert async_url("postgresql://u@h/db") == "postgresql+asyncpg://u@h/db"
    assert async_url("postgres://u:p@h:5/db") == "postgresql+asyncpg://u:p@h:5/db"
    assert async_url("postgresql+psycopg://u@h/db") == "postgresql+asyncpg://u@h/db"
    assert async_url("sqlite:///./x.db") == "sqlite+aiosqlite:///./x.db"
    assert async_url("sqlite+aiosqlite:///x.db") == "sqlite+aiosqlite:///x.db"
    assert Settings(database_url="postgresql://u@h/db").database_url == "postgresql+asyncpg://u@h/db"
    for wrong in ("mysql://h/db", "rollouts.db"):
        with pytest.raises(ValueError, match=re.escape("postgresql://user@host/db or sqlite:///path.db")):
            async_url(wrong)


def test_migrate_takes_a_driverless_url_and_says_what_it_did(empty_database_url: str, tmp_path: Path) -> None:
    url = make_url(empty_database_url)
    typed = url.set(drivername=url.get_backend_name()).render_as_string(hide_password=False)
    assert "+" not in typed.split("://")[0]  # postgresql:// or sqlite://, as people type it
    first = run_cli("migrate", cwd=tmp_path, DATABASE_URL=typed)
    assert first.returncode == 0, first.stderr
    head = head_revision(empty_database_url)
    assert f"migrated from an empty database to {head}" in first.stdout
    assert current_revision(empty_database_url) == head
    again = run_cli("migrate", cwd=tmp_path, DATABASE_URL=typed)
    assert again.returncode == 0 and f"already at migration {head}, nothing to do" in again.stdout


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_a_database_that_does_not_exist_is_one_line(database_url: str, tmp_path: Path) -> None:
    missing = make_url(database_url).set(drivername="postgresql", database="h28_no_such_database")
    line = one_line_error(
        run_cli("serve", "--port", "0", cwd=tmp_path, DATABASE_URL=missing.render_as_string(False))
    )
    assert "'h28_no_such_database' does not exist" in line and "createdb" in line and "migrate" in line


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_an_unreachable_or_refusing_postgresql_is_one_line(database_url: str, tmp_path: Path) -> None:
    closed = make_url(database_url).set(port=free_port())
    line = one_line_error(run_cli("migrate", cwd=tmp_path, DATABASE_URL=closed.render_as_string(False)))
    assert "cannot reach PostgreSQL at" in line and "is it running" in line
    stranger = make_url(database_url).set(username="h28_nobody")
    line = one_line_error(run_cli("serve", cwd=tmp_path, DATABASE_URL=stranger.render_as_string(False)))
    assert "refused user 'h28_nobody'" in line


def test_sqlite_in_a_missing_directory_and_other_databases_are_one_line(tmp_path: Path) -> None:
    line = one_line_error(run_cli("serve", cwd=tmp_path, DATABASE_URL="sqlite:///./no/such/dir/x.db"))
    assert "no directory" in line and "create it" in line
    line = one_line_error(run_cli("migrate", cwd=tmp_path, DATABASE_URL="mysql://h/db"))
    assert line.startswith("error: DATABASE_URL: ") and "PostgreSQL or SQLite" in line


def test_a_missing_tokenizer_is_one_line(database_url: str, tmp_path: Path) -> None:
    line = one_line_error(
        run_cli("serve", cwd=tmp_path, DATABASE_URL=database_url, TOKENIZER_PATH=str(tmp_path / "nope"))
    )
    assert "TOKENIZER_PATH" in line and "does not exist" in line


def test_a_busy_port_is_one_line(database_url: str, tmp_path: Path) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        line = one_line_error(run_cli("serve", "--port", str(port), cwd=tmp_path, DATABASE_URL=database_url))
    assert f"cannot listen on 127.0.0.1:{port}" in line and "--port" in line


def test_sim_worker_says_where_it_listens_and_what_it_plays(tmp_path: Path) -> None:
    port = free_port()
    with subprocess.Popen(
        [sys.executable, "-m", "service", "sim-worker", "--port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            _check_sim_worker(process, port)
        finally:
            process.terminate()
            _, errors = process.communicate(timeout=30)
    assert "PyTorch was not found" not in errors


def _check_sim_worker(process: subprocess.Popen[str], port: int) -> None:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert f"listening on http://127.0.0.1:{port}" in line, line
    assert "policy built-in" in line and f"SGLANG_URL=http://127.0.0.1:{port}" in line
    deadline = time.monotonic() + CLI_TIMEOUT_SECONDS
    while True:
        try:
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline and process.poll() is None, "the simulated worker died"
            time.sleep(0.1)
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok" and body["simulated"] is True
    assert body["policy"].startswith("built-in") and body["requests"] == 0
