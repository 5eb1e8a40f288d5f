"""The tests' service processes fork from a preloaded zygote (tests/support/zygote.py): a forked
`python -m service serve` must be what an exec'd one is, its own session, environment, working
directory and log, and end as one does; an environment read at import time it cannot reproduce is
exec'd."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support.ports import free_port
from tests.support.service_process import REPO_DIR, SERVICE_ENV, ServiceProcess
from tests.support.zygote import ForkedProcess, launch


def environment(database_url: str, **more: str) -> dict[str, str]:
    settings = {key.upper(): str(value) for key, value in SERVICE_ENV.items()}
    engine = "http://127.0.0.1:9"  # never called
    return {**os.environ, **settings, "DATABASE_URL": database_url, "SGLANG_URL": engine, **more}


async def started(database_url: str, log: Path, **more: str) -> ServiceProcess:
    port = free_port()
    env = environment(database_url, **more)
    process = launch(["serve", "--host", "127.0.0.1", "--port", str(port)], env, REPO_DIR, log)
    service = ServiceProcess(process, f"http://127.0.0.1:{port}", log)
    await service.wait_healthy()
    return service


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_a_forked_service_is_what_an_exec_one_is(database_url: str, tmp_path: Path) -> None:
    forked = await started(database_url, tmp_path / "forked.log", API_KEYS="forked-key")
    # Another PYTHONPATH is read at the interpreter's start: the zygote cannot give it, so exec.
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    execd = await started(database_url, tmp_path / "execd.log", PYTHONPATH=path)
    try:
        assert isinstance(forked.process, ForkedProcess)
        assert isinstance(execd.process, subprocess.Popen)
        for service in (forked, execd):
            assert os.getsid(service.pid) == service.pid  # a session of its own, as start_new_session
            assert os.readlink(f"/proc/{service.pid}/cwd") == str(REPO_DIR)
        # Its settings are its own environment's, not the zygote's (the tests' have no API keys).
        async with httpx.AsyncClient(base_url=forked.url, timeout=10) as http:
            assert (await http.get("/batches")).status_code == 401
            keyed = await http.get("/batches", headers={"Authorization": "Bearer forked-key"})
            assert keyed.status_code == 200
        forked.terminate()
        execd.terminate()
        codes = [await forked.wait_exit(30), await execd.wait_exit(30)]
    finally:
        forked.kill()
        execd.kill()
    assert codes[0] == codes[1], codes  # uvicorn drains, then ends by the signal it drained on
    for service in (forked, execd):
        messages = [line["message"] for line in service.log_lines()]
        assert "Application startup complete." in messages
        assert "Application shutdown complete." in messages
