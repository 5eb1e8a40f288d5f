"""The suite's guard against connections and tasks left open in a closed event loop
(tests/support/open_connections.py): the test that leaves one fails, naming it; one that closes its
connections passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = """
import asyncio
import socket


def served() -> socket.socket:
    return socket.create_server(("127.0.0.1", 0))


def test_leaves_one_open() -> None:
    with served() as server:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(asyncio.open_connection(*server.getsockname()))
        loop.close()


def test_leaves_a_task_pending() -> None:
    loop = asyncio.new_event_loop()
    loop.create_task(asyncio.sleep(60), name="sleeper")
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()


def test_closes_its_own() -> None:
    with served() as server:
        loop = asyncio.new_event_loop()

        async def talk() -> None:
            _, writer = await asyncio.open_connection(*server.getsockname())
            writer.close()
            await writer.wait_closed()

        loop.run_until_complete(talk())
        loop.close()
"""


def test_what_a_closed_loop_left_open_fails_the_test_that_left_it(tmp_path: Path) -> None:
    (tmp_path / "test_loops.py").write_text(TESTS)
    command = [sys.executable, "-m", "pytest", "-p", "tests.support.open_connections",
               "-p", "no:cacheprovider", "-W", "ignore::ResourceWarning", "-c", os.devnull,
               "--rootdir", str(tmp_path), "-rA", str(tmp_path / "test_loops.py")]  # fmt: skip
    run = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        # No plugin of the suite's environment but the guard: a bare pytest starts in a second.
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "ERROR test_loops.py::test_leaves_one_open" in run.stdout, run.stdout
    assert "PASSED test_loops.py::test_closes_its_own" in run.stdout, run.stdout
    assert "an event loop was closed with this still open in it" in run.stdout
    assert "ERROR test_loops.py::test_leaves_a_task_pending" in run.stdout, run.stdout
    assert "a task still pending, during test_loops.py::test_leaves_a_task_pending" in run.stdout
    assert "name='sleeper'" in run.stdout
    assert "opened during test_loops.py::test_leaves_one_open" in run.stdout
    assert "test_loops.py:13 in test_leaves_one_open" in run.stdout, run.stdout
